"""One `fit` per output_dir: two runs started at the same instant give one drafter and one one-line refusal naming
the holder (not two "successes" of which one is lost); a run held elsewhere is refused before anything loads; the
holder removes what killed runs left (checkpoint temporaries of any age, drafter stages). Offline `fit` verifies the
sha256 of every feature shard before training and refuses one rewritten at the same size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from training_fixtures import REPO, cli_entry, subprocess_env, tiny_run_files

from eagle3_zoo.training.rundir.lock import RUN_HOLDER, RUN_LOCK, RunDirectoryInUseError, hold_run_directory


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lock")
    return tmp, tiny_run_files(tmp, n=12, trainer={"max_steps": 2})


def test_a_run_held_elsewhere_is_refused_at_once_naming_the_holder(env):
    from eagle3_zoo.training.fit import fit_main

    tmp, recipe = env
    run = tmp / "held"
    with hold_run_directory(run):  # this process holds it (another descriptor: the lock is per open file)
        holder = json.loads((run / RUN_HOLDER).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] and holder["started"]
        start = time.monotonic()
        with pytest.raises(RunDirectoryInUseError) as refused:
            fit_main(recipe, [f"output_dir={run}"])
        assert time.monotonic() - start < 5  # before the target or the data are loaded
    line = str(refused.value)
    assert "\n" not in line and f"{run} is in use by another run (pid {os.getpid()} on {holder['host']}, started " \
        f"{holder['started']}" in line and "set another output_dir" in line
    assert not run.exists()  # released; the hold created the folder and nothing was written: nothing is left
    run.mkdir()
    (run / "mine.txt").write_text("x")
    with hold_run_directory(run):  # free again; a folder that held something keeps it and the (unheld) lock file
        pass
    assert sorted(p.name for p in run.iterdir()) == [RUN_LOCK, "mine.txt"]


def _leftovers(run):
    """What a run killed mid-save leaves: a checkpoint temporary written a second ago, a staged drafter folder."""
    checkpoints = run / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    young = checkpoints / ".last.ckpt.k1ll3d.tmp"  # younger than any age rule: only the lock says it is stale
    young.write_bytes(b"half a checkpoint")
    stage = run / ".drafter.tmp-k1ll3d"
    stage.mkdir()
    (stage / "model.safetensors").write_bytes(b"half")
    return young, stage


def test_a_second_run_on_a_busy_output_dir_refuses_and_the_holder_cleans_up(env):
    """Without the lock both runs reported success: they shared logs/version_0 and one drafter was lost."""
    import signal

    tmp, recipe = env
    run = tmp / "busy"
    young, stage = _leftovers(run)
    cmd = [sys.executable, *cli_entry(), str(recipe), f"output_dir={run}"]
    first = subprocess.Popen([*cmd, "trainer.max_steps=100000", "trainer.checkpoint_every_n_steps=null"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=subprocess_env(), cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not (run / RUN_HOLDER).exists() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.05)
        holder = json.loads((run / RUN_HOLDER).read_text())
        assert holder["pid"] == first.pid and not young.exists() and not stage.exists()  # removed by the holder
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=REPO)
        assert first.poll() is None  # the first run was training all along
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    lines = [ln for ln in second.stderr.splitlines() if ln.startswith("error:")]
    assert second.returncode == 2 and len(lines) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert f"{run} is in use by another run (pid {first.pid} on {holder['host']}, started {holder['started']}" \
        in lines[0]
    young, stage = _leftovers(run)  # the killed run's leftovers: the next run removes them, however young
    third = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=REPO)
    assert third.returncode == 0, third.stderr[-3000:]
    assert not young.exists() and not stage.exists() and "removed 1 stale temporary" in third.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt"]
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == [RUN_LOCK]


def test_offline_fit_refuses_a_feature_shard_rewritten_at_the_same_size(env, tmp_path, capsys, caplog):
    import logging

    from safetensors.torch import load_file, save_file

    from eagle3_zoo.cli import main
    from eagle3_zoo.data.features import FeatureStoreError
    from eagle3_zoo.training.fit import fit_main

    _, recipe = env
    overrides = ["data.mode=offline", f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'run'}",
                 "trainer.max_steps=1"]
    assert main(["prepare", str(recipe), *overrides]) == 0
    store = json.loads(capsys.readouterr().out)["features_dir"]
    manifest = json.loads(open(f"{store}/manifest.json").read())
    shard = f"{store}/{manifest['shards'][1]['file']}"
    tensors = load_file(shard)
    key = next(k for k in tensors if k.endswith(".aux_hidden"))
    tensors[key] = tensors[key] * 1.5  # other floats, same shapes: the same file size
    size = os.path.getsize(shard)
    meta = {"eagle3-zoo-features": json.dumps({"sample_ids": manifest["shards"][1]["samples"], "version": 1})}
    save_file(tensors, shard, metadata=meta)
    assert os.path.getsize(shard) == size
    with pytest.raises(FeatureStoreError) as refused:
        fit_main(recipe, overrides)
    assert f"{shard}: sha256 " in str(refused.value) and "does not match the manifest" in str(refused.value)
    assert "rerun `eagle3-zoo prepare`" in str(refused.value) and not (tmp_path / "run" / "drafter").exists()
    assert main(["prepare", str(recipe), *overrides]) == 0  # prepare extracts the damaged shard again
    with caplog.at_level(logging.INFO, logger="eagle3_zoo.training.build"):
        fit_main(recipe, overrides)
    verified = [r.getMessage() for r in caplog.records if "verified the sha256" in r.getMessage()]
    assert len(verified) == 1 and f"of {len(manifest['shards'])} feature shard(s)" in verified[0]
    assert " MB/s" in verified[0] and "before training" in verified[0]


def test_a_checkpoint_save_on_a_full_disk_is_one_line_naming_the_file(tmp_path):
    """torch's own message for a short write is "[enforce fail at inline_container.cc] unexpected pos": `fit`'s
    checkpoint writer says the disk is full and where (here: a file-size limit, `ulimit -f`, which makes every larger
    write fail), and leaves no temporary behind."""
    import resource

    last = tmp_path / "checkpoints" / "last.ckpt"
    script = ("import torch\nfrom eagle3_zoo.training.fit import AtomicCheckpointIO\n"
              f"AtomicCheckpointIO().save_checkpoint({{'w': torch.zeros(100_000)}}, {str(last)!r})\n")

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # the checkpoint is 400 kB

    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env=subprocess_env(PYTHONDONTWRITEBYTECODE="1"), cwd=REPO, preexec_fn=limit_files)
    assert r.returncode == 1 and r.stderr.splitlines()[-1].startswith("eagle3_zoo.util.fileio.DiskFullError: "
                                                                      f"could not write {last}: no space left (")
    assert "ulimit -f" in r.stderr.splitlines()[-1] and "During handling" not in r.stderr  # (raised from None)
    assert sorted(p.name for p in last.parent.iterdir()) == []  # no temporary left


def test_no_room_errors_name_the_file_whatever_the_writer_says(tmp_path):
    import errno

    from eagle3_zoo.util.fileio import DiskFullError, no_room_error

    path = tmp_path / "out" / "model.safetensors"
    for error in (OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EDQUOT, "Disk quota exceeded"),
                  RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
                  Exception("Error while serializing: I/O error: No space left on device (os error 28)")):
        full = no_room_error(path, error)
        assert isinstance(full, DiskFullError) and str(full).startswith(f"could not write {path}: no space left")
    assert no_room_error(path, OSError(errno.EACCES, "Permission denied")) is None
    assert no_room_error(path, RuntimeError("something else")) is None


def test_fit_refuses_a_sharded_checkpoint_with_crafted_metadata_before_dcp_unpickles_it(env, tmp_path):
    """DCP reads a sharded checkpoint's .metadata with the plain unpickler: `fit` checks it safely first."""
    import pickle

    import torch

    from eagle3_zoo.training.fit import fit_main
    from eagle3_zoo.training.rundir.resume import IDENTITY_KEY, ResumeError

    _, recipe = env
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    last.mkdir(parents=True)
    torch.save({"global_step": 1, IDENTITY_KEY: {"optim.lr": "0.001"}}, last / "meta.pt")
    (last / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ResumeError) as refused:
        fit_main(recipe, [f"output_dir={tmp_path / 'run'}"])
    assert f"{last / '.metadata'} is not a readable checkpoint (UnpicklingError: refused: it holds a reference to " \
        "posix.system" in str(refused.value) and "set another output_dir" in str(refused.value)
    assert not marker.exists()
