"""What leaves a drafter folder and what a command leaves behind: links (and shard indexes) leading outside a folder
are refused by `check`, `export` and `publish` and never copied; a checkpoint's recipe is data (`${...}` is never
resolved); `consolidate` writes only drafters `check` accepts and names a damaged file in one line; a killed or
failed export, publish or consolidate leaves no partial file and no stage a rerun keeps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny import tiny_drafter
from training_fixtures import REPO, subprocess_env

from eagle3_zoo.checkpoint import check_drafter
from eagle3_zoo.checkpoint.convert import export_drafter
from eagle3_zoo.cli import main
from eagle3_zoo.training.rundir.checkpoint_io import DRAFTER_INFO_KEY
from eagle3_zoo.training.rundir.outputs import drafter_info
from tests.hub_fixtures import canonical_dir

SECRET = "SECRET-outside-content-0xC0FFEE"


def _cli(capsys, *argv) -> tuple[int, str]:
    """Exit code and the single `error:` line (asserted one, no traceback) of an in-process CLI run; "" if none."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "Traceback" not in err and len(lines) <= 1, err
    return code, lines[0] if lines else ""


def _outside(tmp_path: Path, name: str) -> Path:
    """A file outside the drafter folder holding SECRET (as valid JSON / safetensors where the name asks for it)."""
    path = tmp_path / "elsewhere" / name
    path.parent.mkdir(exist_ok=True)
    if name.endswith(".safetensors"):
        save_file({"secret": torch.zeros(3)}, str(path), metadata={"note": SECRET})
    else:
        path.write_text(json.dumps({"note": SECRET}) if name.endswith(".json") else f"note: {SECRET}\n")
    return path


def _no_secret_in(folder: Path) -> None:
    for path in folder.rglob("*") if folder.exists() else ():
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path


@pytest.mark.parametrize("name", ["eval_results.json", "eval_results_chain.json", "provenance.json", "recipe.yaml",
                                  "eval_results.png", "config.json", "model.safetensors"])
def test_a_link_leaving_the_folder_is_refused_and_never_copied(tmp_path, capsys, name):
    src, _ = canonical_dir(tmp_path)
    if (src / name).exists():
        (src / name).unlink()
    (src / name).symlink_to(_outside(tmp_path, name))
    assert "FILE_OUTSIDE_FOLDER" in check_drafter(src).codes
    code, line = _cli(capsys, "check", src)
    assert code == 1
    code, line = _cli(capsys, "export", src, "--out", tmp_path / "out")
    assert code == 2 and "FILE_OUTSIDE_FOLDER" in line and f"{src / name} leads outside the drafter folder" in line
    code, line = _cli(capsys, "publish", src, "--repo-id", "me/x", "--dry-run", "--stage-dir", tmp_path / "stage")
    assert code == 2 and "FILE_OUTSIDE_FOLDER" in line
    for folder in (tmp_path / "out", tmp_path / "stage"):
        _no_secret_in(folder)
    assert SECRET not in capsys.readouterr().out


def test_a_shard_index_pointing_outside_is_refused_by_check_and_export(tmp_path, capsys):
    src, _ = canonical_dir(tmp_path)
    outside = _outside(tmp_path, "model-00001.safetensors")
    (src / "model.safetensors").rename(tmp_path / "elsewhere" / "real.safetensors")
    for target in (os.path.relpath(outside, src), str(outside)):
        (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"fc.weight": target}}))
        report = check_drafter(src)
        assert report.codes == ["FILE_OUTSIDE_FOLDER"] and "weight_map names files outside the folder" in str(report)
        code, line = _cli(capsys, "export", src, "--out", tmp_path / "out")
        assert code == 2 and "weight_map names files outside the folder" in line
    _no_secret_in(tmp_path / "out")


def test_links_inside_the_folder_and_the_hub_cache_layout_are_fine(tmp_path):
    src, _ = canonical_dir(tmp_path)
    (src / "weights").mkdir()
    (src / "model.safetensors").rename(src / "weights" / "real.safetensors")
    (src / "model.safetensors").symlink_to("weights/real.safetensors")
    assert check_drafter(src).ok
    assert (export_drafter(src, "sglang", tmp_path / "out") / "model.safetensors").stat().st_size > 0
    # huggingface_hub's cache: every file of a snapshot is a link into the repo's blobs
    repo = tmp_path / "hub" / "models--me--drafter"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, path in enumerate(sorted(p for p in src.iterdir() if p.is_file())):
        (blobs / f"blob{i}").write_bytes(path.read_bytes())
        (snapshot / path.name).symlink_to(f"../../blobs/blob{i}")
    assert check_drafter(snapshot).ok
    export_drafter(snapshot, "speculators", tmp_path / "spec")


def _checkpoint(path: Path, *, recipe_dict: dict | None = None, damage=None, **info_overrides) -> Path:
    """A single-file checkpoint as `fit` writes it; `info_overrides` replace raw entries of its drafter record."""
    drafter, _ = tiny_drafter()
    info = drafter_info(drafter.config, None, recipe_dict or {"output_dir": "run"}, {"training": {"max_steps": 7}})
    info.update(info_overrides)
    state = {f"objective.drafter.{k}": v.clone() for k, v in drafter.state_dict().items()}
    if damage:
        damage(state)
    torch.save({"global_step": 7, DRAFTER_INFO_KEY: info, "state_dict": state}, path)
    return path


def test_a_checkpoint_recipe_is_data_its_interpolations_are_never_resolved(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FAKE_HUB_TOKEN", "hf_FAKEtoken123")
    recipe = {"target": {"name_or_path": "${oc.env:FAKE_HUB_TOKEN}"}, "note": "${oc.decode:'x'}"}
    ckpt = _checkpoint(tmp_path / "last.ckpt", recipe_dict=recipe)
    code, _ = _cli(capsys, "consolidate", ckpt, tmp_path / "drafter")
    assert code == 0
    text = (tmp_path / "drafter" / "recipe.yaml").read_text()
    assert "${oc.env:FAKE_HUB_TOKEN}" in text and "hf_FAKEtoken123" not in text
    code, _ = _cli(capsys, "publish", tmp_path / "drafter", "--repo-id", "me/x", "--dry-run", "--stage-dir",
                   tmp_path / "stage")
    assert code == 0 and "${oc.env:FAKE_HUB_TOKEN}" in (tmp_path / "stage" / "README.md").read_text()
    for path in tmp_path.rglob("*"):
        assert not path.is_file() or b"hf_FAKEtoken123" not in path.read_bytes(), path


@pytest.mark.parametrize("damage, code", [
    (lambda s: s["objective.drafter.fc.weight"].view(-1).__setitem__(0, float("nan")), "NONFINITE_WEIGHTS"),
    (lambda s: s["objective.drafter.d2t"].__setitem__(0, 10_000), "D2T_OUT_OF_RANGE")])
def test_consolidate_never_writes_a_drafter_check_rejects(tmp_path, capsys, damage, code):
    ckpt = _checkpoint(tmp_path / "last.ckpt", damage=damage)
    exit_code, line = _cli(capsys, "consolidate", ckpt, tmp_path / "drafter")
    assert exit_code == 2 and f"{tmp_path / 'drafter'}: refusing to write an invalid drafter: {code}" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no drafter, no stage left


def _sharded(path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    drafter, _ = tiny_drafter()
    info = drafter_info(drafter.config, None, {"output_dir": "run"}, {})
    dcp.save({f"state_dict.objective.drafter.{k}": v for k, v in drafter.state_dict().items()},
             checkpoint_id=str(path), no_dist=True)
    torch.save({"global_step": 7, DRAFTER_INFO_KEY: info}, path / "meta.pt")
    return path


def _damaged(path: Path, how: str) -> Path:
    """A sharded checkpoint at `path` with its one .distcp file truncated, deleted or overwritten in place, or its
    .metadata replaced by garbage."""
    _sharded(path)
    shard = next(path.glob("*.distcp"))
    if how == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
    elif how == "delete":
        shard.unlink()
    elif how == "flip":  # same size, other bytes: the tensors read as NaN
        data = bytearray(shard.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 64] = b"\xff" * 64
        shard.write_bytes(bytes(data))
    else:
        (path / ".metadata").write_bytes(b"\x80garbage")
    return path


def _raw(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


CONSOLIDATE_ERRORS = {  # name -> (make the checkpoint in tmp, what the one line says)
    "bad_config_json": (lambda t: _checkpoint(t / "c.ckpt", config="{bad"),
                        "c.ckpt: its eagle3_zoo_drafter.config is not valid JSON (Expecting property name"),
    "bad_provenance_json": (lambda t: _checkpoint(t / "c.ckpt", provenance="[1, 2"),
                            "its eagle3_zoo_drafter.provenance is not valid JSON"),
    "bad_recipe_json": (lambda t: _checkpoint(t / "c.ckpt", recipe="nope"), "eagle3_zoo_drafter.recipe is not valid"),
    "recipe_not_an_object": (lambda t: _checkpoint(t / "c.ckpt", recipe="[1]"),
                             "eagle3_zoo_drafter.recipe is not a JSON object (got JSON list)"),
    "config_of_wrong_types": (lambda t: _checkpoint(t / "c.ckpt", config=json.dumps(
        {**tiny_drafter()[0].config.to_json_dict(), "hidden_size": "32"})),
        "c.ckpt drafter config: invalid Eagle3Config: hidden_size='32'; expected an integer >= 1"),
    "refused_pickle": (lambda t: _raw(t / "c.ckpt", _evil(t / "pwned")),
                       "c.ckpt is not a readable checkpoint (UnpicklingError: refused: it holds a reference to "
                       "posix.system that the safe loader does not allow (nothing in it was run))"),
    "truncated_distcp": (lambda t: _damaged(t / "s.ckpt", "truncate"),
                         "s.ckpt/__0_0.distcp is truncated (100 bytes, its metadata needs"),
    "missing_distcp": (lambda t: _damaged(t / "s.ckpt", "delete"),
                       "s.ckpt/__0_0.distcp is missing: the sharded checkpoint"),
    "overwritten_distcp": (lambda t: _damaged(t / "s.ckpt", "flip"),
                           "drafter: refusing to write an invalid drafter: NONFINITE_WEIGHTS"),
    "corrupt_metadata": (lambda t: _damaged(t / "s.ckpt", "metadata"),
                         "s.ckpt/.metadata is not a readable checkpoint ("),
    "crafted_metadata": (lambda t: _raw(_sharded(t / "s.ckpt") / ".metadata", _evil(t / "pwned", False)).parent,
                         "s.ckpt/.metadata is not a readable checkpoint (UnpicklingError: refused: it holds a "
                         "reference to posix.system, which DCP metadata never holds (nothing in it was run))"),
}


def _evil(marker: Path, torch_save: bool = True) -> bytes:
    """A pickle that creates `marker` when it is unpickled (a torch checkpoint of it, or the bare pickle)."""
    import io
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    if not torch_save:
        return pickle.dumps(Evil())
    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf)
    return buf.getvalue()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("name", list(CONSOLIDATE_ERRORS))
def test_consolidate_names_what_is_damaged_in_one_line(tmp_path, capsys, name):
    make, expected = CONSOLIDATE_ERRORS[name]
    checkpoint = make(tmp_path)
    code, line = _cli(capsys, "consolidate", checkpoint, tmp_path / "drafter")
    assert code == 2 and expected in line and "weights_only" not in line, line
    assert not (tmp_path / "drafter").exists() and not (tmp_path / "pwned").exists()  # no pickle ever ran


def test_consolidate_refuses_an_out_dir_it_would_wipe(tmp_path, capsys, monkeypatch):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    ckpt = _checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    (tmp_path / "work" / "here").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work" / "here")
    for out, says in ((".", "holds the current directory"), ("..", "holds the current directory"),
                      (tmp_path / "run", "holds the checkpoint"),
                      (tmp_path / "mine", "exists and is not a drafter folder (no config.json)")):
        code, line = _cli(capsys, "consolidate", ckpt, out)
        assert code == 2 and says in line, line
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep" and ckpt.is_file()


def test_consolidate_removes_a_killed_writers_stage_but_not_a_live_one(tmp_path, capsys):
    from filelock import FileLock

    ckpt = _checkpoint(tmp_path / "last.ckpt")
    dead = tmp_path / ".drafter.tmp-k1ll3d"  # what a consolidate killed mid-write leaves
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"half")
    live = tmp_path / ".drafter.tmp-w0rk1n"  # another writer's stage, its lock held (by another descriptor)
    live.mkdir()
    lock = FileLock(str(tmp_path / ".drafter.tmp-w0rk1n.lock"))
    lock.acquire()
    try:
        assert _cli(capsys, "consolidate", ckpt, tmp_path / "drafter") == (0, "")
        assert not dead.exists() and live.is_dir()
    finally:
        lock.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["last.ckpt", "drafter", ".drafter.tmp-w0rk1n", ".drafter.tmp-w0rk1n.lock"])


_DRIVER = """
import contextlib, io, json, sys
from eagle3_zoo.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def _limited(commands: list[list[str]], limit: int) -> list[tuple[int, str]]:
    """(exit code, stderr) of each `eagle3-zoo` command, run in one process with a file-size limit (`ulimit -f`):
    every larger write fails as on a full disk (Python ignores SIGXFSZ, the write returns EFBIG)."""
    import resource

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    r = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(commands)], capture_output=True, text=True,
                       timeout=300, env=subprocess_env(PYTHONDONTWRITEBYTECODE="1"), cwd=REPO, preexec_fn=limit_files)
    assert r.returncode == 0, r.stderr[-3000:]
    return [tuple(x) for x in json.loads(r.stdout.splitlines()[-1])]


def test_a_full_disk_is_one_line_and_leaves_no_partial_file(tmp_path):
    src, _ = canonical_dir(tmp_path)
    ckpt = _checkpoint(tmp_path / "last.ckpt")
    commands = {"consolidate": ["consolidate", ckpt], "export": ["export", src, "--out"],
                "export-speculators": ["export", src, "--format", "speculators", "--out"],
                "publish": ["publish", src, "--repo-id", "me/x", "--dry-run", "--stage-dir"]}
    outs = {name: tmp_path / f"out-{name}" for name in commands}
    results = _limited([[str(a) for a in (*argv, outs[name])] for name, argv in commands.items()],
                       limit=(src / "model.safetensors").stat().st_size // 2)
    for (name, out), (code, err) in zip(outs.items(), results):
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert code in (1, 2) and len(lines) == 1 and "Traceback" not in err, (name, err[-3000:])
        assert f"could not write {out}: no space left" in lines[0] and "ulimit -f" in lines[0], (name, lines[0])
        assert "inline_container" not in lines[0] and "unexpected pos" not in lines[0]
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}")], name  # no stage left
        assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()], name  # no partial file


def test_a_killed_export_leaves_nothing_a_rerun_keeps(tmp_path):
    src, _ = canonical_dir(tmp_path)
    out, marker = tmp_path / "out", tmp_path / "writing"
    script = (
        "import sys, time, safetensors.torch as st\n"
        "from eagle3_zoo.checkpoint.convert import export_drafter\n"
        "real = st.save_file\n"
        "def slow(tensors, path, metadata=None):\n"
        "    open(path, 'wb').write(b'half a file')\n"
        f"    open({str(marker)!r}, 'w').close()\n"
        "    time.sleep(60)\n"
        "st.save_file = slow\n"  # the speculators writer (checkpoint/layouts.py) imports it when it writes
        f"export_drafter({str(src)!r}, 'speculators', {str(out)!r})\n")
    proc = subprocess.Popen([sys.executable, "-c", script], env=subprocess_env(), cwd=REPO,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert marker.exists()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not out.exists() or not list(out.iterdir())  # nothing half written in the output
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]  # the killed writer's stage
    export_drafter(src, "speculators", out)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # removed by the rerun
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert check_drafter(out).ok


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()} if folder.exists() else {}


_KILL_AT_RENAME = """
import os, sys
from pathlib import Path
from eagle3_zoo.checkpoint.convert import export_drafter
src, out, kill_at = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
renames = 0
def killed_after(real):
    def rename(a, b, *args, **kwargs):
        global renames
        real(a, b, *args, **kwargs)
        if out in (Path(a), Path(b), Path(b).parent):  # a move into, out of or of the output folder
            renames += 1
            if renames == kill_at:
                os._exit(9)  # SIGKILL-like: no cleanup of any kind
    return rename
os.replace, os.rename = killed_after(os.replace), killed_after(os.rename)
export_drafter(src, "speculators", out)
"""


@pytest.mark.parametrize("previous", [False, True], ids=["new-out", "existing-out"])
@pytest.mark.parametrize("kill_at", [1, 2, 3])
def test_export_killed_at_any_rename_leaves_out_whole(tmp_path, previous, kill_at):
    """`export` killed right after any rename that moves files into (or the folder of) `--out`: `--out` is absent,
    the previous folder, or the complete new one, never a mix; a rerun gives the complete folder and keeps the
    previous folder's other files."""
    src, _ = canonical_dir(tmp_path)
    (src / "recipe.yaml").write_text("target: {name_or_path: tiny}\n")
    reference = export_drafter(src, "speculators", tmp_path / "reference")
    out = tmp_path / "out"
    old: dict[str, bytes] = {}
    if previous:
        export_drafter(src, "sglang", out)
        (out / "notes.txt").write_text("mine")
        old = _contents(out)
    new = {**_contents(reference), **({"notes.txt": b"mine"} if previous else {})}
    r = subprocess.run([sys.executable, "-c", _KILL_AT_RENAME, str(src), str(out), str(kill_at)], env=subprocess_env(),
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode in (9, 0), r.stderr[-3000:]
    assert r.returncode == 9 or kill_at > 1  # the first rename always comes
    assert _contents(out) in ({}, old, new), sorted(_contents(out))
    assert not out.exists() or (check_drafter(out).ok and _contents(out) in (old, new))
    export_drafter(src, "speculators", out)
    assert _contents(out) == new
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no stage or moved-aside folder left


def test_export_refuses_a_folder_that_is_not_a_drafter_unless_forced(tmp_path, capsys, monkeypatch):
    src, _ = canonical_dir(tmp_path)
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "smollm2_135m.yaml").write_text("mine")
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (target / "model.safetensors").write_bytes(b"the target's weights")
    for out, says in ((recipes, "(no config.json)"), (target, "(its config.json is not a drafter's)")):
        before = _contents(out)
        code, line = _cli(capsys, "export", src, "--out", out)
        assert code == 2 and f"{out} exists and is not a drafter folder {says}" in line, line
        assert "pass --force to write the drafter into it anyway" in line, line
        assert _contents(out) == before and not [p for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}")]
    monkeypatch.chdir(recipes)
    code, line = _cli(capsys, "export", src, "--out", ".")
    assert code == 2 and "holds the current directory" in line, line
    monkeypatch.chdir(tmp_path)
    code, _ = _cli(capsys, "export", src, "--out", recipes, "--force")
    assert code == 0 and sorted(_contents(recipes)) == ["config.json", "model.safetensors", "smollm2_135m.yaml"]
    assert (recipes / "smollm2_135m.yaml").read_text() == "mine" and check_drafter(recipes).ok
    (recipes / "smollm2_135m.yaml").unlink()
    code, _ = _cli(capsys, "export", src, "--out", recipes, "--format", "speculators")  # a drafter folder: rewritten
    assert code == 0 and check_drafter(recipes).format == "speculators"


def test_check_with_the_engine_leaves_no_temporary_folder(tmp_path, monkeypatch):
    import tempfile

    from eagle3_zoo.speculative import engine_eval

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []

    def fake_evaluate_in_vllm(drafter, target, bench, *, work_dir, **kwargs):
        seen.append(Path(work_dir))
        assert Path(work_dir).is_dir()
        return {"overall": {"drafts": 4, "accepted_tokens": 2, "draft_tokens": 12, "tau": 1.5, "requests": 2},
                "versions": {"vllm": "fake"}, "settings": {"target": "t", "drafter_format_served": "canonical",
                                                           "drafter_dir_served": str(Path(drafter).resolve())}}

    monkeypatch.setattr(engine_eval, "evaluate_in_vllm", fake_evaluate_in_vllm)
    assert engine_eval.engine_smoke("drafter")["ok"]
    assert seen and seen[0].name.startswith("eagle3-zoo-check-") and list(tmp_path.iterdir()) == []


def test_check_with_the_engine_failing_before_a_server_starts_leaves_no_temporary_folder(tmp_path, capsys,
                                                                                       monkeypatch):
    """No engine python: `check --engine vllm` fails before any server starts (exit 2), and its temporary folder,
    which holds no server log to read, is gone."""
    import tempfile

    from transformers import LlamaConfig

    from eagle3_zoo.adapters import get_adapter
    from tests.hub_fixtures import tiny_target_config

    src, _ = canonical_dir(tmp_path)
    target = tmp_path / "target"
    LlamaConfig.save_pretrained(tiny_target_config(), target)
    get_adapter("llama").tiny_tokenizer().save_pretrained(target)
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setenv("EAGLE3_ZOO_VLLM_PYTHON", str(tmp_path / "no-such-venv" / "bin" / "python"))
    monkeypatch.chdir(tmp_path)  # no .venv-vllm here either
    code, line = _cli(capsys, "check", src, "--target", target, "--engine", "vllm")
    assert code == 2 and "no vLLM python found" in line, line
    assert list(temp.iterdir()) == []


def test_a_failed_publish_leaves_nothing_in_its_stage_dir(tmp_path, capsys, monkeypatch):
    import socket

    monkeypatch.setenv("HF_TOKEN", "hf_FAKEtokenForTheStageTest")
    src, _ = canonical_dir(tmp_path)
    with socket.socket() as sock:  # bound then closed: connecting is refused at once
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for stage, existed in ((tmp_path / "new-stage", False), (tmp_path / "empty-stage", True)):
        if existed:
            stage.mkdir()
        code, line = _cli(capsys, "publish", src, "--repo-id", "me/x", "--endpoint", url, "--stage-dir", stage)
        # an unreachable Hub is not bad input (exit 1); it failed after staging everything
        assert code == 1 and f"Hub endpoint {url} is not reachable" in line
        assert (list(stage.iterdir()) == []) if existed else not stage.exists()  # as it was before: nothing staged


def test_export_checks_what_it_staged_before_it_reaches_the_output(tmp_path, monkeypatch):
    from eagle3_zoo.checkpoint import layouts
    from eagle3_zoo.checkpoint.check import InvalidDrafterError

    src, _ = canonical_dir(tmp_path)
    real = layouts.speculators_config
    monkeypatch.setattr(layouts, "speculators_config", lambda *a, **k: {**real(*a, **k), "draft_vocab_size": 5})
    out = tmp_path / "out"
    with pytest.raises(InvalidDrafterError, match=rf"{out}: refusing to export an invalid drafter: "):
        export_drafter(src, "speculators", out)  # a conversion that went wrong: its result never reaches `out`
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
