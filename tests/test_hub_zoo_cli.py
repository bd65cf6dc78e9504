"""The zoo registry (data) and the export / check / zoo subcommands."""

from __future__ import annotations

import argparse
import json
import re
from importlib import resources
from pathlib import Path

import pytest

from eagle3_zoo.checkpoint import FORMATS, detect_format
from eagle3_zoo.cli import hub as hub_cli
from eagle3_zoo.cli import main as cli
from eagle3_zoo.hub import list_zoo, show_zoo
from eagle3_zoo.values.zoo_registry import STATUSES, target_hub_id
from tests.hub_fixtures import canonical_dir, edit_weights

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_zoo_lists_the_known_drafters():
    entries = {e.repo_id: e for e in list_zoo() if e.repo_id}
    for repo in ("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B",
                 "yuhuili/EAGLE3-Vicuna1.3-13B", "yuhuili/EAGLE3-DeepSeek-R1-Distill-LLaMA-8B",
                 "lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B", "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3",
                 "RedHatAI/Qwen3-8B-speculator.eagle3"):
        assert entries[repo].status == "published", repo
    assert entries["yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"].format == "official"
    assert entries["RedHatAI/Qwen3-8B-speculator.eagle3"].format == "speculators"
    ours = show_zoo("smollm2-135m-instruct-eagle3")
    assert ours.repo_id is None and ours.status == "not-yet-published" and ours.recipe == "recipes/smollm2_135m.yaml"


def test_zoo_entries_are_consistent():
    entries = list_zoo()
    assert len({e.name for e in entries}) == len(entries)
    assert len({e.repo_id for e in entries if e.repo_id}) == len([e for e in entries if e.repo_id])
    for e in entries:
        assert e.format in FORMATS and e.status in STATUSES and e.source and e.family, e
        assert (e.repo_id is None) == (e.status != "published"), e
        if e.recipe:
            assert (REPO_ROOT / e.recipe).is_file(), e.recipe
    # every entry carries its source link as a comment right above it ("the zoo is data")
    text = resources.files("eagle3_zoo").joinpath("resources", "zoo.yaml").read_text()
    pieces = re.split(r"\n  - name: ", text)
    assert len(pieces) - 1 == len(entries)
    for before, entry in zip(pieces[:-1], entries):
        lines = before.splitlines()
        comments = []
        while lines and lines[-1].lstrip().startswith("#"):  # the comment block right above the entry
            comments.append(lines.pop())
        assert any("source:" in c for c in comments), entry.name


def test_a_bad_registry_names_every_problem_by_entry():
    """zoo.yaml is read with the recipe's schema checker: every problem at once, each naming its entry and field."""
    from eagle3_zoo.values.zoo_registry import FORMATS as ZOO_FORMATS
    from eagle3_zoo.values.zoo_registry import ZooRegistryError, read_registry

    assert ZOO_FORMATS == FORMATS  # both the built-in layouts of eagle3_zoo.values.layout_names
    ok = dict(name="a", repo_id="org/a", target="org/t", family="llama", format="sglang", recipe=None,
              status="published", verified=True, source="https://example.org")
    text = json.dumps({"targets": {}, "drafters": [
        {**ok, "status": "publishd", "extra": 1}, {**ok, "name": "b", "format": "sglng"},
        {**ok, "name": "c", "verified": 1, "source": None}, {k: v for k, v in ok.items() if k != "source"}]})
    with pytest.raises(ZooRegistryError) as exc:
        read_registry(text, "zoo.yaml")
    assert [str(p) for p in exc.value.problems] == [
        "zoo.yaml: drafters[0].status = 'publishd': expected one of published, not-yet-published, recipe-only; "
        "did you mean 'published'?",
        "zoo.yaml: drafters[0].extra: unknown key; valid keys here: name, repo_id, target, family, format, recipe, "
        "status, verified, source, notes, kind",
        "zoo.yaml: drafters[1].format = 'sglng': expected one of sglang, official, speculators, dflash, "
        "speculators-dflash; did you mean 'sglang'?",
        "zoo.yaml: drafters[2].verified = 1: expected true or false",
        "zoo.yaml: drafters[2].source = None: expected a string",
        "zoo.yaml: drafters[3].source: required key missing (expected a string)"]
    with pytest.raises(ZooRegistryError, match=r"zoo.yaml: drafters\[1\].name = 'a': used by an earlier entry too"):
        read_registry(json.dumps({"drafters": [ok, ok]}), "zoo.yaml")
    assert [e["name"] for e in read_registry(json.dumps({"drafters": [ok, {**ok, "name": "b"}]}))["drafters"]] == \
        ["a", "b"]


def test_show_zoo_by_repo_and_unknown_names():
    assert show_zoo("YUHUILI/eagle3-llama3.1-instruct-8b").name == "eagle3-llama3.1-instruct-8b"
    with pytest.raises(KeyError, match="did you mean"):
        show_zoo("eagle3-llama3.1-instruct")
    assert target_hub_id("smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert target_hub_id("/local/path") is None and target_hub_id("org/model") == "org/model"


def test_add_subparsers_registers_five_commands():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    hub_cli.register(sub, argparse.ArgumentParser(add_help=False))
    assert set(sub.choices) == {"export", "check", "publish", "pull", "zoo"}
    from eagle3_zoo.checkpoint import EXPORT_FORMATS
    for command, option in (("export", "format"), ("publish", "format"), ("pull", "convert_to")):
        action = next(a for a in sub.choices[command]._actions if a.dest == option)
        assert action.choices == sorted(EXPORT_FORMATS)
    args = parser.parse_args(["pull", "org/x", "--convert-to", "speculators"])
    assert callable(args.func) and args.convert_to == "speculators"


def test_cli_zoo_export_check(tmp_path, capsys):
    assert cli(["zoo", "list"]) == 0
    listing = capsys.readouterr().out
    assert "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B" in listing and "not-yet-published" in listing
    assert cli(["zoo", "show", "qwen3-8b-speculator.eagle3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["target"] == "Qwen/Qwen3-8B"
    assert cli(["zoo", "show", "nope"]) == 2
    assert "no zoo entry named 'nope'" in capsys.readouterr().err

    src, _ = canonical_dir(tmp_path)
    assert cli(["export", str(src), "--format", "speculators", "--out", str(tmp_path / "spec")]) == 0
    assert detect_format(tmp_path / "spec") == "speculators" and "exported" in capsys.readouterr().out
    assert cli(["check", str(tmp_path / "spec"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    edit_weights(src, lambda s: s.pop("d2t"))
    assert cli(["check", str(src)]) == 1
    assert "D2T_MISSING" in capsys.readouterr().out
    assert cli(["check", str(tmp_path / "missing")]) == 1
    assert cli(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_registering_the_commands_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, eagle3_zoo.cli.hub, eagle3_zoo.hub; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
@pytest.mark.parametrize("damage, code", [
    (lambda s: s["d2t"].__setitem__(-1, 500), "D2T_OUT_OF_RANGE"),  # past the 96-token vocab
    (lambda s: s.__setitem__("t2d", s["t2d"][:90]), "VOCAB_MAP_SHAPE"),  # a short t2d
    (lambda s: s.__setitem__("fc.weight", s["fc.weight"][:, :48].contiguous()), "SHAPE_MISMATCH"),  # other width
])
def test_export_refuses_an_invalid_drafter(tmp_path, capsys, fmt, damage, code):
    src, _ = canonical_dir(tmp_path)
    edit_weights(src, damage)
    out = tmp_path / "out"
    assert cli(["export", str(src), "--format", fmt, "--out", str(out)]) == 2  # a canonical one was copied as is
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {src}: refusing to export an invalid drafter: ") and f"{code}: " in err
    assert len(err.splitlines()) == 1 and not (out / "model.safetensors").exists()


def test_zoo_list_filters_by_family_and_target(capsys):
    qwen3 = list_zoo(family="QWEN3")
    assert {e.repo_id for e in qwen3} >= {"RedHatAI/Qwen3-8B-speculator.eagle3", "AngelSlim/Qwen3-8B_eagle3",
                                          "Tengyunw/qwen3_8b_eagle3", "AngelSlim/Qwen3-1.7B_eagle3"}
    # a family lists its variants too: the Qwen3 MoE drafters are Qwen3 drafters
    assert {e.family for e in qwen3} == {"qwen3", "qwen3_moe"} and "Tengyunw/qwen3_30b_moe_eagle3" in {
        e.repo_id for e in qwen3}
    assert {e.family for e in list_zoo(family="qwen3_moe")} == {"qwen3_moe"}
    assert {e.target for e in list_zoo(target="qwen/qwen3-8b")} == {"Qwen/Qwen3-8B"}
    # a local target name and its Hub id select the same entries
    assert list_zoo(target="smollm2-135m-instruct") == list_zoo(target="HuggingFaceTB/SmolLM2-135M-Instruct") != []
    both = list_zoo(family="qwen3", target="Qwen/Qwen3-8B")  # (no MoE drafter for this target)
    assert {e.repo_id for e in both} == {"RedHatAI/Qwen3-8B-speculator.eagle3", "AngelSlim/Qwen3-8B_eagle3",
                                         "Tengyunw/qwen3_8b_eagle3", None,  # None: our recipe-only entry
                                         "z-lab/Qwen3-8B-DFlash-b16"}  # a DFlash drafter (kind dflash)
    assert cli(["zoo", "list", "--family", "gpt_oss"]) == 0
    out = capsys.readouterr().out
    assert "RedHatAI/gpt-oss-20b-speculator.eagle3" in out and "Qwen3" not in out
    assert cli(["zoo", "list", "--family", "qwen"]) == 2
    err = capsys.readouterr().err
    assert "no zoo entry has family 'qwen'; did you mean" in err and "qwen3" in err


def test_zoo_list_has_a_kind_column(capsys):
    """`zoo list` names each entry's drafter kind (eagle3 / dflash), in the column headed `kind`."""
    assert cli(["zoo", "list", "--target", "Qwen/Qwen3-8B"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    names = header.split()
    assert names == ["name", "repo", "target", "family", "kind", "format", "status", "recipe"]
    at = header.index("kind")
    kinds = {row.split()[0]: row[at:].split()[0] for row in rows}
    entries = {e.name: e.kind for e in list_zoo(target="Qwen/Qwen3-8B")}
    assert kinds == entries and set(kinds.values()) == {"eagle3", "dflash"}
    assert kinds["dflash-qwen3-8b-b16"] == "dflash"
