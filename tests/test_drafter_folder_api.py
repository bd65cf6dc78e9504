"""The Python API of a drafter folder (`eagle3_zoo.DrafterFolder`): the weight files are read once per command, and
its check, export, drafter and digests equal the path-based functions' (what the commands printed before)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from eagle3_zoo import DrafterFolder, EvalSettings
from eagle3_zoo.checkpoint import InvalidDrafterError, check_drafter, export_drafter, import_drafter
from eagle3_zoo.checkpoint.convert import tensors_digest
from eagle3_zoo.checkpoint.weights import weights_digest
from eagle3_zoo.cli import main as cli_main
from eagle3_zoo.util.fileio import sha256_file
from tests import test_hub_check
from tests.hub_fixtures import canonical_dir, edit_weights, official_dir, tiny_target_config
from tests.test_speculative_eval import _saved_target_and_drafter

_WATCHED: list[tuple[Path, list[str]]] = []  # (folder, opens seen) while a `weight_reads` block runs


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _WATCHED and isinstance(args[0], (str, bytes, Path)):
        path = Path(args[0].decode() if isinstance(args[0], bytes) else args[0])
        for folder, seen in _WATCHED:
            if path.parent == folder and path.name in ("model.safetensors", "pytorch_model.bin"):
                seen.append(f"open {path.name}")


sys.addaudithook(_audit)  # hooks cannot be removed: it records only inside `weight_reads`


@contextlib.contextmanager
def weight_reads(folder: Path, monkeypatch):
    """Every opening of `folder`'s weight file: Python's own (`open`, `os.open`, `torch.load` of a path: the "open"
    audit event) and safetensors' `safe_open` (Rust: no audit event), wherever it was imported from."""
    seen: list[str] = []
    real = safetensors.safe_open

    def counting_safe_open(filename, *args, **kwargs):
        if Path(filename).resolve().parent == folder.resolve():
            seen.append(f"safe_open {Path(filename).name}")
        return real(filename, *args, **kwargs)

    for module in (safetensors, safetensors.torch):
        monkeypatch.setattr(module, "safe_open", counting_safe_open)
    _WATCHED.append((folder.resolve(), seen))
    try:
        yield seen
    finally:
        _WATCHED.pop()


def test_eval_reads_the_drafter_weights_once(tmp_path, monkeypatch, capsys):
    """Three checks (alone, against the shipped/local target config, against the loaded target), two digests and
    the load: one read of model.safetensors."""
    target_dir, drafter_dir = _saved_target_and_drafter(tmp_path)
    out = tmp_path / "r.json"
    with weight_reads(drafter_dir, monkeypatch) as seen:
        assert cli_main(["eval", str(drafter_dir), "--bench", "humaneval", "--limit", "1", "--max-new-tokens", "4",
                         "--mode", "chain", "--depth", "2", "--no-baseline", "--no-progress", "--out", str(out)]) == 0
    assert seen == ["open model.safetensors"], seen
    settings = json.loads(out.read_text())["settings"]
    assert settings["drafter_weights_sha256"] == sha256_file(drafter_dir / "model.safetensors")
    assert settings["drafter_tensors_sha256"] == tensors_digest(drafter_dir)
    assert settings["target"] == str(target_dir) and settings["drafter"] == str(drafter_dir.resolve())
    # the same evaluation from Python: the same figures, one read
    with weight_reads(drafter_dir, monkeypatch) as seen:
        results = DrafterFolder.open(drafter_dir).evaluate(
            settings=EvalSettings(benches=("humaneval",), mode="chain", depth=2, max_new_tokens=4, limit=1,
                                  spread=False, baseline=False), device="cpu", progress=False)
    assert seen == ["open model.safetensors"], seen
    keys = ("requests", "new_tokens", "cycles", "tau", "depth_attempts", "depth_accepts")
    cli = json.loads(out.read_text())["benchmarks"]["humaneval"]
    assert {k: results["benchmarks"]["humaneval"][k] for k in keys} == {k: cli[k] for k in keys}
    assert {k: results["settings"][k] for k in settings if k.startswith("drafter")} == \
        {k: v for k, v in settings.items() if k.startswith("drafter")}


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_check_and_export_read_the_weights_once(tmp_path, monkeypatch, capsys, fmt):
    src, _ = canonical_dir(tmp_path)
    with weight_reads(src, monkeypatch) as seen:
        assert cli_main(["check", str(src)]) == 0
    assert seen == ["open model.safetensors"], seen
    with weight_reads(src, monkeypatch) as seen:
        assert cli_main(["export", str(src), "--format", fmt, "--out", str(tmp_path / "out")]) == 0
    assert seen == ["open model.safetensors"], seen


def test_the_api_answers_as_the_path_based_functions(tmp_path):
    src, drafter = canonical_dir(tmp_path)
    official = official_dir(tmp_path, drafter)  # pytorch_model.bin, read with the restricted unpickler
    target = tiny_target_config()
    for folder in (src, official):
        opened = DrafterFolder.open(folder)
        assert opened.check(target) == check_drafter(folder, target)
        assert opened.check() == check_drafter(folder)
        assert opened.check(str(folder)) == check_drafter(folder, str(folder))  # a folder's config: not a target's
        assert opened.weights_digest == weights_digest(folder)
        assert opened.tensors_digest == tensors_digest(folder)
        loaded, expected = opened.drafter().state_dict(), import_drafter(folder).state_dict()
        assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)
        for fmt in ("sglang", "speculators"):
            ours = opened.export(tmp_path / f"ours-{folder.name}-{fmt}", fmt, verifier="org/target")
            theirs = export_drafter(folder, fmt, tmp_path / f"theirs-{folder.name}-{fmt}", verifier="org/target")
            names = sorted(p.name for p in theirs.iterdir())
            assert sorted(p.name for p in ours.iterdir()) == names
            assert all((ours / n).read_bytes() == (theirs / n).read_bytes() for n in names), (folder, fmt)


def test_a_broken_folder_opens_is_reported_and_refused(tmp_path):
    src, _ = canonical_dir(tmp_path)
    edit_weights(src, lambda state: state.__setitem__("lm_head.weight", state["lm_head.weight"] * float("nan")))
    opened = DrafterFolder.open(src)
    assert "NONFINITE_WEIGHTS" in opened.check().codes and opened.check() == check_drafter(src)
    with pytest.raises(InvalidDrafterError, match="NONFINITE_WEIGHTS"):
        opened.export(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(InvalidDrafterError, match="refusing to evaluate an invalid drafter"):
        opened.eval_target()
    (src / "model.safetensors").write_bytes(b"\x08")  # truncated: the report names it, loading refuses it
    broken = DrafterFolder.open(src)
    assert broken.check().codes == check_drafter(src).codes == ["CORRUPT_WEIGHTS"]
    with pytest.raises(InvalidDrafterError, match="CORRUPT_WEIGHTS"):
        broken.drafter()
    missing = DrafterFolder.open(tmp_path / "nowhere")
    assert missing.check().codes == ["CONFIG_MISSING"]


def _api_check(path_or_dir, target_config=None):
    """`check_drafter` answered by an opened folder."""
    return DrafterFolder.open(path_or_dir).check(target_config)


_CHECK_TESTS = sorted(name for name in dir(test_hub_check) if name.startswith("test_"))


@pytest.mark.parametrize("name", _CHECK_TESTS)
def test_every_check_test_holds_for_an_opened_folder(name, tmp_path, monkeypatch):
    """The checker's own tests (every problem code, broken and malicious weights, target checks), with
    `check_drafter` replaced by `DrafterFolder.open(...).check(...)`: the folder read once answers the same."""
    monkeypatch.setattr(test_hub_check, "check_drafter", _api_check)
    getattr(test_hub_check, name)(tmp_path)


def test_publish_reads_the_source_weights_once(tmp_path, monkeypatch, capsys):
    """`publish --dry-run` checks and exports its source from one read (the staged copy is checked on its own)."""
    src, _ = canonical_dir(tmp_path)
    with weight_reads(src, monkeypatch) as seen:
        assert cli_main(["publish", str(src), "--repo-id", "me/tiny", "--dry-run", "--stage-dir",
                         str(tmp_path / "stage")]) == 0
    assert seen == ["open model.safetensors"], seen


def test_the_package_exports_the_api_lazily():
    """`import eagle3_zoo` and `from eagle3_zoo import DrafterFolder` load no torch; every export is the object."""
    import subprocess

    import eagle3_zoo

    code = ("import sys, eagle3_zoo; from eagle3_zoo import DrafterFolder; "
            "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]", out.stderr
    assert all(not isinstance(getattr(eagle3_zoo, n), type(eagle3_zoo)) for n in eagle3_zoo.__all__)
    assert eagle3_zoo.DrafterFolder is DrafterFolder
