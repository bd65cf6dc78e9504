"""Conversations -> (input_ids, loss_mask) through the target's own chat template.

Approach (why not string offsets or per-role prefix/suffix data): the template is the source of truth for what the
target sees at inference, including the parts that per-role data cannot express (Qwen's default system prompt,
Llama-3.1's "Cutting Knowledge Date" header, `| trim` on contents, BOS placement, Qwen3 and gpt-oss dropping the
reasoning of earlier turns). So the conversation is rendered once with `tokenizer.apply_chat_template` (with the
recipe's template kwargs, e.g. ``enable_thinking``), and each assistant message's supervised span is located in that
rendering:

* It starts where the target starts generating: right after the generation prompt the template gives the
  conversation so far, `render(messages[:i], add_generation_prompt=True)`. So the `<|im_start|>assistant\n` header,
  and the empty `<think>\n\n</think>\n\n` that Qwen3 puts into the prompt when thinking is off, are not
  supervised, while the `<think>...</think>` a thinking target writes, harmony's channel headers after
  `<|start|>assistant` and a tool call's markup are.
* It ends with the first of the format's end-of-turn tokens after the message's text (`<|return|>`, `<|end|>` or
  `<|call|>` for harmony); what the template appends after it (ChatML's newline) is not supervised.

Prefix-stable templates (most) are mapped by diffing renderings of message prefixes: `render(messages[:i], +gen
prompt)` and `render(messages[:i + 1])` are both text prefixes of the full rendering and delimit turn i. Templates
that render a turn differently once more turns follow (Qwen3 drops the <think> block of turns before the last user
query; harmony closes the last final message with `<|return|>`, earlier ones with `<|end|>`, and drops a tool call's
analysis once a final answer follows) are mapped by *where each message's own text lands*: rendering the
conversation again with one message's texts replaced by sentinels changes exactly the characters that depend on
them, so the common prefix and suffix with the real rendering bound that message's region. The generation prompt
(or, when the template shortens it in history, its rendered head) is then found between the previous message's
region and this one. Texts that render out of order, a generation prompt that cannot be found, or a turn with no
end-of-turn token raise `TemplateMappingError` instead of yielding a silently wrong mask.

The full text is tokenised once with character offsets, so the ids equal `apply_chat_template(messages,
tokenize=True)` and BPE merges across turn boundaries cannot shift the mask.

Messages (`build_chat_example`, `render_prompt`: `eagle3_zoo.chat.conversation.Message`s or their dict form):
``{"role": "system"|"user"|"assistant"|"tool", "content": str}``; an assistant message may add ``"reasoning": str``
(the thinking the target generated before its answer; ``reasoning_content`` and ``thinking`` are accepted as
aliases) and ``"tool_calls": [{"id": str, "function": {"name": str, "arguments":
dict | str}}]`` (``{"name", "arguments"}`` without ``function`` is accepted; a JSON-object string of arguments is
decoded); a tool message may add ``"tool_call_id"`` and ``"name"``. Reasoning reaches the template under the field
the format declares (``reasoning_content`` for Qwen3, ``thinking`` for harmony) and is dropped for formats that
declare none, and when the template kwargs turn thinking off (the target would not have written it). Tool calls
reach the template as transformers documents them (arguments as an object); a template that renders none of an
assistant message's calls (DeepSeek-V3's needs ``content=None``, which transformers drops; Mistral Small 3 2501
has no tool calls) raises `TemplateMappingError`: the target's call cannot be supervised. A conversation's tool
definitions (OpenAI function schemas, ``tools=``) reach the template as ``apply_chat_template(..., tools=...)``, as
they do at inference; templates place them in the system prompt (Qwen; Llama-3.1 in the first user turn) or before
the last user turn (Mistral Small 3.2: earlier turns then shift, and are mapped by region like the rewriting
templates above; with no generation prompt, a reply starts right after what the prompt renders after the message
before it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any, Literal

import yaml

from eagle3_zoo.chat.conversation import Message, parse_messages, validate_tools
from eagle3_zoo.chat.tiny_tokenizer import TinyTokenizerSpec
from eagle3_zoo.util import schema

if TYPE_CHECKING:
    import torch

FEATURES = ("thinking", "tools")
_SENTINELS = ("\ue000", "\ue001")  # private-use characters: differ from each other at both ends of every text


class TemplateMappingError(ValueError):
    """The chat template cannot be mapped to assistant loss masks (or rendering it failed)."""


@dataclass(frozen=True)
class ReasoningFormat:
    """How a format carries the target's reasoning.

    Attributes:
        field: The message key the template reads it from (``reasoning_content``, ``thinking``).
        start: The marker the target writes before it (``<think>``).
        end: The marker the target writes after it (``</think>``).
        answer_start: The marker before the answer, when one follows `end` (harmony's final channel header).
    """

    field: str
    start: str
    end: str
    answer_start: str = ""

    def split(self, reply: str) -> tuple[str, str]:
        """``(reasoning, answer)`` of a generated reply (special tokens kept), both stripped.

        A reply cut off while thinking is all reasoning; one without markers is all answer; a reply whose prompt
        opened the reasoning block (no `start`) is reasoning up to `end`.
        """
        reasoning, answer = "", reply
        if self.start in reply or self.end in reply:
            head, sep, tail = reply.partition(self.end)
            reasoning, answer = head.split(self.start, 1)[-1], tail if sep else ""
        if self.answer_start and self.answer_start in answer:
            answer = answer.split(self.answer_start, 1)[1]
        return reasoning.strip(), answer.strip()


@dataclass(frozen=True)
class ChatFormat:
    """A family's chat format, declared as data.

    Attributes:
        name: Short name used in errors and logs (e.g. ``"chatml"``).
        template: The family's real Jinja chat template; used when the tokenizer carries none.
        end_of_turn: The special token that closes the last assistant turn (and stops generation).
        source: Where the template text came from (model repo and file).
        tokenizer: The special tokens of the family's tokenizer, for tiny test tokenizers; ``None`` if not declared.
        turn_ends: Every token that closes an assistant message in a rendering (default: `end_of_turn` alone).
        signature: A string the template text contains, to recognise it on a tokenizer (default: `end_of_turn`;
            templates that write the token through ``eos_token`` declare another).
        features: What the template renders beyond plain turns: ``thinking`` (reasoning), ``tools`` (tool calls and
            results).
        reasoning: How the target's reasoning is carried (``None``: the format has none).
        thinking_off: Template kwargs that turn thinking off (e.g. ``{"enable_thinking": False}``); empty if it cannot.
        expected: What the target generates for one assistant message, written by hand from the template
            (`ExpectedTexts`, str.format templates): the family-wide mask tests check the supervised tokens against
            it, so a new format is tested from its own resource file.
    """

    name: str
    template: str
    end_of_turn: str
    source: str = ""
    tokenizer: TinyTokenizerSpec | None = None
    turn_ends: tuple[str, ...] = ()
    signature: str = ""
    features: tuple[str, ...] = ()
    reasoning: ReasoningFormat | None = None
    thinking_off: Mapping[str, Any] = field(default_factory=dict)
    expected: Mapping[str, str] = field(default_factory=dict)

    @property
    def ends(self) -> tuple[str, ...]:
        """The tokens that may close an assistant message."""
        return self.turn_ends or (self.end_of_turn,)


CHAT_FORMATS_PACKAGE = "eagle3_zoo.resources"


@dataclass(frozen=True)
class ExpectedTexts:
    """`ChatFormat.expected`: what the target generates for one assistant message, as str.format templates with the
    fields ``{reply}``, ``{reasoning}`` and, for a tool call, ``{name}``, ``{arguments}`` (JSON), ``{call_id}``."""

    turn: str | None = None  # an earlier turn, or any turn without thinking
    last_turn: str | None = None  # the last turn (default: turn)
    last_turn_thinking: str | None = None  # the last turn with thinking on and reasoning (default: last_turn)
    last_turn_thinking_empty: str | None = None  # the last turn with thinking on, no reasoning (default: last_turn)
    tool_call: str | None = None  # a turn that calls a tool


EXPECTED_KEYS = tuple(f.name for f in dataclasses.fields(ExpectedTexts))


@dataclass(frozen=True)
class ChatFormatFile:
    """The layout of a chat format's ``<name>.yaml``: `ChatFormat`'s fields but the template (read by
    `load_chat_format`)."""

    name: str
    end_of_turn: str
    source: str = ""
    tokenizer: TinyTokenizerSpec | None = None
    turn_ends: tuple[str, ...] = schema.ruled((), schema.rule(all, "tokens must not be empty strings"))
    signature: str = ""
    features: tuple[Literal[FEATURES], ...] = ()
    reasoning: ReasoningFormat | None = None
    thinking_off: dict = field(default_factory=dict)
    expected: ExpectedTexts = field(default_factory=ExpectedTexts)


class ChatFormatError(schema.ConfigError):
    """All problems of a chat format file, reported at once."""
    what = "chat format"


@functools.cache
def load_chat_format(name: str) -> ChatFormat:
    """The chat format shipped as ``resources/chat_formats/<name>.jinja`` (template) + ``<name>.yaml`` (metadata).

    The YAML declares ``name`` (= ``<name>``), ``end_of_turn``, ``source`` and optionally ``tokenizer``
    (``special_tokens``, ``eos_token``, ``bos_token``, ``pad_token``), ``turn_ends`` (list), ``signature``,
    ``features`` (subset of thinking, tools), ``reasoning`` (``field``, ``start``, ``end``, optional
    ``answer_start``; present exactly with the thinking feature), ``thinking_off`` (template kwargs) and
    ``expected`` (`ExpectedTexts`); see `ChatFormatFile` and `ChatFormat`.

    Raises:
        ValueError: if the files are missing (naming the shipped formats).
        ChatFormatError: every problem of the metadata at once (each naming the file, the key and what is valid).
    """
    folder = resources.files(CHAT_FORMATS_PACKAGE).joinpath("chat_formats")
    meta_file, template_file = folder.joinpath(f"{name}.yaml"), folder.joinpath(f"{name}.jinja")
    if not (meta_file.is_file() and template_file.is_file()):
        known = sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))
        raise ValueError(
            f"no chat format '{name}' in {folder} ({name}.yaml + {name}.jinja); shipped: {', '.join(known)}"
        )
    problems: list[schema.ConfigProblem] = []
    meta = schema.check_types(yaml.safe_load(meta_file.read_text(encoding="utf-8")), ChatFormatFile, "", problems)
    if meta is not schema.BAD:  # a required key with a type problem is left out of `meta`: a stand-in fills it
        file = ChatFormatFile(**{"name": name, "end_of_turn": "", **meta})
        thinking, reasoned = "thinking" in file.features, file.reasoning is not None
        checks = schema.value_problems(file)
        if file.name != name:
            checks.append(schema.ConfigProblem("name", f"must be the file's name, {name}", file.name))
        if thinking and not reasoned:
            checks.append(schema.ConfigProblem(
                "reasoning", "required with the 'thinking' feature (field, start, end)", related=("features",)))
        if reasoned and not thinking:
            checks.append(schema.ConfigProblem(
                "features", "needs 'thinking': the file declares a reasoning mapping", related=("reasoning",)))
        problems += schema.unechoed(checks, problems)
    for p in problems:
        p.source = str(meta_file)
    if problems:
        raise ChatFormatError(problems)
    tokenizer, reasoning, expected = meta.get("tokenizer"), meta.get("reasoning"), meta.get("expected", {})
    return ChatFormat(**{**meta, "template": template_file.read_text(encoding="utf-8"),
                         "tokenizer": tokenizer and TinyTokenizerSpec(**tokenizer),
                         "reasoning": reasoning and ReasoningFormat(**reasoning),
                         "expected": {k: v for k, v in expected.items() if v is not None}})


def load_chat_formats(*names: str) -> tuple[ChatFormat, ...]:
    """`load_chat_format` for each name, in order."""
    return tuple(load_chat_format(name) for name in names)


def resolve_chat_format(tokenizer: Any, formats: Sequence[ChatFormat]) -> ChatFormat:
    """Pick the declared format that matches `tokenizer` (one family may ship several, e.g. Llama-3 and SmolLM2).

    With a template on the tokenizer, the format whose signature (by default its end-of-turn token) the template
    contains wins; otherwise the first format whose end-of-turn token is in the vocabulary. A tokenizer template that
    matches no declared format falls back to the tokenizer's own EOS token if the template emits it.

    Raises:
        TemplateMappingError: if nothing matches.
    """
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        for fmt in formats:
            if (fmt.signature or fmt.end_of_turn) in template:
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


def chat_template(tokenizer: Any, chat_format: ChatFormat | None = None) -> str:
    """The template a target's conversations are rendered with: the tokenizer's own, else its family format's (as
    the data stage renders them, so evaluation prompts are the training prompts).

    Raises:
        ValueError: neither has one.
    """
    template = getattr(tokenizer, "chat_template", None) or (chat_format.template if chat_format else None)
    if not template:
        raise ValueError(f"{type(tokenizer).__name__} has no chat_template and no chat format supplies one; chat "
                         "prompts (mtbench, humaneval, JSONL turns/messages) need one, use a JSONL of raw 'prompt' "
                         "records for base models")
    return template


def render_prompt(
    tokenizer: Any, messages: Sequence[Message | Mapping[str, Any]], chat_format: ChatFormat | None = None,
    template_kwargs: Mapping[str, Any] | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The generation prompt for `messages` and `tools` as the target sees it: the one prompt renderer of the package
    (regeneration, evaluation benchmarks and training-time tau call it; the data stage renders the turns of its
    examples with the same template, kwargs and message validation).

    Args:
        tokenizer: The target's tokenizer.
        messages: `Message`s or their dict form (validated as in `build_chat_example`).
        chat_format: The family's format (its template when the tokenizer has none, its reasoning field); ``None``:
            the tokenizer's template, without reasoning.
        template_kwargs: Template variables (recipe ``data.chat_template_kwargs``, e.g. ``enable_thinking``).
        tools: Tool definitions, passed to the template as ``tools``.

    Raises:
        ValueError: malformed messages or tools, no template.
        TemplateMappingError: the template failed to render.
    """
    renderer = _Renderer(tokenizer, chat_template(tokenizer, chat_format), template_kwargs, validate_tools(tools))
    return renderer.render(_validated(messages, None, chat_format, template_kwargs), add_generation_prompt=True)


def prompt_ids(
    tokenizer: Any, messages: Sequence[Message | Mapping[str, Any]], chat_format: ChatFormat | None = None,
    template_kwargs: Mapping[str, Any] | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """`render_prompt` tokenised as `build_chat_example` tokenises a conversation (the rendering holds BOS and the
    other special tokens, so none are added): the ids of a prompt equal those of its training example up to the
    first supervised token."""
    return list(tokenizer(render_prompt(tokenizer, messages, chat_format, template_kwargs, tools),
                          add_special_tokens=False)["input_ids"])


def build_chat_example(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    max_length: int,
    chat_format: ChatFormat,
    system_prompt: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, torch.Tensor]:
    """Render `messages` with the chat template and mark the tokens the target generated.

    Args:
        tokenizer: A fast (offset-capable) Hugging Face tokenizer.
        messages: See the module docstring (roles system/user/assistant/tool; reasoning, tool calls).
        max_length: Keep at most this many tokens (right truncation; the mask is truncated alike).
        chat_format: The family's format (see `resolve_chat_format`); its template is used when the tokenizer has none.
        system_prompt: Inserted as a leading system message when `messages` has none; ``None`` keeps the
            template's own default (e.g. Qwen-2.5's "You are Qwen, ...").
        template_kwargs: Extra template variables (recipe ``data.chat_template_kwargs``, e.g. ``enable_thinking``).
        tools: The conversation's tool definitions (OpenAI function schemas), passed to the template as ``tools``;
            ``None`` or empty: none (templates render no tool section then).

    Returns:
        ``{"input_ids": LongTensor[T], "loss_mask": LongTensor[T]}`` with ``loss_mask`` 1 exactly on what the
        target generated for each assistant message, as rendered: from the end of its generation prompt through its
        end-of-turn token (reasoning the template keeps, tool calls and channel headers included; tool results and
        prompts never). Assistant messages with nothing but whitespace are rendered but not supervised: they teach
        nothing but "stop at once".

    Raises:
        ValueError: malformed messages or tools, or `max_length` < 1.
        TemplateMappingError: the template cannot be mapped (texts rendered out of order, no generation prompt or
            end-of-turn token around a reply, rendering error, tokenizer without offsets).
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    messages = _validated(messages, system_prompt, chat_format, template_kwargs)
    renderer = _Renderer(tokenizer, chat_template(tokenizer, chat_format), template_kwargs, validate_tools(tools))
    mapper = _TurnMapper(renderer, messages, chat_format)
    spans = [mapper.span(i) for i, m in enumerate(messages) if m["role"] == "assistant" and _has_output(m)]
    ids, offsets = _tokenize_with_offsets(tokenizer, mapper.full)
    mask = _mask_from_spans(offsets, [s for s in spans if s is not None])
    ids, mask = ids[:max_length], mask[:max_length]
    import torch  # here: the adapter registry imports this module, and recipe validation must not wait for torch

    return {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.long)}


def thinking_enabled(chat_format: ChatFormat | None, template_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether the target thinks under `template_kwargs`: the format has reasoning and the kwargs do not turn it off."""
    if chat_format is None:
        return False
    off = chat_format.thinking_off
    kwargs = template_kwargs or {}
    return chat_format.reasoning is not None and not (off and all(kwargs.get(k) == v for k, v in off.items()))


def _validated(
    messages: Sequence[Message | Mapping[str, Any]], system_prompt: str | None, chat_format: ChatFormat | None,
    template_kwargs: Mapping[str, Any] | None,
) -> list[dict[str, Any]]:
    """The messages as the template reads them (`Message.parse`, then reasoning under the format's field when the
    target thinks, tool calls in the layout transformers documents)."""
    thinking = thinking_enabled(chat_format, template_kwargs)
    out = []
    for i, message in enumerate(parse_messages(messages)):
        rendered: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.reasoning is not None and message.reasoning.strip() and thinking:
            rendered[chat_format.reasoning.field] = message.reasoning
        if message.tool_calls:
            rendered["tool_calls"] = [_tool_call(i, j, c) for j, c in enumerate(message.tool_calls)]
        for key in ("tool_call_id", "name"):
            if getattr(message, key) is not None:
                rendered[key] = getattr(message, key)
        out.append(rendered)
    if system_prompt is not None and not (out and out[0]["role"] == "system"):
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def _tool_call(i: int, j: int, call: Any) -> dict[str, Any]:
    function = call.get("function", call) if isinstance(call, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"message {i}: tool_calls[{j}] needs a function name "
                         "({'function': {'name': str, 'arguments': dict | str}})")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            decoded = None
        arguments = decoded if isinstance(decoded, dict) else arguments
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _has_output(message: Mapping[str, Any]) -> bool:
    return any(text.strip() for text in _texts(message)) or bool(message.get("tool_calls"))


def _texts(message: Mapping[str, Any]) -> list[str]:
    """The strings of a (validated) message that the target or the user wrote: content, reasoning, tool calls."""
    texts = [v for k, v in message.items() if k not in ("role", "tool_calls", "tool_call_id", "name")]
    texts += [json.dumps(call["function"]["arguments"]) for call in message.get("tool_calls", ())]
    return [t for t in texts if isinstance(t, str)]


def _with_sentinels(message: dict[str, Any], mark: str) -> dict[str, Any]:
    """`message` with every non-empty text replaced by `mark`; the keys (which templates branch on) are kept, and so
    are tool names and call ids, which templates echo in the tool results that follow (harmony, Mistral)."""
    out = {k: (mark if k not in ("role", "tool_call_id", "name") and isinstance(v, str) and v else v)
           for k, v in message.items()}
    if "tool_calls" in message:
        out["tool_calls"] = _marked_calls(message["tool_calls"], mark)
    return out


def _marked_calls(calls: list[dict[str, Any]], mark: str) -> list[dict[str, Any]]:
    return [{**c, "function": {**c["function"], "arguments": {mark: mark}}} for c in calls]


class _Renderer:
    """`apply_chat_template` to text with fixed template, kwargs and tools; errors become `TemplateMappingError`."""

    def __init__(self, tokenizer: Any, template: str, kwargs: Mapping[str, Any] | None,
                 tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer, self.template, self.kwargs = tokenizer, template, dict(kwargs or {})
        if tools:
            self.kwargs["tools"] = tools

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, tokenize=False, add_generation_prompt=add_generation_prompt,
                **self.kwargs,
            )
        except Exception as err:  # jinja errors, raise_exception() in templates: all mean "cannot map"
            roles = [m["role"] for m in messages]
            raise TemplateMappingError(f"chat template failed to render roles {roles}: {err}") from err


class _TurnMapper:
    """Locates assistant turns in one rendering of a conversation (see the module docstring)."""

    def __init__(self, renderer: _Renderer, messages: list[dict[str, Any]], chat_format: ChatFormat) -> None:
        self.renderer, self.messages, self.fmt = renderer, messages, chat_format
        self.full = renderer.render(messages, add_generation_prompt=False)
        self._regions: dict[int, tuple[int, int] | None] = {}

    def span(self, i: int) -> tuple[int, int] | None:
        """Character span [start, end) of what the target generated for assistant message i; None if not rendered."""
        if i == 0:  # templates cannot render the empty prompt before it (HF refuses empty conversations)
            raise TemplateMappingError("message 0 is a leading assistant turn with no prompt to answer: drop it")
        if calls := self.messages[i].get("tool_calls"):
            marked = {**self.messages[i], "tool_calls": _marked_calls(calls, _SENTINELS[0])}
            if self.renderer.render([*self.messages[:i], marked, *self.messages[i + 1 :]], False) == self.full:
                raise TemplateMappingError(
                    f"chat format '{self.fmt.name}' renders none of the tool calls of assistant turn {i} (the template "
                    "has no tool calls, or reads them from a layout transformers does not pass), so the call the "
                    "target generated cannot be supervised"
                )
        prompt = self.renderer.render(self.messages[:i], add_generation_prompt=True)
        through = self.renderer.render(self.messages[: i + 1], add_generation_prompt=False)
        if self.full.startswith(prompt) and self.full.startswith(through) and len(through) > len(prompt):
            turn = self.full[len(prompt) : len(through)]  # prefix-stable: the turn is the difference
            ends = [turn.rfind(token) + len(token) for token in self.fmt.ends if token in turn]
            if not ends:
                raise TemplateMappingError(
                    f"chat format '{self.fmt.name}': assistant turn {i} renders as {turn!r}, "
                    f"which does not contain the end-of-turn token {' / '.join(self.fmt.ends)!r}"
                )
            return len(prompt), len(prompt) + max(ends)
        return self._span_by_region(i, prompt)

    def _span_by_region(self, i: int, prompt: str) -> tuple[int, int] | None:
        region = self.region(i)
        if region is None:
            return None  # the template renders none of this message's texts here
        prev = next((k for k in range(i - 1, -1, -1) if self.region(k) is not None), None)
        before = (0, 0) if prev is None else self.region(prev)
        after = next((r for r in map(self.region, range(i + 1, len(self.messages))) if r is not None),
                     (len(self.full), len(self.full)))
        if not before[1] <= region[0] <= region[1] <= after[0]:
            raise TemplateMappingError(
                f"chat format '{self.fmt.name}': the texts of messages {i - 1}..{i + 1} render out of order or "
                f"overlap, so assistant turn {i} cannot be located"
            )
        start = self._generation_start(i, prompt, before[1], region[0], prev)
        tail = self.full[region[1] : after[0]]
        ends = [(tail.find(token), token) for token in self.fmt.ends if token in tail]
        if not ends:
            raise TemplateMappingError(
                f"chat format '{self.fmt.name}': assistant turn {i} renders as {self.full[start : after[0]]!r}, "
                f"which does not contain the end-of-turn token {' / '.join(self.fmt.ends)!r}"
            )
        at, token = min(ends)
        return start, region[1] + at + len(token)

    def _generation_start(self, i: int, prompt: str, lo: int, hi: int, prev: int | None) -> int:
        """Where the target starts writing turn i, between the text of message `prev` (ending at lo) and its own
        (hi)."""
        if self.full.startswith(prompt) and lo <= len(prompt) <= hi:
            return len(prompt)
        history = self.renderer.render(self.messages[:i], add_generation_prompt=False)
        header = prompt[len(history) :] if prompt.startswith(history) else ""
        gap = self.full[lo:hi]
        if not header and prompt == history and prev is not None:
            # no generation prompt (Mistral): the target starts right after what the prompt renders after `prev`'s
            # text (its closing "[/INST]", "[/TOOL_RESULTS]"), which must open the gap alike
            closing = history[len(history) - self._tail_after(prev, i, history) :]
            if gap.startswith(closing):
                return lo + len(closing)
        # the whole generation prompt, else its longest head (whole tokens) that the template renders in history:
        # Qwen3 without thinking puts an empty <think> block into the prompt of the last turn only
        cuts = sorted({end for _, end in _tokenize_with_offsets(self.renderer.tokenizer, header)[1]}, reverse=True)
        for cut in [len(header), *cuts] if header else []:
            if cut and header[:cut] in gap:
                return lo + gap.rindex(header[:cut]) + cut
        raise TemplateMappingError(
            f"chat format '{self.fmt.name}': the generation prompt {header!r} of assistant turn {i} is not rendered "
            f"before it (between {gap!r}), so where the target starts writing cannot be located"
        )

    def _tail_after(self, k: int, i: int, history: str) -> int:
        """Length of what `history` (the rendering of messages[:i]) renders after message k's texts."""
        tails = []
        for mark in _SENTINELS:
            changed = [*self.messages[:k], _with_sentinels(self.messages[k], mark), *self.messages[k + 1 : i]]
            other = self.renderer.render(changed, add_generation_prompt=False)
            tails.append(_common_prefix(history[::-1], other[::-1]))
        return min(tails)

    def region(self, k: int) -> tuple[int, int] | None:
        """[start, end) of the characters of the full rendering that depend on message k's texts; None if none do."""
        if k not in self._regions:
            self._regions[k] = self._region(k)
        return self._regions[k]

    def _region(self, k: int) -> tuple[int, int] | None:
        if not any(_texts(self.messages[k])):
            return None
        starts, ends = [], []
        for mark in _SENTINELS:
            changed = [*self.messages[:k], _with_sentinels(self.messages[k], mark), *self.messages[k + 1 :]]
            other = self.renderer.render(changed, add_generation_prompt=False)
            if other == self.full:
                continue
            prefix = _common_prefix(self.full, other)
            suffix = _common_prefix(self.full[prefix:][::-1], other[prefix:][::-1])
            starts.append(prefix)
            ends.append(len(self.full) - suffix)
        return (min(starts), max(ends)) if starts else None


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix of `a` and `b` (binary search over slice comparisons: C speed)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


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
