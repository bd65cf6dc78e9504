"""Atomic file writes (a crash never leaves a half-written checkpoint, manifest or cache entry behind), staged
folders, file hashes, inter-process file locks, and what to say when a write runs out of space or `torch.load`
refuses a pickle: the one place the package does each."""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

logger = logging.getLogger(__name__)
# what a write that ran out of room says: errno (disk full, file too large, quota), torch's zip writer (a short
# write), safetensors' Rust I/O error
_NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_NO_ROOM_TEXT = ("unexpected pos", "No space left", "File too large", "Disk quota", "os error 28", "os error 27",
                 "os error 122")


class DiskFullError(OSError):
    """A write ran out of room (disk full, quota, or the file-size limit); the message names the file and where."""


def no_room_error(path: Path, error: BaseException) -> DiskFullError | None:
    """A one-line `DiskFullError` naming `path` when `error` means the disk (or the file-size limit) is full."""
    if not isinstance(error, Exception):
        return None
    if not ((isinstance(error, OSError) and error.errno in _NO_ROOM_ERRNOS)
            or any(s in str(error) for s in _NO_ROOM_TEXT)):
        return None
    where = next((p for p in (Path(path).parent, *Path(path).parents) if p.exists()), Path("."))
    free = shutil.disk_usage(where).free
    limit = ""
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        limit = "" if soft == resource.RLIM_INFINITY else f"; the file-size limit (ulimit -f) is {soft} bytes"
    full = DiskFullError(f"could not write {path}: no space left (the disk holding {where} has {free / 1e6:.1f} MB "
                         f"free{limit}); free space there or write elsewhere, then rerun")
    full.errno = errno.ENOSPC
    return full


def pickle_refusal(error: BaseException) -> str:
    """What `torch.load(weights_only=True)` refused, without torch's advice to load the file unsafely."""
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    what = f"a reference to {found[1]}" if found else "an object"
    return f"refused: it holds {what} that the safe loader does not allow (nothing in it was run)"


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
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if full := no_room_error(path, e):
            raise full from None
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


def atomic_copy(src: str | Path, dest: str | Path) -> None:
    """Copy the file `src` to `dest` atomically (see `atomic_write`)."""
    atomic_write(Path(dest), lambda tmp: shutil.copyfile(src, tmp))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_dead_stages(path: Path) -> None:
    """Remove the stages of `path` (`.NAME.tmp-*`) whose writers are gone: a live writer holds its stage's lock."""
    removed = 0
    for stage in sorted(path.parent.glob(f".{glob.escape(path.name)}.tmp-*")):
        if stage.name.endswith(".lock"):
            if stage.with_suffix("").exists():
                continue  # checked with its stage
            lock, stage = stage, None
        else:
            lock = stage.with_name(stage.name + ".lock")
        try:
            with exclusive_lock(lock, blocking=False):
                if stage is not None:
                    _remove(stage)
                    removed += 1
                lock.unlink(missing_ok=True)
        except BlockingIOError:
            continue  # another process is writing it now
    if removed:
        logger.info("removed %d staging leftover(s) of an interrupted write of %s", removed, path)


@contextlib.contextmanager
def staged_directory(path: str | Path) -> Iterator[Path]:
    """A new temp folder next to `path` (`.NAME.tmp-*`) to stage `path`'s files in; removed when the block ends
    (after the block renamed or moved its content into place, or after a failure).

    Each stage is locked (`.NAME.tmp-*.lock`, taken before the folder exists) while its writer lives, so the stages
    of writers that were killed are recognised and removed first: a killed export, consolidate or fit leaves nothing
    that a later write of `path` keeps, and a concurrent writer's stage is never touched. A write that runs out of
    room is reported by `DiskFullError` naming `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_stages(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", suffix=".lock", dir=path.parent)
    os.close(fd)
    lock = Path(name)
    try:
        with exclusive_lock(lock):
            tmp = lock.with_suffix("")
            tmp.mkdir(mode=0o700)
            try:
                yield tmp
            except Exception as e:
                if full := no_room_error(path, e):
                    raise full from None
                raise
            finally:
                _remove(tmp)
    finally:
        lock.unlink(missing_ok=True)


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
        logger.info("restored %s from an interrupted replacement", path)
