"""`fit` builds its run in Lightning's own hooks, in Lightning's order: the data stage in the DataModule's `setup`,
identity and loggers in the callbacks' `setup`, the drafter in the module's `setup`, before `configure_model`."""

from __future__ import annotations

import lightning as L
from training_fixtures import tiny_run_files

from eagle3_zoo.recipe.sections import load_recipe
from eagle3_zoo.training import fit as fit_module
from eagle3_zoo.training.build import RecipeModule, RunDataModule


class _Probe(L.Callback):
    """Records, at the callbacks' `setup` and at the module's `configure_model`, what the run holds."""

    def __init__(self) -> None:
        self.seen: dict[str, object] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        identity = next(c for c in trainer.callbacks if isinstance(c, fit_module.RecipeIdentityCallback))
        self.seen["setup"] = (type(trainer.datamodule), trainer.datamodule.drafter_start is not None,
                              type(pl_module), pl_module.has_parts, bool(identity.identity), len(trainer.loggers))
        configure = pl_module.configure_model

        def probed() -> None:
            self.seen["configure_model"] = pl_module.has_parts
            configure()

        pl_module.configure_model = probed


def test_the_run_is_built_by_lightnings_hooks(tmp_path, monkeypatch):
    recipe = load_recipe(tiny_run_files(tmp_path, n=8, trainer={"max_steps": 1, "val_check_interval": None}))
    probe, build_trainer = _Probe(), fit_module.build_trainer

    def with_probe(*args, **kwargs):
        trainer = build_trainer(*args, **kwargs)
        trainer.callbacks.append(probe)
        return trainer

    monkeypatch.setattr(fit_module, "build_trainer", with_probe)
    assert (fit_module.fit(recipe) / "model.safetensors").is_file()
    # the Trainer's DataModule is the run's own (no proxy), prepared by its setup; the identity and the loggers are
    # given in the callbacks' setup (before this one: it comes last); the module has no drafter yet
    assert probe.seen["setup"] == (RunDataModule, True, RecipeModule, False, True, 1)
    assert probe.seen["configure_model"] is True  # built in the module's setup, before configure_model
