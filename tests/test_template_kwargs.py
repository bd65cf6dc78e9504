"""A drafter trained with chat-template kwargs is measured on the prompts it was trained on.

The data stage renders every conversation with the recipe's ``data.chat_template_kwargs``; `eagle3-zoo eval` (from
the drafter folder's recipe.yaml) and the training-time tau callback (from the running recipe) must render their
prompts with the same template and kwargs. Qwen3's template reacts to ``enable_thinking: false`` (an empty
``<think></think>`` block in the generation prompt), so a prompt rendered with the template's defaults differs from
the training prompt in its last tokens.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from eagle3_zoo.adapters import get_adapter
from eagle3_zoo.cli import main as cli_main
from tests.test_speculative_support import random_drafter, tiny_target
from tests.training_fixtures import tiny_recipe, write_recipe

THINKING_OFF = {"enable_thinking": False}
QUESTION = "What is the capital of France?"


def _trained_folder(tmp_path, kwargs=THINKING_OFF, tau_eval=None):
    """A tiny Qwen3 target folder, a random drafter folder for it holding the resolved recipe (as `fit` leaves it)
    with `kwargs` as data.chat_template_kwargs, and that recipe loaded."""
    from eagle3_zoo.recipe.sections import load_recipe, save_resolved_recipe

    adapter = get_adapter("qwen3")
    tokenizer = adapter.tiny_tokenizer()
    target = tiny_target("qwen3")
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    target.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": QUESTION},
                                             {"role": "assistant", "content": "Paris."}]}) + "\n")
    recipe = tiny_recipe(tmp_path, target_dir, data, target={"family": "qwen3"},
                         data={"chat_template_kwargs": dict(kwargs), "max_length": 4096, "val_fraction": 0.0},
                         trainer={"tau_eval": tau_eval or {}})
    recipe = load_recipe(write_recipe(tmp_path / "recipe.yaml", recipe))
    drafter = random_drafter(target, draft_vocab_size=128)
    drafter.config.target_name_or_path = str(target_dir)
    drafter.save_pretrained(drafter_dir)
    save_resolved_recipe(recipe, drafter_dir / "recipe.yaml")
    return target_dir, drafter_dir, recipe, tokenizer, adapter


def _training_prompt(d, tokenizer, adapter, question: str) -> list[int]:
    """The ids the data stage builds for the conversation (`question`, an answer) with the recipe's data settings
    `d`, up to the first supervised token: what the target had seen when the drafter learnt to draft the answer."""
    from eagle3_zoo.data.readers import Conversation
    from eagle3_zoo.data.tokenize import tokenize_conversations

    conv = Conversation(id="q", source="q.jsonl", index=0, messages=[{"role": "user", "content": question},
                                                                      {"role": "assistant", "content": "Paris."}])
    (example,), _ = tokenize_conversations([conv], tokenizer, adapter, max_length=d.max_length, overflow=d.overflow,
                                           on_error="raise", template_kwargs=dict(d.chat_template_kwargs))
    first = int(example["loss_mask"].nonzero()[0])
    return example["input_ids"][:first].tolist()


def _eval_prompts(monkeypatch, argv) -> tuple[int, list[list[int]]]:
    """`eagle3-zoo eval ARGV` through the command line's entry point; the exit code and the prompt ids the
    speculative decoder was given."""
    from eagle3_zoo.speculative.generate import SpeculativeGenerator

    seen: list[list[int]] = []
    generate = SpeculativeGenerator.generate

    def spy(self, input_ids, *args, **kwargs):
        seen.append(torch.as_tensor(input_ids).reshape(-1).tolist())
        return generate(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(SpeculativeGenerator, "generate", spy)
    return cli_main(["eval", *argv]), seen


def _bench(tmp_path) -> str:
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"id": "q", "turns": [QUESTION]}) + "\n")
    return str(bench)


def _args(tmp_path, drafter_dir, *extra: str) -> list[str]:
    return [str(drafter_dir), "--bench", _bench(tmp_path), "--mode", "chain", "--depth", "2", "--max-new-tokens",
            "3", "--no-baseline", "--warmup", "0", "--no-progress", "--out", str(tmp_path / "eval.json"), *extra]


def test_eval_renders_prompts_as_the_drafter_was_trained(tmp_path, monkeypatch):
    _, drafter_dir, recipe, tokenizer, adapter = _trained_folder(tmp_path)
    trained = _training_prompt(recipe.data, tokenizer, adapter, QUESTION)
    assert tokenizer.decode(trained).endswith("<think>\n\n</think>\n\n")  # the kwargs reach the data stage
    code, seen = _eval_prompts(monkeypatch, _args(tmp_path, drafter_dir))
    assert code == 0
    assert seen == [trained]  # the one request's prompt: token for token the training prompt
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["settings"]["chat_template_kwargs"] == THINKING_OFF


def test_eval_template_kwargs_from_the_command_line(tmp_path, monkeypatch, capsys):
    _, drafter_dir, recipe, tokenizer, adapter = _trained_folder(tmp_path)
    # the flag overrides the recipe: thinking on renders the prompt of a recipe without kwargs
    code, seen = _eval_prompts(monkeypatch, _args(tmp_path, drafter_dir, "--chat-template-kwargs",
                                                  '{"enable_thinking": true}'))
    assert code == 0
    thinking_on = dataclasses.replace(recipe.data, chat_template_kwargs={"enable_thinking": True})
    assert seen == [_training_prompt(thinking_on, tokenizer, adapter, QUESTION)]
    assert seen != [_training_prompt(recipe.data, tokenizer, adapter, QUESTION)]
    for bad, why in (("{enable_thinking: false}", "not JSON"), ('["enable_thinking"]', "got a JSON list")):
        assert cli_main(["eval", *_args(tmp_path, drafter_dir, "--chat-template-kwargs", bad)]) == 2
        err = capsys.readouterr().err
        assert "--chat-template-kwargs" in err and why in err


def test_eval_refuses_an_unreadable_training_recipe(tmp_path, capsys):
    _, drafter_dir, *_ = _trained_folder(tmp_path)
    (drafter_dir / "recipe.yaml").write_text("data:\n  chat_template_kwargs: [enable_thinking]\n")
    assert cli_main(["eval", *_args(tmp_path, drafter_dir)]) == 2
    err = capsys.readouterr().err
    assert "recipe.yaml: data.chat_template_kwargs must be a mapping" in err and "--chat-template-kwargs" in err


def test_tau_callback_renders_prompts_as_the_running_recipe_trains(tmp_path):
    """The tau callback `fit` builds from its recipe decodes MT-bench first turns rendered as the data stage renders
    the same conversations."""
    import types

    from eagle3_zoo.speculative import load_benchmark
    from eagle3_zoo.training.fit import _tau_eval_callbacks

    _, _, recipe, tokenizer, adapter = _trained_folder(tmp_path, tau_eval={"every_n_steps": 2, "num_prompts": 2})
    (callback,) = _tau_eval_callbacks(recipe.trainer.tau_eval, recipe.data, tokenizer)
    module = types.SimpleNamespace(adapter=adapter, tokenizer=tokenizer)
    prompts = [p.turns[0] for p in load_benchmark("mtbench", limit=2).prompts]
    trained = [_training_prompt(recipe.data, tokenizer, adapter, p) for p in prompts]
    assert [ids.tolist() for ids in callback._input_ids(module)] == trained


@pytest.mark.parametrize("kwargs", [{}, THINKING_OFF])
def test_benchmark_prompt_ids_equal_the_data_stage_prefix(tmp_path, kwargs):
    """`chat_input_ids` (evaluation) and the data stage agree for thinking on and off, multi-turn included."""
    from eagle3_zoo.chat.conversation import Message
    from eagle3_zoo.speculative.benchmarks import chat_input_ids, prompt_chat_format

    _, _, recipe, tokenizer, adapter = _trained_folder(tmp_path, kwargs)
    history = [Message("user", "Hello, how are you today?"), Message("assistant", "Thanks!"), Message("user", QUESTION)]
    conv = [m.as_dict() for m in history] + [{"role": "assistant", "content": "Paris."}]
    example = adapter.build_example(tokenizer, conv, 4096, template_kwargs=kwargs)
    mask = example["loss_mask"].tolist()
    start = max(i for i in range(1, len(mask)) if mask[i] and not mask[i - 1])  # where the last reply starts
    ids = chat_input_ids(tokenizer, history, prompt_chat_format(adapter, tokenizer), kwargs)
    assert ids.tolist() == example["input_ids"][:start].tolist()
