"""The hidden-states file hand-over between the engine's connector and the trainer without a file lock: the connector
writes each file under a temporary name and renames it, so the final name appears only complete, on this node or on
another one sharing the directory (where `flock` excludes nothing, or fails: Lustre without ``-o flock``); the reader
waits for the name, up to `engine.timeout`, and never reads half a file."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from eagle3_zoo.targets import vllm_features
from eagle3_zoo.targets.engine import PLUGIN_DIR
from eagle3_zoo.targets.openai_client import BadAnswerError
from eagle3_zoo.targets.vllm_features import discard_hidden_states, read_hidden_states

IDS, LAYERS, HIDDEN = [5, 17, 42, 7, 99], 4, 64

# the server's hand-over (`eagle3_zoo_hs_files.write_atomically`, imported as the vLLM process imports it) writing a
# safetensors file's bytes slowly: 8 pieces over ~1.6 s, as a large file on a busy shared disk
SLOW_WRITER = """
import sys, time
import eagle3_zoo_hs_files as files

data = open(sys.argv[2], "rb").read()

def slowly(path):
    with open(path, "wb") as f:
        step = len(data) // 8 + 1
        for i in range(0, len(data), step):
            f.write(data[i:i + step])
            f.flush()
            time.sleep(0.2)

files.write_atomically(sys.argv[1], slowly)
"""


def _plugin_files():
    sys.path.insert(0, str(PLUGIN_DIR))
    try:
        import eagle3_zoo_hs_files
    finally:
        sys.path.remove(str(PLUGIN_DIR))
    return eagle3_zoo_hs_files


def test_a_file_written_slowly_under_a_temporary_name_is_read_whole_once_renamed(tmp_path):
    states = torch.randn(len(IDS), LAYERS, HIDDEN)
    payload = tmp_path.parent / f"{tmp_path.name}-payload.safetensors"
    save_file({"hidden_states": states, "token_ids": torch.tensor(IDS)}, str(payload))
    path = tmp_path / "cmpl-e3zr0-t1-0-ab12cd34.safetensors"
    writer = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(path), str(payload)],
                              env={**os.environ, "PYTHONPATH": str(PLUGIN_DIR)})
    try:
        deadline = time.monotonic() + 60
        while not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]:  # the writer has begun
            assert writer.poll() is None and time.monotonic() < deadline, "the writer never began"
            time.sleep(0.01)
        assert not path.exists()  # half written: under its temporary name only
        # the answer arrives before the file: the reader waits for the name (before: "no such file" at once)
        got = read_hidden_states(path, IDS, LAYERS, HIDDEN, server="http://s:1", lock_timeout=60)
    finally:
        writer.wait(timeout=60)
    assert torch.equal(got, states)  # every byte, never a partial read
    assert writer.returncode == 0 and not list(tmp_path.iterdir())  # read once, deleted; no temporary left


def test_a_writer_that_fails_leaves_no_temporary_and_no_final_name(tmp_path):
    files = _plugin_files()
    path = tmp_path / "cmpl-e3zr0-t1-0-ab12cd34.safetensors"

    def disk_full(where):
        with open(where, "wb") as f:
            f.write(b"half a header")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        files.write_atomically(str(path), disk_full)
    assert not list(tmp_path.iterdir())  # neither the half-written temporary nor a final name
    states = torch.randn(len(IDS), LAYERS, HIDDEN)
    files.save_atomically({"hidden_states": states, "token_ids": torch.tensor(IDS)}, str(path))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert torch.equal(read_hidden_states(path, IDS, LAYERS, HIDDEN, lock_timeout=5), states)


def test_a_filesystem_without_flock_is_not_an_error(tmp_path, monkeypatch):
    """Lustre mounted without `-o flock` fails flock() with ENOSYS: the lock file says nothing there, and the file's
    name is the signal (before: the OSError escaped the reader and stopped the feed)."""
    path = tmp_path / "cmpl-e3zr0-t1-0-ab12cd34.safetensors"
    save_file({"hidden_states": torch.ones(len(IDS), LAYERS, HIDDEN), "token_ids": torch.tensor(IDS)}, str(path))
    (tmp_path / f"{path.name}.lock").touch()  # a stock connector's lock file, as another node sees it

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(vllm_features.fcntl, "flock", no_flock)
    assert torch.equal(read_hidden_states(path, IDS, LAYERS, HIDDEN, lock_timeout=5), torch.ones(5, LAYERS, HIDDEN))
    assert not list(tmp_path.iterdir())  # the file and its lock are deleted


def test_a_file_nobody_reads_is_deleted_once_it_appears_and_a_missing_one_ends_at_the_deadline(tmp_path, caplog):
    path = tmp_path / "cmpl-e3zr0-r1-0-ab12cd34.safetensors"
    tmp = tmp_path / f"{path.name}.tmp-1-1"
    save_file({"hidden_states": torch.ones(2, 2)}, str(tmp))
    threading.Timer(0.3, os.replace, (tmp, path)).start()  # renamed after the answer came back
    discard_hidden_states(path, timeout=30)
    assert not list(tmp_path.iterdir())  # before: nothing there yet to delete, and the file appeared afterwards
    start = time.monotonic()
    discard_hidden_states(tmp_path / "cmpl-e3zr0-r2-0-00000000.safetensors", timeout=0.3)
    assert time.monotonic() - start < 5 and "not deleted: " in caplog.text and "no such file after 0.3 s" in caplog.text
    with pytest.raises(BadAnswerError, match=r"no such file after 0.3 s \(engine.timeout\): is engine.hidden_states_"
                                             "dir the directory"):
        read_hidden_states(tmp_path / "cmpl-e3zr0-r2-0-00000000.safetensors", IDS, LAYERS, HIDDEN, lock_timeout=0.3)
