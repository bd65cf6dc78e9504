"""Atomic file writes (a crash never leaves a half-written checkpoint, manifest or cache entry behind), file hashes
and inter-process file locks: the one place the package does each."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Call `write(tmp_path)` on a temp file in the same directory, fsync it, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; the file gets the mode a plain open() would give
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)  # the rename itself survives a power cut


def fsync_dir(path: Path) -> None:
    """fsync a directory (its entries), where the filesystem allows it."""
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    def _write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    atomic_write(path, _write)


def atomic_write_text(path: Path, text: str) -> None:
    def _write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, _write)


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def exclusive_lock(path: str | Path, blocking: bool = True) -> Iterator[None]:
    """Hold an exclusive lock on the lock file `path` (the `filelock` package: flock on POSIX) while the block runs.

    The operating system releases it when the process dies, so a killed holder never blocks the next run.

    Raises:
        BlockingIOError: `blocking=False` and another process holds the lock.
    """
    from filelock import FileLock, Timeout

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=-1 if blocking else 0)
    except Timeout:
        raise BlockingIOError(f"{path} is held by another process") from None
    try:
        yield
    finally:
        lock.release()


def replace_directory(staged: Path, path: Path) -> None:
    """Rename `staged` to `path`, replacing a file or directory there: the old one is moved aside first and then
    deleted, so `path` is never half written (`recover_replaced_directory` puts the old one back if a crash came
    between the two renames)."""
    old = path.with_name(f".{path.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if path.is_dir():
        os.rename(path, old)
    elif path.exists():
        path.unlink()
    os.rename(staged, path)
    shutil.rmtree(old, ignore_errors=True)


def recover_replaced_directory(path: Path) -> None:
    """Undo a `replace_directory` cut short between its renames: the moved-aside checkpoint becomes `path` again."""
    old = path.with_name(f".{path.name}.old")
    if old.is_dir() and not path.exists():
        os.rename(old, path)
        logging.getLogger(__name__).info("restored %s from an interrupted replacement", path)
