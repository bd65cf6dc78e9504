"""The loss registry: a loss is one class with its own parameters dataclass, registered by name; a recipe selects it
with `loss.name` and `loss.params`, and nothing else needs an edit. A throwaway loss registered here is validated
by the recipe, trained by `fit`, and checked against its naive form the way a new loss's test would."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from training_fixtures import tiny_run_files

import eagle3_zoo.losses as losses
from eagle3_zoo.losses import Loss, available_losses, get_loss, make_loss, register_loss
from eagle3_zoo.losses import base as losses_base
from eagle3_zoo.losses.chunk import chunk_objective, reference_objective
from eagle3_zoo.recipe.sections import RecipeError, load_recipe
from eagle3_zoo.util.schema import UNIT, ruled

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class HalfCEParams:
    scale: float = ruled(1.0, UNIT)  # the cross-entropy's weight (at most 1: the gradient stays within [-2, 2])


class ScaledCE(Loss):
    """scale * soft cross-entropy: a loss this repository does not ship. It records each chunk it is asked for."""

    Params = HalfCEParams
    seen: list[float] = []

    def chunk(self, c):
        ScaledCE.seen.append(self.params.scale)
        return c.result(self.params.scale * c.ce, c.acceptance() if c.report else None,
                        c.q.sub_(c.p).mul_(self.params.scale))

    def reference(self, r):
        return self.params.scale * r.ce


@pytest.fixture
def toy_loss(monkeypatch):
    """`ScaledCE` registered as `scaled_ce` for one test (in a copy of the registry: the other tests see the shipped
    losses only)."""
    monkeypatch.setattr(losses_base, "_REGISTRY", dict(losses_base._REGISTRY))
    monkeypatch.setattr(ScaledCE, "seen", [])
    return register_loss("scaled_ce")(ScaledCE)


def test_the_shipped_losses_are_the_modules_of_the_package():
    modules = sorted(p.stem for p in Path(losses.__file__).parent.glob("*.py") if not p.stem.startswith("_"))
    assert available_losses() == sorted(set(modules) - {"base", "chunk"}) == \
        ["lk_hybrid", "neg_log_alpha", "soft_ce", "tv"]
    for name in available_losses():
        cls = get_loss(name)
        assert cls.name == name and cls.__module__ == f"eagle3_zoo.losses.{name}"
        assert dataclasses.is_dataclass(cls.Params)


def test_a_new_loss_is_selected_by_its_recipe_and_trained_by_fit(toy_loss, tmp_path):
    from eagle3_zoo.training.fit import fit_main

    recipe = tiny_run_files(tmp_path, n=12, trainer={"max_steps": 2, "checkpoint_every_n_steps": None})
    with pytest.raises(RecipeError, match=r"loss.params.scale = 2.0: must be in \[0, 1\]"):
        load_recipe(recipe, ["loss.name=scaled_ce", "loss.params.scale=2.0"])
    loaded = load_recipe(recipe, ["loss.name=scaled_ce"])
    assert loaded.loss.params == {"scale": 1.0}  # defaults filled in: the run records every parameter
    drafter = fit_main(recipe, ["loss.name=scaled_ce", "loss.params.scale=0.25"])
    assert ScaledCE.seen and set(ScaledCE.seen) == {0.25}  # its chunk ran, with the recipe's parameter
    saved = yaml.safe_load((drafter / "recipe.yaml").read_text())
    assert saved["loss"] == {"name": "scaled_ce", "params": {"scale": 0.25}, "lk_eta": None}


def test_a_new_loss_is_checked_like_a_shipped_one(toy_loss):
    """What a new loss's own test holds: its hand-formed gradient equals autograd's on its naive form."""
    g = torch.Generator().manual_seed(0)
    logits, p = torch.randn(9, 13, generator=g) * 3, torch.softmax(torch.randn(9, 13, generator=g), -1)
    loss = make_loss("scaled_ce", {"scale": 0.5})
    z = logits.clone().requires_grad_()
    ref, _ = reference_objective(z, p, loss)
    (ref_grad,) = torch.autograd.grad(ref.sum(), z)
    out = chunk_objective(logits.clone(), p, loss)
    torch.testing.assert_close(out.loss, ref.detach())
    torch.testing.assert_close(out.grad, ref_grad)
    torch.testing.assert_close(out.loss, 0.5 * chunk_objective(logits.clone(), p, "soft_ce").loss)


def test_registration_refuses_a_taken_name_and_a_params_class_that_is_not_a_dataclass(toy_loss):
    class Other(ScaledCE):
        pass

    with pytest.raises(ValueError, match="loss 'soft_ce' is already registered by eagle3_zoo.losses.soft_ce"):
        register_loss("soft_ce")(Other)

    class Loose(ScaledCE):
        Params = dict

    with pytest.raises(ValueError, match="Loose.Params must be a dataclass"):
        register_loss("loose")(Loose)


def test_make_loss_names_the_bad_parameter_and_the_valid_losses():
    assert make_loss("lk_hybrid", {"eta": 2}).params.eta == 2.0
    with pytest.raises(ValueError, match="loss.params.eta = 0.0: must be > 0"):
        make_loss("lk_hybrid", {"eta": 0.0})
    with pytest.raises(ValueError, match="loss.params.eta: unknown key; loss 'tv' has no parameters"):
        make_loss("tv", {"eta": 1.0})
    with pytest.raises(ValueError, match="unknown TTT loss 'lk-hybrid'; valid: lk_hybrid, neg_log_alpha, soft_ce, tv; "
                                         "did you mean 'lk_hybrid'[?]; to add a loss see "
                                         "docs/contributing/adding-a-loss.md"):
        make_loss("lk-hybrid")


def test_the_registry_imports_no_torch():
    code = ("import sys, eagle3_zoo.losses as l; l.make_loss('lk_hybrid', {'eta': 1.0}); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_the_concepts_page_describes_every_loss():
    text = (ROOT / "docs" / "concepts.md").read_text()
    assert all(f"`{name}`" in text for name in available_losses())
