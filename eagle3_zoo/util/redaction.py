"""The secrets a run was given, and their removal from everything it writes, prints or logs: the one redaction layer
every artefact writer goes through (recipe.yaml, provenance.json, checkpoints, logs/*/hparams.yaml, the run-lock
holder file, model cards, error lines and log records).

    register_recipe(plain_recipe)        # load_recipe does it: the key variables, --api-key values, URL credentials
    redact("curl -H 'Bearer sk-...'")    # -> "curl -H 'Bearer ***'"
    redact_data({"engine": {"extra_args": ["--api-key", "sk-..."]}})  # -> {... ["--api-key", "***"]}

Known secrets: values registered by the process (`register`), the current values of registered variables (the recipe's
`engine.api_key_env` and `data.regenerate.api_key_env`, and `WANDB_API_KEY`, read when a text is redacted: a key set
later is known too), the Hub token (`HF_TOKEN`, `HUGGING_FACE_HUB_TOKEN`, the token files of `hf auth login`), and
whatever is written as a secret whatever its value: the ``user:password@`` of a URL and the value after ``--api-key``,
``--hf-token`` or ``--token`` (``--api-key X``, ``--api-key=X``). Values shorter than `MIN_LENGTH` are not replaced in
free text (they would match everywhere); in structured data the value after a key flag is replaced whatever its length.
The registry is process-wide: whatever a command loaded, everything it writes afterwards is redacted.
Imports nothing heavy (no torch; YAML only to rewrite a document)."""

from __future__ import annotations

import configparser
import functools
import logging
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

REDACTED = "***"
MIN_LENGTH = 4  # a "secret" of 1-3 characters would turn every number in a log line into ***
SECRET_FLAGS = ("--api-key", "--hf-token", "--token")  # server arguments whose value is a key (vLLM, SGLang)
HUB_TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
# where a recipe (its plain dict form) names the variables holding keys, and lists server arguments
KEY_VARIABLE_FIELDS = (("engine", "api_key_env"), ("data", "regenerate", "api_key_env"))
ARGUMENT_FIELDS = (("engine", "extra_args"),)

_URL_CREDENTIALS = re.compile(r"(?<=://)[^/@\s'\"]+@")
_FLAGS = "|".join(map(re.escape, SECRET_FLAGS))
_FLAG_VALUE = re.compile(  # --api-key X, --api-key=X, '--api-key', 'X' (a list's repr), [--api-key,X] (an override)
    rf"(?P<flag>(?:{_FLAGS})(?![\w-]))(?P<sep>=|['\"]?\s*,\s*['\"]?|\s+)(?!\*\*\*)(?P<value>[^\s,'\"\[\]]+)")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

_values: dict[str, str] = {}  # secret value -> what it is (for messages, which never show the value)
# environment variable holding a secret -> what it is (the Weights & Biases key of `trainer.logger: [wandb]`)
_variables: dict[str, str] = {"WANDB_API_KEY": "the Weights & Biases key ($WANDB_API_KEY)"}


def register(value: Any, what: str) -> None:
    """Treat `value` (a string) as a secret from now on; `what` names it in messages (`find_secret`)."""
    if isinstance(value, str) and value.strip() and value != REDACTED:
        _values.setdefault(value, what)


def register_variable(name: Any, what: str | None = None) -> None:
    """Treat the value of the environment variable `name` as a secret (read when text is redacted)."""
    if isinstance(name, str) and _ENV_NAME.fullmatch(name):
        _variables.setdefault(name, what or f"the value of ${name}")


def register_arguments(args: Any, where: str = "the arguments") -> None:
    """Register the value after each key flag of a server argument list (`SECRET_FLAGS`)."""
    if not isinstance(args, (list, tuple)):
        return
    for i, arg in enumerate(args):
        if not isinstance(arg, str):
            continue
        flag, sep, value = arg.partition("=")
        if flag in SECRET_FLAGS and sep:
            register(value, f"the value of `{flag}` in {where}")  # backticks: no "--api-key X" for redact to hide
        elif arg in SECRET_FLAGS and i + 1 < len(args):
            register(str(args[i + 1]), f"the value of `{arg}` in {where}")


def register_url_credentials(text: Any, where: str = "a URL") -> None:
    """Register the ``user:password`` (and the password alone) of every URL in `text`."""
    if not isinstance(text, str):
        return
    for match in _URL_CREDENTIALS.finditer(text):
        userinfo = match.group()[:-1]
        register(userinfo, f"the credentials of {where}")
        register(userinfo.partition(":")[2], f"the password of {where}")


def register_recipe(recipe: Mapping[str, Any]) -> None:
    """Register the secrets a recipe (its plain dict form, resolved or as read from a recipe.yaml) gives the run:
    its key variables, the values of key flags in its server arguments, and URL credentials anywhere in it."""
    for path in KEY_VARIABLE_FIELDS:
        name = _get(recipe, path)
        register_variable(name, f"the key in ${name} ({'.'.join(path)})")
    for path in ARGUMENT_FIELDS:
        register_arguments(_get(recipe, path), ".".join(path))
    for text in _strings(recipe):
        register_url_credentials(text, "a URL in the recipe")


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree.get(key) if isinstance(tree, Mapping) else None
    return tree


def _strings(tree: Any) -> Iterable[str]:
    if isinstance(tree, str):
        yield tree
    elif isinstance(tree, Mapping):
        for value in tree.values():
            yield from _strings(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _strings(value)


@functools.lru_cache(maxsize=4)
def _cached_hub_tokens(token_path: str, stored_path: str) -> tuple[str, ...]:
    """The tokens `hf auth login` saved (read once per process: a file read, no network)."""
    tokens = []
    try:
        tokens.append(Path(token_path).read_text(encoding="utf-8").strip())
    except (OSError, UnicodeDecodeError):
        pass
    stored = configparser.ConfigParser(interpolation=None)
    try:
        stored.read(stored_path, encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError):
        pass
    tokens += [section.get("hf_token", "") for section in stored.values()]
    return tuple(t for t in tokens if t)


def _hub_token_files() -> tuple[str, str]:
    try:
        from huggingface_hub import constants  # the paths huggingface_hub itself reads (HF_HOME, HF_TOKEN_PATH)

        return str(constants.HF_TOKEN_PATH), str(constants.HF_STORED_TOKENS_PATH)
    except ImportError:
        home = Path(os.environ.get("HF_HOME") or Path("~/.cache/huggingface").expanduser())
        return os.environ.get("HF_TOKEN_PATH") or str(home / "token"), str(home / "stored_tokens")


def known_secrets() -> dict[str, str]:
    """Every secret value known now -> what it is."""
    found = dict(_values)
    for name in (*HUB_TOKEN_VARIABLES, *_variables):
        value = os.environ.get(name, "")
        if value.strip():
            found.setdefault(value, _variables.get(name) or f"the Hub token (${name})")
    for token in _cached_hub_tokens(*_hub_token_files()):
        found.setdefault(token, "the Hub token of `hf auth login`")
    return {value: what for value, what in found.items() if len(value) >= MIN_LENGTH}


def redact(text: str) -> str:
    """`text` with every known secret, URL credential and key-flag value replaced by `REDACTED`."""
    if not isinstance(text, str) or not text:
        return text
    for value in sorted(known_secrets(), key=len, reverse=True):  # a longer secret holding a shorter one goes first
        text = text.replace(value, REDACTED)
    text = _URL_CREDENTIALS.sub(REDACTED + "@", text)
    return _FLAG_VALUE.sub(lambda m: f"{m['flag']}{m['sep']}{REDACTED}", text)


def redact_data(tree: Any) -> Any:
    """A copy of nested dicts / lists / tuples with every string redacted (keys included), and the item after a
    key flag in a list replaced whatever its length."""
    if isinstance(tree, str):
        return redact(tree)
    if isinstance(tree, Mapping):
        return {redact(k) if isinstance(k, str) else k: redact_data(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        out = [redact_data(v) for v in tree]
        for i, item in enumerate(tree[:-1]):
            if isinstance(item, str) and item in SECRET_FLAGS:
                out[i + 1] = REDACTED
        return out if isinstance(tree, list) else tuple(out)
    return tree


_UNPARSED = object()


def register_document(text: str, suffix: str) -> Any:
    """Register what a recipe (`.yaml`) or JSON (`.json`) file itself names a secret: a recipe's key variables and
    key flags, URL credentials anywhere. Returns its parsed data (`_UNPARSED` when it does not parse)."""
    import json

    import yaml

    register_url_credentials(text, "a URL in the file")
    try:
        data = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError, RecursionError):
        return _UNPARSED
    if isinstance(data, Mapping) and suffix != ".json":
        register_recipe(data)
    return data


def redact_document(text: str, suffix: str) -> str:
    """The text of a recipe (`.yaml`) or JSON (`.json`) file with its secrets redacted: `text` itself when it holds
    none, else the document written again from its redacted data (a `***` pasted into YAML text could make it an
    alias). What the file itself names a secret counts too (`register_document`), so a folder written elsewhere is
    redacted by what it says. Text that does not parse is redacted as text."""
    import json

    import yaml

    data = register_document(text, suffix)
    if data is _UNPARSED:
        return redact(text)
    if redact(text) == text and redact_data(data) == data:
        return text
    if suffix == ".json":
        return json.dumps(redact_data(data), indent=2) + "\n"
    return yaml.safe_dump(redact_data(data), sort_keys=False, allow_unicode=True)


def find_secret(data: str | bytes) -> str | None:
    """What the first known secret found in `data` is (never the value), or None."""
    for value, what in known_secrets().items():
        if (value.encode() if isinstance(data, bytes) else value) in data:
            return what
    return None


class _RedactingRecordFactory:
    """Log-record factory: each record's message (arguments merged), traceback and stack redacted when it is made,
    so that every handler (console, files, tqdm's, pytest's) gets the redacted record."""

    def __init__(self, factory: Any):
        self.factory = factory

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record = self.factory(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: logging reports it when the record is emitted
            return record
        record.msg, record.args = redact(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return record


def install_log_redaction() -> None:
    """Redact every log record made from now on, in this process (idempotent)."""
    factory = logging.getLogRecordFactory()
    if not isinstance(factory, _RedactingRecordFactory):
        logging.setLogRecordFactory(_RedactingRecordFactory(factory))


class RedactingStream:
    """A text stream that writes through to `stream` with every write redacted (the CLI's stdout and stderr)."""

    def __init__(self, stream: Any):
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(redact(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, encoding...: the wrapped stream's
        if name == "stream":  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.stream, name)
