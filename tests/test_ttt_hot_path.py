"""The per-step acceptance alpha is a metric only: a TTT step without it has the same loss and gradients bit for bit,
and `fit` forms it on the steps whose metrics a logger records."""

from __future__ import annotations

import lightning as L
import torch

from eagle3_zoo.data.datamodule import ExampleDataset, FeatureDataModule
from eagle3_zoo.drafters.eagle3.ttt import ttt_loss
from eagle3_zoo.losses.chunk import ALPHA_BLOCK, reference_objective
from tests.test_training import _module, tiny_target  # noqa: F401 (the fixture)
from tests.tiny import tiny_drafter


def test_a_step_without_alpha_has_the_same_loss_and_gradients_bit_for_bit():
    drafter, embed = tiny_drafter()
    cfg = drafter.config
    g = torch.Generator().manual_seed(3)
    t = 2 * ALPHA_BLOCK + 40  # rows of one fused chunk span several alpha blocks
    ids = torch.randint(0, cfg.vocab_size, (1, t), generator=g)
    aux = torch.randn(1, t, 3 * cfg.target_hidden_size, generator=g)
    target_logits = torch.randn(1, t, cfg.vocab_size, generator=g) * 3
    mask = torch.ones(1, t, dtype=torch.long)
    outs, grads = {}, {}
    for with_alpha in (True, False):
        drafter.zero_grad(set_to_none=True)
        outs[with_alpha] = ttt_loss(drafter, embed, ids, aux, target_logits, mask, steps=3, with_alpha=with_alpha)
        outs[with_alpha].loss.backward()
        grads[with_alpha] = [p.grad.clone() for p in drafter.parameters() if p.requires_grad]
    full, lean = outs[True], outs[False]
    assert lean.step_alpha is None and full.step_alpha is not None
    for a, b in ((full.loss, lean.loss), (full.step_losses, lean.step_losses), (full.step_acc, lean.step_acc)):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
    # the alpha formed in blocks of rows is the naive one (step 0's rows: t = 0 .. T-3 against the target at t + 1)
    with torch.no_grad():
        h = next(iter(drafter.ttt_rollout(embed(torch.cat([ids[:, 1:], ids.new_zeros(1, 3)], 1)), aux, 3)))
        t2d = drafter.t2d
        full_p = torch.softmax(target_logits[0, 1 : t - 1], -1)
        p = torch.softmax(target_logits[0, 1 : t - 1][:, t2d], -1)
        keep = t2d[target_logits[0, 1 : t - 1].argmax(-1)]
        _, ref = reference_objective(drafter.logits(h)[0, : t - 2], p, mass=full_p[:, t2d].sum(-1))
    torch.testing.assert_close(full.step_alpha[0], ref[keep].mean(), atol=1e-6, rtol=1e-5)


def test_fit_forms_alpha_on_logging_steps_only(tiny_target, tmp_path):  # noqa: F811
    from lightning.pytorch.loggers import CSVLogger

    model, adapter = tiny_target
    g = torch.Generator().manual_seed(1)
    examples = [{"input_ids": torch.randint(512, (12,), generator=g), "loss_mask": torch.ones(12).long()}
                for _ in range(8)]
    module = _module(model, adapter)
    asked = []
    loss = module.loss

    def recording_loss(batch, steps, global_norm=False, read_along=False, with_alpha=True):
        asked.append(with_alpha)
        return loss(batch, steps, global_norm, read_along=read_along, with_alpha=with_alpha)

    module.loss = recording_loss
    trainer = L.Trainer(max_steps=4, logger=CSVLogger(tmp_path), log_every_n_steps=2, enable_checkpointing=False,
                        enable_progress_bar=False, limit_val_batches=0, enable_model_summary=False)
    trainer.fit(module, datamodule=FeatureDataModule(ExampleDataset(examples), ExampleDataset(examples[:2]),
                                                    batch_size=2))
    assert asked == [False, True, False, True]  # Lightning records the 2nd and 4th batch's metrics
    rows = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    logged = [dict(zip(header, r.split(","))) for r in rows[1:]]
    trained = [r for r in logged if r.get("train/loss_0")]
    assert len(trained) == 2 and all(r["train/alpha_0"] for r in trained)
