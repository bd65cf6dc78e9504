"""Conversations -> (input_ids, loss_mask) through the target's own chat template.

Approach (why not string offsets or per-role prefix/suffix data): the template is the source of truth for what the
target sees at inference, including the parts that per-role data cannot express (Qwen's default system prompt,
Llama-3.1's "Cutting Knowledge Date" header, `| trim` on contents, BOS placement). So we render with
`tokenizer.apply_chat_template` and *diff renderings of message prefixes*: for assistant message i,
`render(messages[:i], add_generation_prompt=True)` ends exactly where the reply starts and
`render(messages[:i + 1])` ends exactly where the turn ends. Both must be text prefixes of the full rendering;
templates for which that fails (e.g. ones that rewrite earlier turns) are detected and rejected with a clear error
instead of yielding a silently wrong mask. The diff is done on *text*, and the full text is tokenised once with
character offsets, so the ids equal `apply_chat_template(messages, tokenize=True)` and BPE merges across turn
boundaries cannot shift the mask (a token-level diff would break whenever the tokenizer merges across a boundary).
Inside the turn we supervise everything up to and including the family's declared end-of-turn token (the last one in
the turn), and nothing the template appends after it (ChatML's trailing newline).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
import yaml

from eagle3_zoo.adapters.testing import TinyTokenizerSpec

ROLES = ("system", "user", "assistant")


class TemplateMappingError(ValueError):
    """The chat template cannot be mapped to assistant loss masks (or rendering it failed)."""


@dataclass(frozen=True)
class ChatFormat:
    """A family's chat format, declared as data.

    Attributes:
        name: Short name used in errors and logs (e.g. ``"chatml"``).
        template: The family's real Jinja chat template; used when the tokenizer carries none.
        end_of_turn: The special token that closes an assistant turn; supervised together with the content.
        source: Where the template text came from (model repo and file).
        tokenizer: The special tokens of the family's tokenizer, for tiny test tokenizers; ``None`` if not declared.
    """

    name: str
    template: str
    end_of_turn: str
    source: str = ""
    tokenizer: TinyTokenizerSpec | None = None


CHAT_FORMATS_PACKAGE = "eagle3_zoo.resources"
_FORMAT_KEYS = {"name", "end_of_turn", "source", "tokenizer"}


@functools.cache
def load_chat_format(name: str) -> ChatFormat:
    """The chat format shipped as ``resources/chat_formats/<name>.jinja`` (template) + ``<name>.yaml`` (metadata).

    The YAML declares ``name``, ``end_of_turn``, ``source`` and optionally ``tokenizer`` (``special_tokens``,
    ``eos_token``, ``bos_token``, ``pad_token``).

    Raises:
        ValueError: if the files are missing or the metadata is malformed (naming the file and the valid keys).
    """
    folder = resources.files(CHAT_FORMATS_PACKAGE).joinpath("chat_formats")
    meta_file, template_file = folder.joinpath(f"{name}.yaml"), folder.joinpath(f"{name}.jinja")
    if not (meta_file.is_file() and template_file.is_file()):
        known = sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))
        raise ValueError(
            f"no chat format '{name}' in {folder} ({name}.yaml + {name}.jinja); shipped: {', '.join(known)}"
        )
    meta = yaml.safe_load(meta_file.read_text(encoding="utf-8"))
    where = f"chat format file {meta_file}"
    if not isinstance(meta, dict) or meta.get("name") != name or not isinstance(meta.get("end_of_turn"), str):
        raise ValueError(f"{where}: needs 'name: {name}' and a string 'end_of_turn'")
    if unknown := set(meta) - _FORMAT_KEYS:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; valid: {sorted(_FORMAT_KEYS)}")
    spec = meta.get("tokenizer")
    if spec is not None:
        try:
            spec = TinyTokenizerSpec(**{**spec, "special_tokens": tuple(spec["special_tokens"])})
        except (TypeError, KeyError) as err:
            raise ValueError(
                f"{where}: 'tokenizer' needs special_tokens and eos_token (optional bos_token, pad_token): {err}"
            ) from err
    template = template_file.read_text(encoding="utf-8")
    return ChatFormat(name, template, meta["end_of_turn"], source=str(meta.get("source", "")), tokenizer=spec)


def load_chat_formats(*names: str) -> tuple[ChatFormat, ...]:
    """`load_chat_format` for each name, in order."""
    return tuple(load_chat_format(name) for name in names)


def resolve_chat_format(tokenizer: Any, formats: Sequence[ChatFormat]) -> ChatFormat:
    """Pick the declared format that matches `tokenizer` (one family may ship several, e.g. Llama-3 and SmolLM2).

    With a template on the tokenizer, the format whose end-of-turn token the template emits wins; otherwise the first
    format whose end-of-turn token is in the vocabulary. A tokenizer template that matches no declared format falls
    back to the tokenizer's own EOS token if the template emits it.

    Raises:
        TemplateMappingError: if nothing matches.
    """
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        for fmt in formats:
            if fmt.end_of_turn in template:
                return fmt
        eos = getattr(tokenizer, "eos_token", None)
        if isinstance(eos, str) and eos and eos in template:
            return ChatFormat(name="tokenizer", template=template, end_of_turn=eos)
        raise TemplateMappingError(
            f"the tokenizer's chat template emits none of the declared end-of-turn tokens "
            f"{[f.end_of_turn for f in formats]} nor its eos_token {eos!r}; declare a ChatFormat for it in the adapter"
        )
    vocab = tokenizer.get_vocab()
    for fmt in formats:
        if fmt.end_of_turn in vocab:
            return fmt
    raise TemplateMappingError(
        f"the tokenizer has no chat template and none of the declared formats "
        f"{[f.name for f in formats]} matches its vocabulary; set tokenizer.chat_template"
    )


def build_chat_example(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    max_length: int,
    chat_format: ChatFormat,
    system_prompt: str | None = None,
) -> dict[str, torch.Tensor]:
    """Render `messages` with the chat template and mark the supervised assistant tokens.

    Args:
        tokenizer: A fast (offset-capable) Hugging Face tokenizer.
        messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
        max_length: Keep at most this many tokens (right truncation; the mask is truncated alike).
        chat_format: The family's format (see `resolve_chat_format`); its template is used when the tokenizer has none.
        system_prompt: Inserted as a leading system message when `messages` has none; ``None`` keeps the
            template's own default (e.g. Qwen-2.5's "You are Qwen, ...").

    Returns:
        ``{"input_ids": LongTensor[T], "loss_mask": LongTensor[T]}`` with ``loss_mask`` 1 exactly on assistant content
        tokens and each assistant turn's end-of-turn token. Empty (whitespace-only) assistant turns are rendered but
        not supervised: they teach nothing but "stop at once".

    Raises:
        ValueError: malformed messages or `max_length` < 1.
        TemplateMappingError: the template cannot be mapped (not prefix-stable, no end-of-turn token after a reply,
            rendering error, tokenizer without offsets).
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    messages = _validated(messages, system_prompt)
    template = getattr(tokenizer, "chat_template", None) or chat_format.template
    full = _render(tokenizer, messages, template, add_generation_prompt=False)
    spans = [
        _assistant_span(tokenizer, messages, i, full, template, chat_format)
        for i, message in enumerate(messages)
        if message["role"] == "assistant" and message["content"].strip()
    ]
    ids, offsets = _tokenize_with_offsets(tokenizer, full)
    mask = _mask_from_spans(offsets, spans)
    ids, mask = ids[:max_length], mask[:max_length]
    return {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.long)}


def _validated(messages: Sequence[Mapping[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    out = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"message {i}: role {role!r} is not one of {ROLES}")
        if not isinstance(content, str):
            raise ValueError(f"message {i} ({role}): content must be a str, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    if system_prompt is not None and not (out and out[0]["role"] == "system"):
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def _render(tokenizer: Any, messages: list[dict[str, str]], template: str, add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as err:  # jinja errors, raise_exception() in templates: all mean "cannot map"
        roles = [m["role"] for m in messages]
        raise TemplateMappingError(f"chat template failed to render roles {roles}: {err}") from err


def _assistant_span(
    tokenizer: Any, messages: list[dict[str, str]], i: int, full: str, template: str, chat_format: ChatFormat
) -> tuple[int, int]:
    """Character span [start, end) of assistant message i's reply through its end-of-turn token in `full`."""
    if i == 0:  # templates cannot render the empty prompt before it (HF refuses empty conversations)
        raise TemplateMappingError("message 0 is a leading assistant turn with no prompt to answer: drop it")
    before = _render(tokenizer, messages[:i], template, add_generation_prompt=True)
    through = _render(tokenizer, messages[: i + 1], template, add_generation_prompt=False)
    if not (full.startswith(before) and full.startswith(through) and len(through) >= len(before)):
        raise TemplateMappingError(
            f"chat format '{chat_format.name}': rendering messages[:{i}] (+ generation prompt) and messages[:{i + 1}] "
            f"are not prefixes of the full conversation, so assistant turn {i} cannot be located"
        )
    turn = full[len(before) : len(through)]
    eot = turn.rfind(chat_format.end_of_turn)
    if eot < 0:
        raise TemplateMappingError(
            f"chat format '{chat_format.name}': assistant turn {i} renders as {turn!r}, "
            f"which does not contain the end-of-turn token {chat_format.end_of_turn!r}"
        )
    return len(before), len(before) + eot + len(chat_format.end_of_turn)


def _tokenize_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as err:
        raise TemplateMappingError(
            f"{type(tokenizer).__name__} cannot return character offsets; use a fast (tokenizers-backed) tokenizer"
        ) from err
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def _mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    # A token is supervised when it carries any character of a span: byte-level BPE can split one character over two
    # tokens (overlapping offsets), and both belong to the reply.
    mask, k = [], 0
    for start, end in offsets:
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        mask.append(int(k < len(spans) and end > start and start < spans[k][1] and end > spans[k][0]))
    return mask
