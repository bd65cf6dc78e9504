"""The layout registry is the one place a layout lives: every registered layout round-trips a drafter bit for bit
through write -> detect -> read and is offered by the CLI, and a layout registered here (one object, in this file) is
detected, read, checked, written by `export`, offered by `--format` and described on its model card."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_zoo.checkpoint import check_drafter, export_drafter, import_drafter
from eagle3_zoo.checkpoint.layouts import Layout, detect_format, layouts, register, unregister
from eagle3_zoo.cli import hub as hub_cli
from eagle3_zoo.modeling import Eagle3Config
from eagle3_zoo.values import layout_names
from tests.hub_fixtures import canonical_dir, official_dir


def _choices() -> dict[str, list[str]]:
    """The choices of `export --format`, `publish --format` and `pull --convert-to` of a freshly built parser."""
    sub = argparse.ArgumentParser().add_subparsers()
    hub_cli.register(sub, argparse.ArgumentParser(add_help=False))
    return {f"{command} --{option}": next(a for a in sub.choices[command]._actions if a.dest == option).choices
            for command, option in (("export", "format"), ("publish", "format"), ("pull", "convert_to"))}


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k  # bit for bit


class ToyLayout(Layout):
    """A layout that exists only in this test: a `toy_layout` marker in config.json, every key under `toy.`."""

    info = layout_names.LayoutInfo("toy", aliases=("toy-alias",), writable=True, description="toy layout (a test)",
                                   engines=("toy-engine",), card_tags=("toy-tag",))
    key_prefixes = {"": "toy."}

    def claims(self, raw: dict[str, Any], source: str) -> bool:
        return raw.get("toy_layout") == 1

    def read_config(self, raw: dict[str, Any], source: str) -> Eagle3Config:
        return Eagle3Config.from_json_dict({k: v for k, v in raw.items() if k != "toy_layout"}, source=source)

    def write(self, drafter, out: Path, **options: Any) -> None:
        tensors = {self.stored_name(k): v.detach().contiguous() for k, v in drafter.state_dict().items()}
        save_file(tensors, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps({**drafter.config.to_json_dict(), "toy_layout": 1}))


@pytest.fixture
def toy():
    layout = register(ToyLayout())
    yield layout
    unregister("toy")


def test_every_registered_layout_round_trips_a_drafter_and_is_offered_by_the_cli(tmp_path):
    src, drafter = canonical_dir(tmp_path, name="src")
    want = drafter.state_dict()
    choices = _choices()
    assert [layout.name for layout in layouts()] == list(layout_names.layout_names()) == \
        [*layout_names.BUILT_IN, *layout_names.DFLASH_BUILT_IN, *layout_names.DSPARK_BUILT_IN]
    for layout in layouts():
        if layout.kind != "eagle3":  # DFlash / DSpark layouts: tests/test_dflash_layouts.py, test_dspark_layout.py
            continue
        names = (layout.name, *layout.info.aliases)
        if layout.info.writable:
            for name in names:
                folder = export_drafter(src, name, tmp_path / name, verifier="tiny-org/tiny-llama")
                assert detect_format(folder) == layout.name, name
                _same_state(import_drafter(folder).state_dict(), want)
                assert check_drafter(folder).ok, name
                assert all(name in c for c in choices.values()), (name, choices)
        else:  # read only (the official releases): written by hand, then detected and read
            assert not any(name in c for c in choices.values() for name in names)
            folder = official_dir(tmp_path, drafter, name=layout.name)
            assert detect_format(folder) == layout.name
            _same_state(import_drafter(folder).state_dict(), want)
            with pytest.raises(ValueError, match=f"unknown export format '{layout.name}'; valid: "):
                export_drafter(src, layout.name, tmp_path / f"{layout.name}-out")
    assert sorted(n for c in choices.values() for n in c) == sorted(3 * layout_names.export_choices())


def test_a_layout_registered_in_a_test_is_detected_read_written_offered_and_carded(tmp_path, toy):
    from eagle3_zoo.hub.card import render_card

    src, drafter = canonical_dir(tmp_path, name="src")
    out = export_drafter(src, "toy-alias", tmp_path / "toy")
    assert set(load_file(str(out / "model.safetensors"))) == {f"toy.{k}" for k in drafter.state_dict()}
    assert json.loads((out / "config.json").read_text())["toy_layout"] == 1
    assert detect_format(out) == "toy"
    _same_state(import_drafter(out).state_dict(), drafter.state_dict())
    report = check_drafter(out)
    assert report.format == "toy" and report.ok and not report.problems, report
    back = export_drafter(out, "sglang", tmp_path / "back")  # and out again, to the canonical layout
    assert (back / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert all({"toy", "toy-alias"} <= set(c) for c in _choices().values())
    card = render_card(out, repo_id="org/toy")
    assert "toy layout (a test)" in str(card)
    assert {"toy-engine", "toy-tag"} <= set(card.data.tags)


def test_a_layout_is_registered_once_and_the_built_in_ones_stay(toy):
    with pytest.raises(ValueError, match="'toy' already names a layout"):
        layout_names.register_info(layout_names.LayoutInfo("toy"))
    with pytest.raises(ValueError, match="'canonical' already names a layout"):
        layout_names.register_info(layout_names.LayoutInfo("other", aliases=("canonical",)))
    with pytest.raises(ValueError, match="built-in"):
        unregister("speculators")


def test_the_cli_choices_need_no_torch():
    """`--format` / `--convert-to` choices come from `eagle3_zoo.values.layout_names`, which imports nothing of the
    package and no torch (the CLI answers bad input without torch: tests/test_cli_fast.py)."""
    import ast
    import subprocess
    import sys

    tree = ast.parse(Path(layout_names.__file__).read_text(encoding="utf-8"))
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] + \
        [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert imported == ["__future__", "dataclasses"]
    code = ("import sys; from eagle3_zoo.cli import hub; from eagle3_zoo.values import zoo_registry; "
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parents[1]).stdout.strip() == "False"


def test_a_layouts_weights_load_only_with_exactly_the_models_keys_and_shapes():
    """Both kinds' readers (`convert.load_drafter_from_state` and the DFlash layouts) refuse a state dict that is not
    exactly the model's, naming each missing, unexpected and misshapen tensor and the folder's layout."""
    import torch

    from eagle3_zoo.checkpoint.layout_base import load_exact_state

    model = torch.nn.Linear(2, 3)
    with pytest.raises(ValueError) as e:
        load_exact_state(model, {"weight": torch.zeros(3, 3), "extra": torch.zeros(1)}, "DIR", "sglang format")
    msg = str(e.value)
    assert "DIR (sglang format)" in msg and "missing keys ['bias']" in msg and "unexpected keys ['extra']" in msg
    assert "weight: (3, 3) (expected (3, 2))" in msg and "eagle3-zoo check DIR" in msg
    state = {"weight": torch.ones(3, 2), "bias": torch.ones(3)}
    assert load_exact_state(model, state, "DIR", "x") is model and torch.equal(model.weight, state["weight"])
