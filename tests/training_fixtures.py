"""Tiny offline fixtures for the training tests: a random 4-layer Llama target saved with a tiny byte-level BPE
tokenizer (Llama-3 chat template), a JSONL chat dataset, and recipe files. No downloads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]

_SENTENCES = [
    "What is the capital of France?", "The capital of France is Paris.", "And of Italy?", "Rome, of course.",
    "Say goodbye in French.", "Au revoir!", "Hello, how are you today?", "The quick brown fox jumps over the lazy dog.",
    "Explain speculative decoding in one sentence.",
    "A small draft model proposes tokens that the target verifies.", "Thanks!", "0123456789",
]


def tiny_llama_target() -> tuple[Any, Any, Any]:
    """A frozen random tiny Llama (seed 0), its tiny tokenizer and the llama adapter, in memory."""
    from transformers import LlamaForCausalLM

    from eagle3_zoo.adapters import get_adapter

    adapter = get_adapter("llama")
    torch.manual_seed(0)
    model = LlamaForCausalLM(adapter.tiny_config()).eval().requires_grad_(False)
    return model, adapter.tiny_tokenizer(), adapter


def save_tiny_target(directory: Path, seed: int = 0, num_layers: int = 4, tied: bool = False) -> Path:
    """A random Llama target (hidden 64, 4 layers, vocab 512) + tokenizer in `directory` (`tied`: lm_head is the
    embedding, stored once)."""
    from transformers import LlamaForCausalLM

    from eagle3_zoo.adapters import get_adapter

    adapter = get_adapter("llama")
    config = adapter.tiny_config()
    config.num_hidden_layers = num_layers
    config.tie_word_embeddings = tied
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    adapter.tiny_tokenizer().save_pretrained(directory)
    return directory


def write_chat_jsonl(path: Path, n: int = 24, seed: int = 0, turns: int = 1) -> Path:
    """`n` ShareGPT-style conversations of `turns` user/assistant exchanges built from fixed sentences."""
    rng = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(n):
            conv = []
            for _ in range(turns):
                a, b, c = (int(x) for x in torch.randint(len(_SENTENCES), (3,), generator=rng))
                conv.append({"from": "human", "value": _SENTENCES[a]})
                conv.append({"from": "gpt", "value": f"{_SENTENCES[b]} {_SENTENCES[c]}"})
            f.write(json.dumps({"id": f"c{i}", "conversations": conv}) + "\n")
    return path


def tiny_recipe(tmp: Path, target_dir: Path, data_file: Path, **sections: Any) -> dict[str, Any]:
    """A recipe dict for the tiny target; `sections` deep-update it (e.g. trainer={"max_steps": 6})."""
    recipe = {
        "target": {"name_or_path": str(target_dir), "family": "llama", "dtype": "float32"},
        "drafter": {"draft_vocab_size": 128, "aux_layer_ids": [1, 2, 3]},
        "data": {"sources": [{"path": str(data_file)}], "max_length": 128, "on_error": "skip", "num_workers": 0,
                 "val_fraction": 0.2, "cache_dir": str(tmp / "cache"), "features_dtype": "float32",
                 "features_shard_size": 4},
        "ttt": {"steps": 3, "schedule": "constant"},
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "trainer": {"max_steps": 4, "max_epochs": None, "precision": "32-true", "devices": 1, "batch_size": 2,
                    "checkpoint_every_n_steps": 2, "val_check_interval": 3, "log_every_n_steps": 1,
                    "logger": ["csv"]},
        "output_dir": str(tmp / "run"),
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            recipe.setdefault(section, {}).update(values)
        else:
            recipe[section] = values
    return recipe


def write_recipe(path: Path, recipe: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def tiny_run_files(tmp: Path, n: int = 24, **sections: Any) -> Path:
    """A tiny target, `n` conversations and the recipe over them (`tiny_recipe` sections) in `tmp`; the recipe."""
    target = save_tiny_target(tmp / "target")
    data = write_chat_jsonl(tmp / "chat.jsonl", n=n)
    return write_recipe(tmp / "tiny.yaml", tiny_recipe(tmp, target, data, **sections))


def cli_entry() -> list[str]:
    """`-m eagle3_zoo.cli fit`: the package CLI, the entry Lightning relaunches for the other ranks."""
    return ["-m", "eagle3_zoo.cli", "fit"]


def subprocess_env(**extra: str) -> dict[str, str]:
    # MKL_CBWR=AUTO,STRICT: MKL gemm results independent of memory alignment, so two processes (an uninterrupted
    # run and a resumed one) compute bit-identical steps; without it, rare last-bit differences get amplified by
    # Adam on near-zero gradients.
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_CBWR": "AUTO,STRICT", "CUDA_VISIBLE_DEVICES": "",
            "PYTHONWARNINGS": "ignore", **extra}


def run_fit_cli(recipe: Path, *overrides: str, timeout: float = 300,
                cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m eagle3_zoo.cli fit RECIPE overrides...` in a subprocess (1 thread, no GPU)."""
    return subprocess.run([sys.executable, *cli_entry(), str(recipe), *overrides], capture_output=True,
                          text=True, timeout=timeout, env=subprocess_env(), cwd=cwd or REPO)


def regen_conversations(n: int = 5) -> list[Any]:
    """`n` two-turn conversations of varied first-prompt lengths, for the regeneration tests."""
    from eagle3_zoo.data.readers import Conversation

    return [Conversation(id=f"c{i}", source="data.jsonl", index=i, messages=[
        {"role": "user", "content": _SENTENCES[i % len(_SENTENCES)] * (1 + i % 3)},
        {"role": "assistant", "content": "old"}, {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "old"}]) for i in range(n)]


def regenerate_share(rank: int, world_size: int, out: str, n: int = 5, batch_size: int = 2) -> int:
    """Rank `rank` of `world_size` regenerating `regen_conversations(n)` into `out` (a process of the rank-split
    tests); returns the conversations it generated."""
    from eagle3_zoo.data.ranks import RankSplit
    from eagle3_zoo.data.regenerate import regenerate_conversations

    torch.set_num_threads(1)
    model, tok, adapter = tiny_llama_target()
    _, stats = regenerate_conversations(regen_conversations(n), model, tok, adapter, out, max_new_tokens=5,
                                        batch_size=batch_size, split=RankSplit(rank, world_size))
    return stats.generated


def in_vocabulary_server(refuse_every: int = 0) -> Any:
    """A loopback OpenAI-compatible server (tests/openai_fake.py) whose answer to a prompt is three in-vocabulary ids
    of the tiny tokenizer that depend on the prompt, then the stop id; with `refuse_every`, prompts whose id sum is a
    multiple of it get an id outside the vocabulary instead (an answer the regeneration refuses)."""
    from openai_fake import FakeOpenAIServer

    def generate(prompt: list[int], max_tokens: int, stop: list[int]) -> list[int]:
        if refuse_every and sum(prompt) % refuse_every == 0:
            return [10**6]
        return [10 + (sum(prompt) * 7 + i) % 400 for i in range(min(3, max_tokens))] + stop[:1]

    return FakeOpenAIServer(generate=generate)


def prepare_share_served(rank: int, world_size: int, recipe: str, url: str, *overrides: str) -> dict[str, Any]:
    """Rank `rank` of `world_size` running the data stage of `recipe` (the tiny tokenizer) with regeneration through
    the OpenAI-compatible server at `url` (`data.regenerate.backend=openai`); returns its regeneration summary."""
    from eagle3_zoo.adapters import get_adapter
    from eagle3_zoo.data.prepare import prepare_data
    from eagle3_zoo.data.ranks import RankSplit
    from eagle3_zoo.recipe.sections import load_recipe

    torch.set_num_threads(1)
    adapter = get_adapter("llama")
    tok = adapter.tiny_tokenizer()
    loaded = load_recipe(recipe, ["data.regenerate.enabled=true", "data.regenerate.backend=openai",
                                  f"data.regenerate.base_url={url}", "data.regenerate.retries=0",
                                  "data.regenerate.max_new_tokens=4", *overrides])
    prepared = prepare_data(loaded, tok, adapter, target_id="tiny", vocab_size=len(tok),
                            split=RankSplit(rank, world_size))
    return prepared.regenerate


def feature_examples(n: int = 11) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    return [{"id": f"s{i}", "input_ids": torch.randint(512, (int(k),), generator=g),
             "loss_mask": torch.ones(int(k), dtype=torch.long)} for i, k in enumerate(torch.randint(4, 30, (n,)))]


def write_feature_share(rank: int, world_size: int, out: str) -> None:
    """Rank `rank` of `world_size` of the feature job over `feature_examples()` into `out`, waiting for the others."""
    from eagle3_zoo.data.feature_job import write_features
    from eagle3_zoo.data.ranks import RankSplit

    torch.set_num_threads(1)
    model, _, adapter = tiny_llama_target()
    write_features(feature_examples(), model, adapter, out, aux_layer_ids=(1, 2, 3), batch_size=2, shard_size=3,
                   dtype="float32", meta={"k": 1}, split=RankSplit(rank, world_size))


TAU_PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14, 15, 16, 17, 18], [19]]


def tau_eval_rank(rank: int, world_size: int, init_file: str, dirs: list[str]) -> dict[str, Any]:
    """Rank `rank` of a `world_size`-process gloo group (1 = no group): the tau-eval callback's summary over
    `TAU_PROMPTS` with a tiny target and a "noisy" oracle drafter (per-prompt acceptance varies), and the
    `split_for` of each of `dirs`."""
    import torch.distributed as dist
    from test_speculative_support import OracleDraftModel, tiny_target

    from eagle3_zoo.data.ranks import split_for
    from eagle3_zoo.speculative import TauEvalCallback

    class Drafter(OracleDraftModel):  # what the callback asks of a drafter module
        training = False

        def parameters(self):
            return iter(())

        def train(self, mode=True):
            return self

        def eval(self):
            return self

    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        target = tiny_target("llama")
        module = type("Module", (), {"drafter": Drafter(target, kind="noisy"), "target": target})()
        summary = TauEvalCallback(TAU_PROMPTS, max_new_tokens=8, depth=3, top_k=2, total_tokens=6).measure(module)
        splits = [split_for(d) for d in dirs]
        return {"summary": summary, "splits": [(s.rank, s.world_size) for s in splits]}
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def fsdp_tau_eval_rank(rank: int, world_size: int, init_file: str, diverge: bool = False,
                       shard_target: bool = True) -> dict[str, Any]:
    """Rank `rank` of a `world_size`-process gloo group (1 = one process, nothing sharded): the tau-eval summary over
    `TAU_PROMPTS` of an online `DrafterModule` whose drafter and target decoder layers are FSDP2-sharded (bf16-mixed
    policy on the drafter), and the drafter it decoded with (weights, fc preconditioning). Vocabulary 24, so the
    random drafter (fc preconditioned, a real 12-token draft vocab) accepts some drafts. Before measuring: one
    training forward/backward and a validation forward, after which the FSDP root holds its gathered bf16
    parameters (returned as `held`). `diverge`: rank 1 decodes the prompts reversed; returns the error then.
    `shard_target=False`: only the drafter is sharded (as in offline mode, where the target stays whole)."""
    from datetime import timedelta

    import torch.distributed as dist
    from test_speculative_support import random_drafter, tiny_target

    from eagle3_zoo.adapters import get_adapter
    from eagle3_zoo.speculative import TauEvalCallback, callback
    from eagle3_zoo.training.module import DrafterModule
    from eagle3_zoo.training.strategies import shard_fsdp2

    decoded_with: dict[str, Any] = {}

    class Recording(callback.SpeculativeGenerator):
        def __init__(self, target, drafter, *args, **kwargs):
            decoded_with.update(state={k: v.clone() for k, v in drafter.state_dict().items()},
                                fc_input_scale=drafter.fc_input_scale.clone(), fc_scaled=drafter._fc_scaled)
            super().__init__(target, drafter, *args, **kwargs)

    torch.set_num_threads(1)
    if world_size > 1:  # a hang becomes an error after a minute
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=60))
    generator_class, callback.SpeculativeGenerator = callback.SpeculativeGenerator, Recording
    try:
        target, adapter = tiny_target("llama", vocab_size=24), get_adapter("llama")
        drafter = random_drafter(target, seed=2, draft_vocab_size=12).requires_grad_(True)
        hidden = target.config.hidden_size
        drafter.set_fc_input_scale(torch.rand(3 * hidden, generator=torch.Generator().manual_seed(3)) + 0.5)
        module = DrafterModule(drafter, adapter, target, ttt_steps=2)
        if world_size > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("data_parallel",))
            shard_fsdp2(target if shard_target else None, adapter, module.objective, mesh, precision="bf16-mixed")
        ids = torch.randint(24, (1, 12), generator=torch.Generator().manual_seed(4))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
        module.loss(batch, 2).loss.backward()  # no optimizer step: the weights stay those of one process
        with torch.no_grad():
            module.loss(batch, 2)
        held = module.drafter.fc.weight.dtype
        prompts = TAU_PROMPTS[::-1] if diverge and rank == 1 else TAU_PROMPTS
        try:
            summary = TauEvalCallback(prompts, max_new_tokens=8, depth=3, top_k=2, total_tokens=6).measure(module)
        except RuntimeError as e:
            return {"error": str(e)}
        return {"summary": summary, "held": held, **decoded_with}
    finally:
        callback.SpeculativeGenerator = generator_class
        if world_size > 1:
            dist.destroy_process_group()


# EAGLE-3-only settings a block drafter kind (DFlash, DSpark) refuses, as (override, the key its error names)
EAGLE3_ONLY_OVERRIDES = [
    ("drafter.aux_layer_ids=[1,2,3]", "drafter.aux_layer_ids"),
    ("drafter.fc_norm=true", "drafter.fc_norm"),
    ("drafter.init_head=target", "drafter.init_head"),
    ("ttt.schedule=ramp", "ttt.schedule"),
    ("loss.name=tv", "loss.name"),
    ("optim.precondition_fc=true", "optim.precondition_fc"),
    ("trainer.tau_eval.every_n_steps=5", "trainer.tau_eval.every_n_steps"),
    ("trainer.activation_checkpointing=true", "trainer.activation_checkpointing"),
]
