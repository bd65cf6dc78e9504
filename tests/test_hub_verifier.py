"""The speculators export names a verifier speculators can resolve: the Hub id of a zoo alias (never the alias), a
folder the user names, or a clear refusal; `check` flags an unresolvable verifier."""

from __future__ import annotations

import json

import pytest

from eagle3_zoo.checkpoint import check_drafter, export_drafter
from eagle3_zoo.cli import main
from tests.hub_fixtures import canonical_dir, edit_config


def _verifier(folder):
    return json.loads((folder / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]


def test_zoo_alias_is_written_as_its_hub_id(tmp_path):
    src, _ = canonical_dir(tmp_path, target_name_or_path="smollm2-135m-instruct")
    out = export_drafter(src, "speculators", tmp_path / "spec")
    assert _verifier(out) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "VERIFIER_UNRESOLVABLE" not in check_drafter(out).codes


def test_verifier_named_by_the_user(tmp_path, capsys):
    src, _ = canonical_dir(tmp_path, target_name_or_path="my-private-alias")
    target = tmp_path / "target"
    target.mkdir()
    with pytest.raises(ValueError, match="--verifier"):
        export_drafter(src, "speculators", tmp_path / "spec")
    assert main(["export", str(src), "--format", "speculators", "--out", str(tmp_path / "spec2")]) == 2
    err = capsys.readouterr().err
    assert "my-private-alias" in err and "--verifier" in err and len(err.strip().splitlines()) == 1
    assert main(["export", str(src), "--format", "speculators", "--out", str(tmp_path / "spec3"),
                 "--verifier", str(target)]) == 0
    assert _verifier(tmp_path / "spec3") == str(target)


def test_check_flags_an_unresolvable_verifier(tmp_path):
    src, _ = canonical_dir(tmp_path, target_name_or_path="tiny-org/tiny-llama")
    out = export_drafter(src, "speculators", tmp_path / "spec")
    assert "VERIFIER_UNRESOLVABLE" not in check_drafter(out).codes
    edit_config(out, lambda c: c["speculators_config"]["verifier"].update(name_or_path="/nowhere/llama"))
    problem = next(p for p in check_drafter(out).problems if p.code == "VERIFIER_UNRESOLVABLE")
    assert problem.severity == "warning" and "/nowhere/llama" in problem.message and "--verifier" in problem.fix
