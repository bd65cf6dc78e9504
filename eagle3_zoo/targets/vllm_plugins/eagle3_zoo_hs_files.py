"""A hidden-states file that a reader on any node sees whole or not at all, without a file lock.

The server's connector writes the file under a temporary name in the same directory and renames it: the final name
appears only once the file is complete (a rename within one directory is atomic on POSIX filesystems, NFS and Lustre
included, and NFS's close-to-open consistency makes the closed file's bytes visible to whoever opens it by its new
name). A writer that dies leaves only its temporary (`<name>.tmp-<pid>-<thread>`: no reader takes it for a
connector file). Loaded inside the vLLM server process; imports neither vllm nor eagle3_zoo.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any


def temporary_name(filename: str) -> str:
    """Where `filename` is written before its rename: next to it, unique to this process and thread."""
    return f"{filename}.tmp-{os.getpid()}-{threading.get_ident()}"


def write_atomically(filename: str, write: Callable[[str], None]) -> None:
    """`write(path)` to a temporary name, then one rename to `filename`; on any failure, no temporary is left and
    `filename` is not touched."""
    tmp = temporary_name(filename)
    try:
        write(tmp)
        os.replace(tmp, filename)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def save_atomically(tensors: dict[str, Any], filename: str) -> None:
    """safetensors' `save_file(tensors)` to `filename`, handed over by rename (see the module docstring)."""
    from safetensors.torch import save_file  # the server has torch loaded already

    write_atomically(filename, lambda tmp: save_file(tensors, tmp))
