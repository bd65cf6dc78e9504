"""Regeneration through an OpenAI-compatible server (`data.regenerate.backend: openai`), against a loopback fake
that serves the tiny target greedily: the same answers and file as the in-process backend, resumable per
conversation, faults (server down, 429/500, server dying mid-run) handled without loss or duplicates."""

from __future__ import annotations

import json

import pytest
import torch
from openai_fake import FakeOpenAIServer
from training_fixtures import tiny_llama_target

from eagle3_zoo.data.engine.regenerate_server import regenerate_with_client
from eagle3_zoo.data.readers import Conversation
from eagle3_zoo.data.regenerate import regenerate_conversations
from eagle3_zoo.targets.openai_client import OpenAIClient, ServerError
from eagle3_zoo.targets.server import free_port


@pytest.fixture(scope="module")
def tiny():
    model, tok, adapter = tiny_llama_target()
    # the random model's vocabulary (512) is larger than its tokenizer's (464): ids the tokenizer cannot decode are
    # never generated (a server answer holding them is refused, as a trained target never emits them)
    model.generation_config.suppress_tokens = list(range(len(tok), model.config.vocab_size))
    return model, tok, adapter


def _served(model, tok, port=0):
    """A fake server whose completions are the tiny target's greedy continuation (stop token included)."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    @torch.no_grad()
    def generate(prompt, max_tokens, stop_ids):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=stop_ids or None, pad_token_id=pad)
        return out[0, len(prompt):].tolist()

    return FakeOpenAIServer(generate=generate, port=port)


def _convs(n=5):
    questions = ["Hello", "What is the capital of France? Explain in one sentence.", "Thanks!", "Count to five.",
                 "Name a colour."]
    return [Conversation(id=f"c{i}", source="data.jsonl", index=i,
                         messages=[{"role": "user", "content": questions[i % len(questions)] + f" ({i})"},
                                   {"role": "assistant", "content": "old"},
                                   {"role": "user", "content": "And then?"},
                                   {"role": "assistant", "content": "old"}]) for i in range(n)]


def _records(path):
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda r: r["index"])


KW = dict(max_new_tokens=6, temperature=0.0)


def test_openai_backend_equals_hf_backend(tiny, tmp_path):
    model, tok, adapter = tiny
    convs = _convs()
    hf, _ = regenerate_conversations(convs, model, tok, adapter, tmp_path / "hf.jsonl", batch_size=1, **KW)
    with _served(model, tok) as server:
        client = OpenAIClient(server.url, retries=0)
        served, stats = regenerate_with_client(convs, client, tok, adapter, tmp_path / "api.jsonl", concurrency=3,
                                               **KW)
        assert server.completions[0]["prompt"] and isinstance(server.completions[0]["prompt"][0], int)
    assert [c.messages for c in served] == [c.messages for c in hf]
    assert stats.generated == 5 and stats.turns == 10
    assert _records(tmp_path / "api.jsonl") == _records(tmp_path / "hf.jsonl")  # same records, any line order


def test_server_down_at_start_names_the_url_and_writes_nothing(tiny, tmp_path):
    _, tok, adapter = tiny
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError, match=f"no OpenAI-compatible server answers at {url}"):
        regenerate_with_client(_convs(), OpenAIClient(url, retries=0), tok, adapter, tmp_path / "x.jsonl", **KW)
    assert not (tmp_path / "x.jsonl").exists() or (tmp_path / "x.jsonl").read_text() == ""


def test_429_and_500_are_retried(tiny, tmp_path):
    model, tok, adapter = tiny
    with _served(model, tok) as server:
        server.faults = [429, 500, 503]
        out, stats = regenerate_with_client(_convs(2), OpenAIClient(server.url, retries=3, backoff=0.01), tok,
                                            adapter, tmp_path / "r.jsonl", concurrency=1, **KW)
    assert stats.generated == 2 and len(_records(tmp_path / "r.jsonl")) == 2


def test_server_failing_mid_run_keeps_whole_conversations_and_rerun_completes(tiny, tmp_path):
    model, tok, adapter = tiny
    convs = _convs(6)
    reference, _ = regenerate_conversations(convs, model, tok, adapter, tmp_path / "ref.jsonl", batch_size=1, **KW)
    path = tmp_path / "api.jsonl"
    with _served(model, tok) as server:
        server.fail_after = 5  # 5 completions (2 conversations of 2 turns + 1 turn), then HTTP 503 for good
        with pytest.raises(ServerError, match=r"stopped: .*HTTP 503.*\(2 attempts\).*; 2 of 6 conversations done "
                                              r"this run are kept in .*api.jsonl \(0 from before\); rerun"):
            regenerate_with_client(convs, OpenAIClient(server.url, retries=1, backoff=0.01), tok, adapter, path,
                                   concurrency=1, **KW)
    assert len(_records(path)) == 2
    with _served(model, tok) as server:  # the server is back
        out, stats = regenerate_with_client(convs, OpenAIClient(server.url, retries=0), tok, adapter, path,
                                            concurrency=2, **KW)
    assert (stats.reused, stats.generated) == (2, 4)
    assert stats.conversations == 6 and stats.answer_turns >= 6  # what the data holds, the reused ones included
    ids = [r["id"] for r in _records(path)]
    assert sorted(ids) == sorted(c.uid for c in convs)  # nothing lost, nothing twice
    assert [c.messages for c in out] == [c.messages for c in reference]


def test_torn_last_line_of_a_killed_run_is_cut_and_answered_again(tiny, tmp_path):
    model, tok, adapter = tiny
    convs = _convs(3)
    with _served(model, tok) as server:
        client = OpenAIClient(server.url, retries=0)
        full, _ = regenerate_with_client(convs, client, tok, adapter, tmp_path / "full.jsonl", concurrency=1, **KW)
        lines = (tmp_path / "full.jsonl").read_text().splitlines(keepends=True)
        (tmp_path / "torn.jsonl").write_text(lines[0] + lines[1][:20])  # killed mid-write
        out, stats = regenerate_with_client(convs, client, tok, adapter, tmp_path / "torn.jsonl", **KW)
    assert (stats.reused, stats.generated) == (1, 2)
    assert _records(tmp_path / "torn.jsonl") == _records(tmp_path / "full.jsonl")


def test_recipe_backend_openai_shares_the_cache_key_and_needs_a_url(tmp_path):
    from training_fixtures import tiny_recipe, write_chat_jsonl, write_recipe

    from eagle3_zoo.adapters import get_adapter
    from eagle3_zoo.data.engine.regenerate_server import regenerate_for_recipe
    from eagle3_zoo.data.prepare import regenerated_path
    from eagle3_zoo.recipe.sections import load_recipe

    tok = get_adapter("llama").tiny_tokenizer()
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, tmp_path, write_chat_jsonl(tmp_path / "c.jsonl")))
    hf = load_recipe(path, ["data.regenerate.enabled=true"])
    api = load_recipe(path, ["data.regenerate.enabled=true", "data.regenerate.backend=openai",
                             "data.regenerate.base_url=http://127.0.0.1:9", "data.regenerate.concurrency=8"])
    assert regenerated_path(hf.data, tok, "t") == regenerated_path(api.data, tok, "t")
    no_url = load_recipe(path, ["data.regenerate.enabled=true", "data.regenerate.backend=openai"])
    with pytest.raises(ValueError, match="needs data.regenerate.base_url"):
        regenerate_for_recipe(no_url, _convs(1), tok, None, tmp_path / "x.jsonl")


@pytest.mark.parametrize("name", ["qwen3", "harmony"])
def test_regeneration_renders_with_the_template_kwargs_and_keeps_the_reasoning(name):
    from eagle3_zoo.adapters.base import TargetAdapter
    from eagle3_zoo.data.regenerate import _render_prompt, _to_answer, decode_reply

    adapter = type("Adapter", (TargetAdapter,), {"chat_format_names": (name,)})()  # not registered
    tok = adapter.tiny_tokenizer()
    fmt = adapter.chat_format(tok)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    if name == "qwen3":  # thinking off puts the empty block into the prompt; on (default) it does not
        off = tok.decode(_render_prompt(tok, adapter, messages, {"enable_thinking": False}))
        assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert tok.decode(_render_prompt(tok, adapter, messages, {})).endswith("<|im_start|>assistant\n")
        reply = "<think>\nFrance: Paris.\n</think>\n\nParis."
    else:
        low = tok.decode(_render_prompt(tok, adapter, messages, {"reasoning_effort": "low"}))
        assert "Reasoning: low" in low and low.endswith("<|start|>assistant")
        reply = "<|channel|>analysis<|message|>France: Paris.<|end|><|start|>assistant<|channel|>final<|message|>Paris."
    ids = tok(reply, add_special_tokens=False)["input_ids"]
    assert decode_reply(tok, adapter, ids, {}) == {"role": "assistant", "content": "Paris.",
                                                   "reasoning": "France: Paris."}
    if fmt.thinking_off:
        plain = tok("Paris.", add_special_tokens=False)["input_ids"]
        assert decode_reply(tok, adapter, plain, dict(fmt.thinking_off)) == {"role": "assistant", "content": "Paris."}
    assert not _to_answer({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]})


def test_served_prompts_carry_the_conversations_tool_definitions(tiny, tmp_path):
    model, tok, adapter = tiny
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city.",
                                               "parameters": {"type": "object"}}}]
    convs = [Conversation(id="t0", source="data.jsonl", index=0, tools=tools,
                          messages=[{"role": "user", "content": "Weather in Paris?"},
                                    {"role": "assistant", "content": "old"}])]
    hf, _ = regenerate_conversations(convs, model, tok, adapter, tmp_path / "hf.jsonl", batch_size=1, **KW)
    with _served(model, tok) as server:
        served, _ = regenerate_with_client(convs, OpenAIClient(server.url, retries=0), tok, adapter,
                                           tmp_path / "api.jsonl", **KW)
        prompt = server.completions[0]["prompt"]
    assert "Current weather of a city." in tok.decode(prompt)
    assert [c.messages for c in served] == [c.messages for c in hf] and served[0].tools == tools


def test_a_rank_started_after_the_merge_does_not_wait_for_conversations_refused_before(tmp_path, monkeypatch):
    """Rank 1 of 2 starting after the others finished and merged (processes started by hand, far apart) finds the
    conversations refused by that run still to do: it asks again for its share of them and, once no rank has been
    writing for `REFUSED_WAIT_S`, takes the rest as refused (asked again by the next run) instead of waiting forever
    for a rank 0 that is gone."""
    import threading

    from training_fixtures import in_vocabulary_server, regen_conversations

    from eagle3_zoo.adapters import get_adapter
    from eagle3_zoo.data import regenerate
    from eagle3_zoo.data.ranks import RankSplit

    adapter = get_adapter("llama")
    tok = adapter.tiny_tokenizer()
    convs, path = regen_conversations(12), tmp_path / "answers.jsonl"
    kw = dict(max_new_tokens=4, concurrency=1, on_error="skip")
    with in_vocabulary_server(refuse_every=3) as server:
        _, first = regenerate_with_client(convs, OpenAIClient(server.url, retries=0), tok, adapter, path, **kw)
    refused = first.skipped["server_answer_refused"]
    assert refused >= 2 and path.with_name(path.name + ".refused").is_file()
    monkeypatch.setattr(regenerate, "REFUSED_WAIT_S", 0.0)
    late = {}
    with in_vocabulary_server() as server:  # fixed: rank 1's share is answered this time
        def rank_1():
            late["stats"] = regenerate_with_client(convs, OpenAIClient(server.url, retries=0), tok, adapter, path,
                                                   split=RankSplit(1, 2), **kw)[1]
        thread = threading.Thread(target=rank_1, daemon=True)
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "rank 1 waits for conversations nobody answers"
    stats = late["stats"]
    assert stats.generated == refused // 2  # its share: batches 1, 3, ... of the refused ones (batches of 1)
    assert stats.skipped["server_answer_refused"] == refused - stats.generated
    assert stats.conversations == 12 - stats.skipped["server_answer_refused"]


def test_progress_lines_come_at_the_interval_while_an_answer_is_slow(tiny, tmp_path, monkeypatch, caplog):
    """A log line every EAGLE3_ZOO_LOG_EVERY_S although no answer completes within it (a quickstart regeneration,
    2 batches of 64 conversations on a loaded CPU, logged 2 lines in 16.5 min: lines came only when a batch ended)."""
    import logging

    model, tok, adapter = tiny
    monkeypatch.setenv("EAGLE3_ZOO_LOG_EVERY_S", "0.4")
    with _served(model, tok) as server, caplog.at_level(logging.INFO, logger="eagle3_zoo.data.regenerate"):
        server.delay = 2.0  # one answer takes 5 intervals
        regenerate_with_client(_convs(1), OpenAIClient(server.url, retries=0), tok, adapter, tmp_path / "s.jsonl",
                               concurrency=1, max_turns=1, **KW)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("regenerating: ")]
    waiting = [line for line in lines if line.startswith("regenerating: 0/1 conv (0%)")]
    assert len(waiting) >= 3, lines
    assert "waiting" in waiting[-1] and waiting[-1].endswith("s elapsed")
    assert lines[-1].startswith("regenerating: 1/1 conv (100%)")
