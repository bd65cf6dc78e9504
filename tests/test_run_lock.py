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

from eagle3_zoo.training.rundir import RUN_HOLDER, RUN_LOCK, RunDirectoryInUseError, hold_run_directory


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
    assert not (run / RUN_HOLDER).exists() and (run / RUN_LOCK).exists()  # released: the lock file stays, unheld
    with hold_run_directory(run):
        pass


def test_two_runs_at_the_same_instant_one_refuses_and_leftovers_are_removed(env):
    tmp, recipe = env
    run = tmp / "race"
    checkpoints = run / "checkpoints"
    checkpoints.mkdir(parents=True)
    young = checkpoints / ".last.ckpt.k1ll3d.tmp"  # a save killed a second ago: no process holds the run
    young.write_bytes(b"half a checkpoint")
    stage = run / ".drafter.tmp-k1ll3d"  # a drafter folder staged by a killed run
    stage.mkdir()
    (stage / "model.safetensors").write_bytes(b"half")
    cmd = [sys.executable, *cli_entry(use_cli=True), str(recipe), f"output_dir={run}"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                              cwd=REPO) for _ in range(2)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], [err[-2000:] for _, _, err in results]
    (_, out, _), (_, _, refused) = sorted(results, key=lambda r: r[0])
    lines = [ln for ln in refused.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in refused and f"{run} is in use by another run (pid " in lines[0]
    assert out.strip().endswith(str(run / "drafter"))
    assert not young.exists() and not stage.exists()
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt"]
    assert len(list((run / "logs").glob("version_*"))) == 1  # one run's logs, not two sharing version_0


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
    assert r.returncode == 1 and r.stderr.splitlines()[-1].startswith("eagle3_zoo.modeling.io.DiskFullError: "
                                                                      f"could not write {last}: no space left (")
    assert "ulimit -f" in r.stderr.splitlines()[-1] and "During handling" not in r.stderr  # (raised from None)
    assert sorted(p.name for p in last.parent.iterdir()) == []  # no temporary left


def test_no_room_errors_name_the_file_whatever_the_writer_says(tmp_path):
    import errno

    from eagle3_zoo.modeling.io import DiskFullError, no_room_error

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
    from eagle3_zoo.training.resume import IDENTITY_KEY, ResumeError

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
