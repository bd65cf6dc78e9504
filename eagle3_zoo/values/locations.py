"""What a location written in a recipe, a card or on the command line names: an embedded default, a Hub repo id or
a local path; whether a local path can be (or become) the file or folder expected there; and whether a server URL
(and the name of the variable holding its key) can be used, shown with any password redacted. One rule each, used by
the recipe checks, the OpenAI-compatible client, the data readers, the model cards and the zoo. Imports nothing
heavy (no torch)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlsplit

EMBEDDED_TARGET = "smollm2-135m-instruct"  # the embedded GGUF target (eagle3_zoo.adapters.embedded)
EMBEDDED_NAMES = (EMBEDDED_TARGET, "embedded")
EMBEDDED_SHAREGPT = "sharegpt-embedded"  # the embedded ShareGPT sample (eagle3_zoo.data.readers)
DATA_SUFFIXES = (".json", ".jsonl", ".gz", ".parquet", ".yaml", ".txt")  # local data files, never Hub ids
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
CACHE_ENV = "EAGLE3_ZOO_CACHE"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def cache_root() -> Path:
    """Where eagle3-zoo caches what it computes once: ``$EAGLE3_ZOO_CACHE`` or ``~/.cache/eagle3_zoo`` (the converted
    embedded target, and by default a recipe's `data.cache_dir`: wherever a command runs from, it finds them)."""
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/eagle3_zoo").expanduser()


def looks_like_hub_id(name: str) -> bool:
    """`org/name` (a Hub repo id, resolved when it is downloaded), whether or not a local path of that name exists."""
    return bool(_HUB_ID.fullmatch(name))


def is_hub_id(name: str) -> bool:
    """`name` can only mean a Hub repo id: the form `org/name`, no data-file suffix, and no local path of that name."""
    return looks_like_hub_id(name) and not name.endswith(DATA_SUFFIXES) and not Path(name).expanduser().exists()


def path_problem(path: str, directory: bool = True, expected: str | None = None) -> str | None:
    """Why `path` cannot be (or become) a directory or a file: something of the other kind is in the way. `expected`
    None = an output directory, which must be writable too (a cache prepared elsewhere may be read-only)."""
    p = Path(path).expanduser().absolute()
    ancestor = next(a for a in (p, *p.parents) if a.exists())
    if ancestor == p and p.is_dir() != directory:
        return f"is a {'file' if directory else 'directory'}; expected {expected}" if expected else \
            "exists and is not a directory"
    if ancestor != p and not ancestor.is_dir():
        return f"cannot be created: '{ancestor}' is a file" + (f"; expected {expected}" if expected else "")
    if expected is None and not os.access(ancestor, os.W_OK | os.X_OK):
        return f"not writable: no write permission on '{ancestor}'"
    return None


def missing_path(path: str) -> bool:
    """A local path that does not exist and cannot be a Hub id (those are checked when downloaded)."""
    return not (path == EMBEDDED_SHAREGPT or Path(path).expanduser().exists() or is_hub_id(path))


def hub_or_local_problem(path: str) -> str | None:
    """Why `path` (a local folder or file, or a Hub id) cannot be found."""
    return "local path does not exist (and it is not a Hub id 'org/name')" if missing_path(path) else None


def target_problem(name: str) -> str | None:
    """Why `name` cannot name a target model (local paths only: Hub ids are resolved when loaded; a folder without
    config.json is reported then too)."""
    if name not in EMBEDDED_NAMES and Path(name).expanduser().is_file():
        return (f"is a file; expected a local model folder with config.json, a Hub repo id 'org/name' or the embedded "
                f"target ({' or '.join(repr(n) for n in EMBEDDED_NAMES)})")
    explicit = name.startswith(("/", "./", "../", "~"))  # cannot be a Hub id
    return "local path does not exist" if explicit and not Path(name).expanduser().exists() else None


def source_problem(path: str) -> str | None:
    """Why `path` cannot name a data source (a file or folder, a Hub dataset id or the embedded ShareGPT sample)."""
    return "must not be empty" if not path.strip() else (
        f"data file not found (relative paths are resolved against the working directory {os.getcwd()}; or use "
        f"'{EMBEDDED_SHAREGPT}')" if missing_path(path) else None)


def redact_url(url: str) -> str:
    """`url` with any ``user:password@`` part replaced by ``***@`` (for messages)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    return parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]).geturl()


def url_problem(url: str) -> str | None:
    """Why `url` cannot be a server root (not http/https, no host, credentials in it), else None."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError as e:
        return f"not a URL ({e})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "expected an http:// or https:// URL with a host, e.g. http://127.0.0.1:8000"
    if parts.username is not None or parts.password is not None:
        return ("credentials in the URL (user:password@) are refused: they would end up in logs and error messages; "
                "put the key in an environment variable and name it in api_key_env")
    return None


def env_name_problem(name: str) -> str | None:
    """Why `name` cannot be the name of the environment variable holding a key (it may be the key itself)."""
    if _ENV_NAME.fullmatch(name):
        return None
    return "must be the NAME of an environment variable (letters, digits, _), e.g. OPENAI_API_KEY, not the key"
