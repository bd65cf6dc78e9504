"""The conversation type every stage shares: `Message` (a role, its text, an assistant's reasoning and tool calls, a
tool result's call id and name), with the one table of role spellings and reasoning keys.

Data files are read into messages (`Message.from_record`: ShareGPT ``from``/``value`` or OpenAI ``role``/``content``
turns, role aliases, any reasoning key), conversations handed to the chat template are validated as messages
(`Message.parse`: the canonical layout below), and benchmark prompts and training-time tau prompts are built as
messages; `eagle3_zoo.chat.formats.render_prompt` renders them all with the same template and template kwargs.
On disk and in caches a message is its `as_dict` form, a plain JSON object::

    {"role": "system" | "user" | "assistant" | "tool", "content": str,
     "reasoning": str,                    # assistant, optional: what the target thought before its answer
     "tool_calls": [{"id": str, "function": {"name": str, "arguments": dict | str}}],   # assistant, optional
     "tool_call_id": str, "name": str}    # tool, optional

`parse` also accepts ``reasoning_content`` and ``thinking`` for ``reasoning`` (one of them per message). The module
itself needs only the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
# how records spell the roles (lower-cased, stripped): ShareGPT's human/gpt and the chat products' names
ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool", "ipython": "tool",  # Llama-3.1 records name tool results "ipython"
}
# where records and APIs keep an assistant's reasoning (vLLM/DeepSeek, OpenRouter, harmony); the first one set wins
# when a record has several
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
TURN_KEYS = (("from", "value"), ("role", "content"))  # either spelling is accepted in any record layout
TOOL_RESULT_KEYS = ("tool_call_id", "name")
MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", *TOOL_RESULT_KEYS, *REASONING_KEYS})


class MessageError(ValueError):
    """A turn that is no message; `reason` is the short name data readers count skipped records by."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def role_of(raw: Any) -> str | None:
    """The role a record's spelling names (`ROLE_ALIASES`, case and surrounding spaces ignored); None if unknown."""
    return ROLE_ALIASES.get(raw.strip().lower()) if isinstance(raw, str) else None


@dataclass(frozen=True)
class Message:
    """One turn of a conversation (see the module docstring for the layout and what each field is)."""

    role: str
    content: str
    reasoning: str | None = None
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise MessageError("unknown_role", f"role {self.role!r} is not one of {ROLES}")
        if not isinstance(self.content, str):
            raise MessageError("non_string_content", f"content must be a str, got {type(self.content).__name__}")
        if self.reasoning is not None and (self.role != "assistant" or not isinstance(self.reasoning, str)):
            raise MessageError("non_string_content", "reasoning is one str on an assistant message (one of the "
                               f"keys {', '.join(REASONING_KEYS)})")
        if self.tool_calls and self.role != "assistant":
            raise MessageError("bad_tool_calls", "only assistant messages carry tool_calls")
        for key in TOOL_RESULT_KEYS:
            if getattr(self, key) is not None and (self.role != "tool" or not isinstance(getattr(self, key), str)):
                raise MessageError("bad_tool_result", f"'{key}' is a str on tool messages only")

    @classmethod
    def parse(cls, raw: Message | Mapping[str, Any], index: int) -> Message:
        """Message `index` of a conversation in the canonical layout (a `Message` is returned as it is).

        Raises:
            MessageError: the message named by index and role, and what is valid: an unknown role or key, content
                that is not a str (null is accepted for a pure tool call), reasoning under several keys or on
                another role, tool fields on the wrong role.
        """
        if isinstance(raw, Message):
            return raw
        role = raw.get("role")
        if role not in ROLES:
            raise MessageError("unknown_role", f"message {index}: role {role!r} is not one of {ROLES}")
        if unknown := set(raw) - MESSAGE_KEYS:
            raise MessageError("unknown_key", f"message {index} ({role}): unknown keys {sorted(unknown)}; valid: "
                               f"{sorted(MESSAGE_KEYS)}")
        content = raw.get("content")
        if content is None and role == "assistant" and raw.get("tool_calls"):
            content = ""  # OpenAI records: a pure tool call has content null
        reasoning = [raw[k] for k in REASONING_KEYS if raw.get(k) is not None]
        if len(reasoning) > 1:
            raise MessageError("non_string_content", f"message {index} ({role}): reasoning is one str on an "
                               f"assistant message (one of the keys {', '.join(REASONING_KEYS)})")
        try:
            return cls(role, content, reasoning[0] if reasoning else None, tuple(raw.get("tool_calls") or ()),
                       raw.get("tool_call_id"), raw.get("name"))
        except MessageError as e:
            raise MessageError(e.reason, f"message {index} ({role}): {e}") from None

    @classmethod
    def from_record(cls, turn: Any, index: int) -> Message:
        """Turn `index` of a data record, read leniently: ``from``/``value`` or ``role``/``content``, any role alias,
        reasoning under any of `REASONING_KEYS` (empty = none), tool fields kept where they belong (elsewhere and
        unknown keys ignored: records carry their own metadata).

        Raises:
            MessageError: with the reason a reader counts (``missing_key``, ``unknown_role``,
                ``non_string_content``, ``bad_tool_calls``).
        """
        pair = next((p for p in TURN_KEYS if isinstance(turn, dict) and p[0] in turn and p[1] in turn), None)
        if pair is None:
            raise MessageError("missing_key", f"turn {index} lacks 'from'/'value' or 'role'/'content'")
        raw_role, content = turn[pair[0]], turn[pair[1]]
        role = role_of(raw_role)
        if role is None:
            raise MessageError("unknown_role", f"turn {index}: unknown role {raw_role!r}; known: "
                               f"{sorted(ROLE_ALIASES)}")
        reasoning, calls, results = None, (), {}
        if role == "assistant":
            reasoning = next((turn[k] for k in REASONING_KEYS if turn.get(k) is not None), None)
            if reasoning is not None and not isinstance(reasoning, str):
                raise MessageError("non_string_content", f"turn {index}: reasoning is {type(reasoning).__name__}, "
                                   "not a string")
            calls = turn.get("tool_calls") or ()
            if calls and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
                raise MessageError("bad_tool_calls", f"turn {index}: tool_calls must be a list of objects")
        elif role == "tool":
            results = {k: turn[k] for k in TOOL_RESULT_KEYS if isinstance(turn.get(k), str)}
        if content is None and calls:
            content = ""  # a pure tool call
        if not isinstance(content, str):
            raise MessageError("non_string_content", f"turn {index}: content is {type(content).__name__}, not a "
                               "string")
        return cls(role, content, reasoning or None, tuple(calls), **results)

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (module docstring): unset fields left out."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning is not None:
            out["reasoning"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = list(self.tool_calls)
        out.update({k: getattr(self, k) for k in TOOL_RESULT_KEYS if getattr(self, k) is not None})
        return out


def parse_messages(messages: Sequence[Message | Mapping[str, Any]]) -> list[Message]:
    """`Message.parse` of each message, by index."""
    return [Message.parse(m, i) for i, m in enumerate(messages)]


def validate_tools(tools: Any) -> list[dict[str, Any]] | None:
    """`tools` as templates read them: a list of OpenAI function schemas (``{"type": "function", "function":
    {"name", "description", "parameters"}}``, or the bare ``{"name", ...}``), kept as given; ``None`` when empty.

    Raises:
        ValueError: not a list of objects that each name a function.
    """
    if tools is None or (isinstance(tools, Sequence) and not isinstance(tools, str) and not tools):
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise ValueError(f"tools must be a list of function schemas, got {type(tools).__name__}")
    for j, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not (isinstance(function, Mapping) and isinstance(function.get("name"), str) and function["name"]):
            raise ValueError(f"tools[{j}] needs a function name ({{'type': 'function', 'function': {{'name': str, "
                             f"'description': str, 'parameters': dict}}}}), got {tool!r:.80}")
    return [dict(tool) for tool in tools]
