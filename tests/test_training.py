"""Training pieces without subprocesses: target logits, DDP loss weighting, LR/TTT schedules, metrics, the module
in a short in-process Trainer run, strategies."""

from __future__ import annotations

import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from tiny import tiny_drafter
from torch import nn

from eagle3_zoo.drafters.eagle3.metrics import StepMetrics, acceptance_length_estimate
from eagle3_zoo.drafters.eagle3.objective import (
    draft_target_logits,
    rank_step_weights,
    supervised_positions,
    target_rows,
)
from eagle3_zoo.drafters.eagle3.ttt import ttt_loss
from eagle3_zoo.modeling import Eagle3Config, Eagle3Drafter, build_draft_vocab
from eagle3_zoo.training.callbacks import TTTScheduleCallback, ttt_steps_at
from eagle3_zoo.training.module import DrafterModule, lr_lambda
from eagle3_zoo.training.strategies import build_strategy, enable_activation_checkpointing


def _batch(b=3, t=12, vocab=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(vocab, (b, t), generator=g)
    loss_mask = (torch.rand(b, t, generator=g) > 0.4).long()
    loss_mask[-1, -3:] = 0  # a right-padded row
    return input_ids, loss_mask


def test_draft_target_logits_equal_full_logits_sliced():
    torch.manual_seed(0)
    head = nn.Linear(16, 96, bias=False)
    t2d = build_draft_vocab(torch.randint(0, 9, (96,)), 40)[1]
    final_hidden = torch.randn(3, 12, 16)
    _, loss_mask = _batch()
    logits, valid = draft_target_logits(head, final_hidden, t2d, loss_mask, chunk_size=5)
    full = head(final_hidden)
    needed = torch.zeros(3, 12, dtype=torch.bool)
    needed[:, 1:-1] = loss_mask[:, 2:].bool()
    torch.testing.assert_close(logits[needed], full[needed][:, t2d])
    assert torch.equal(valid[needed], t2d[full.argmax(-1)][needed])
    assert not valid[~needed].any() and (logits[~needed] == 0).all()
    *_, mass = draft_target_logits(head, final_hidden, t2d, loss_mask, chunk_size=5, with_mass=True)
    torch.testing.assert_close(mass[needed], torch.softmax(full[needed], -1)[:, t2d].sum(-1))
    # the rows counted on the host (`with_host_counts`) pick the same rows: the same tensors, bit for bit
    assert torch.equal(target_rows(loss_mask), needed)
    again = draft_target_logits(head, final_hidden, t2d, loss_mask, chunk_size=5, num_rows=int(needed.sum()))
    assert torch.equal(again[0], logits) and torch.equal(again[1], valid)


def test_restricted_logits_give_the_same_loss_as_full_vocab():
    drafter, embed = tiny_drafter()
    input_ids, loss_mask = _batch()
    aux = torch.randn(3, 12, 3 * 24)
    head = nn.Linear(16, 96, bias=False)
    final_hidden = torch.randn(3, 12, 16)
    full = ttt_loss(drafter, embed, input_ids, aux, head(final_hidden).detach(), loss_mask, steps=3)
    logits, valid = draft_target_logits(head, final_hidden, drafter.t2d, loss_mask)
    restricted = ttt_loss(drafter, embed, input_ids, aux, logits, loss_mask, steps=3, target_valid=valid)
    torch.testing.assert_close(restricted.loss, full.loss)
    assert torch.equal(restricted.num_supervised, full.num_supervised)
    assert torch.equal(supervised_positions(loss_mask, valid, 3), full.num_supervised)
    # the module's path (draft-vocab logits + the mass of the draft vocabulary) reports the same acceptance
    *_, mass = draft_target_logits(head, final_hidden, drafter.t2d, loss_mask, with_mass=True)
    with_mass = ttt_loss(drafter, embed, input_ids, aux, logits, loss_mask, steps=3, target_valid=valid,
                         target_mass=mass, objective="tv")
    torch.testing.assert_close(with_mass.step_alpha, ttt_loss(drafter, embed, input_ids, aux,
                                                              head(final_hidden).detach(), loss_mask, steps=3,
                                                              objective="tv").step_alpha)
    assert (with_mass.step_alpha < restricted.step_alpha).all()  # the mass outside the draft vocab is never accepted


def test_rank_weights_make_averaged_gradient_equal_global_batch_gradient():
    drafter, embed = tiny_drafter()
    input_ids, loss_mask = _batch(b=4, t=10)
    aux = torch.randn(4, 10, 3 * 24)
    target = torch.randn(4, 10, 96)

    def grads(ids, mask, feats, tgt, weights):
        drafter.zero_grad()
        ttt_loss(drafter, embed, ids, feats, tgt, mask, steps=3, step_weights=weights).loss.backward()
        return [p.grad.clone() for p in drafter.parameters()]

    whole = grads(input_ids, loss_mask, aux, target, [1.0, 0.8, 0.64])
    valid = drafter.t2d[target.argmax(-1)]
    halves = [slice(0, 1), slice(1, 4)]  # unequal supervised counts per "rank"
    local = [supervised_positions(loss_mask[s], valid[s], 3) for s in halves]
    total = local[0] + local[1]
    per_rank = [grads(input_ids[s], loss_mask[s], aux[s], target[s],
                      rank_step_weights([1.0, 0.8, 0.64], n, total, 2)) for s, n in zip(halves, local)]
    for g, g0, g1 in zip(whole, *per_rank):
        torch.testing.assert_close((g0 + g1) / 2, g, atol=1e-6, rtol=1e-5)


def test_lr_schedule_warmup_then_decay():
    assert lr_lambda(0, 4, 20) == pytest.approx(0.25)
    assert lr_lambda(3, 4, 20) == pytest.approx(1.0)
    assert lr_lambda(4, 4, 20) == pytest.approx(1.0)
    assert lr_lambda(20, 4, 20, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_lambda(12, 4, 20, "linear") == pytest.approx(0.5)
    assert lr_lambda(12, 4, 20, "constant") == 1.0
    with pytest.raises(ValueError, match="cosine, linear, constant"):
        lr_lambda(0, 0, 10, "exp")


def test_ttt_ramp_schedule_and_callback():
    assert [ttt_steps_at(s, 100, 4, "ramp", 0.4) for s in (0, 9, 10, 30, 39, 40, 99)] == [1, 1, 2, 4, 4, 4, 4]
    assert ttt_steps_at(0, 100, 7, "constant") == 7
    seq = [ttt_steps_at(s, 50, 7, "ramp", 0.3) for s in range(50)]
    assert seq == sorted(seq) and seq[0] == 1 and seq[-1] == 7
    with pytest.raises(ValueError, match="constant, ramp"):
        TTTScheduleCallback(7, "linear")
    logged = {}
    module = SimpleNamespace(active_ttt_steps=None, device=torch.device("cpu"),
                             log=lambda k, v, **kw: logged.update({k: v}))
    trainer = SimpleNamespace(global_step=10, max_steps=100, estimated_stepping_batches=100)
    TTTScheduleCallback(4, "ramp", 0.4).on_train_batch_start(trainer, module, None, 0)
    assert module.active_ttt_steps == 2 and logged["train/ttt_steps"] == 2.0


def test_acceptance_length_estimate_and_step_metrics():
    assert acceptance_length_estimate([1.0, 1.0, 1.0]) == pytest.approx(4.0)
    assert acceptance_length_estimate([0.5, 0.5]) == pytest.approx(1.75)
    assert acceptance_length_estimate([]) == 1.0
    with pytest.raises(ValueError):
        acceptance_length_estimate([1.2])
    m = StepMetrics(3)
    m.update(torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.25]), torch.tensor([10, 5]))
    m.update(torch.tensor([3.0, 4.0]), torch.tensor([1.0, 1.0]), torch.tensor([30, 0]))
    out = m.compute("val")
    assert out["val/loss_0"] == pytest.approx(2.5) and out["val/acc_0"] == pytest.approx(0.875)
    assert out["val/loss_1"] == pytest.approx(2.0) and "val/loss_2" not in out
    assert out["val/tau_est"] == pytest.approx(1 + 0.875 + 0.875 * 0.25)


@pytest.fixture(scope="module")
def tiny_target():
    from transformers import LlamaForCausalLM

    from eagle3_zoo.adapters import get_adapter

    adapter = get_adapter("llama")
    torch.manual_seed(0)
    model = LlamaForCausalLM(adapter.tiny_config()).eval().requires_grad_(False)
    return model, adapter


def _module(model, adapter, **kw):
    cfg = Eagle3Config.from_target_config(model.config, draft_vocab_size=64, aux_layer_ids=(1, 2, 3))
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab(*build_draft_vocab(torch.arange(512) % 7, 64))
    return DrafterModule(drafter, adapter, model, ttt_steps=3, lr=1e-3, warmup_steps=1, **kw)


def test_module_excludes_target_from_state_dict(tiny_target):
    model, adapter = tiny_target
    module = _module(model, adapter)
    keys = list(module.state_dict())
    assert keys and all(k.startswith("objective.drafter.") for k in keys)
    assert sum(p.numel() for p in module.parameters()) == sum(p.numel() for p in module.drafter.parameters())
    assert module.target is model and not any(m is model for m in module.modules())


@pytest.mark.parametrize("loss", ["soft_ce", "lk_hybrid"])
def test_module_trains_and_logs_every_step_metric(tiny_target, tmp_path, loss):
    from lightning.pytorch.loggers import CSVLogger

    from eagle3_zoo.data.datamodule import ExampleDataset, FeatureDataModule

    model, adapter = tiny_target
    g = torch.Generator().manual_seed(1)
    examples = [{"input_ids": torch.randint(512, (int(n),), generator=g), "loss_mask": torch.ones(int(n)).long()}
                for n in torch.randint(8, 20, (10,), generator=g)]
    module = _module(model, adapter, weight_decay=0.1, loss=loss)
    assert module.objective.loss.name == loss
    dm = FeatureDataModule(ExampleDataset(examples[:8]), ExampleDataset(examples[8:]), batch_size=2)
    trainer = L.Trainer(max_steps=3, logger=CSVLogger(tmp_path), enable_checkpointing=False, enable_progress_bar=False,
                        callbacks=[TTTScheduleCallback(3, "ramp", 0.5)], val_check_interval=3,
                        check_val_every_n_epoch=None, num_sanity_val_steps=0, log_every_n_steps=1,
                        gradient_clip_val=0.5, enable_model_summary=False)
    before = [p.detach().clone() for p in module.drafter.parameters()]
    trainer.fit(module, datamodule=dm)
    assert any(not torch.equal(a, b) for a, b in zip(before, module.drafter.parameters()))
    metrics = trainer.callback_metrics
    for key in ("train/loss", "train/loss_0", "train/acc_0", "train/ttt_steps", "train/lr", "val/loss", "val/acc_0",
                "val/acc_2", "val/loss_2", "val/tau_est", "train/alpha_0", "train/alpha_2", "val/alpha_0",
                "val/alpha_2"):
        assert key in metrics, key
    for key in ("train/alpha_0", "val/alpha_0", "val/alpha_2"):  # an expected acceptance, bounded by the mass
        assert 0.0 < float(metrics[key]) < 1.0, key
    assert float(metrics["train/ttt_steps"]) == 3.0  # ramp 1 -> 3 over the first half of 3 steps
    assert math.isfinite(float(metrics["train/loss"]))
    opt = trainer.optimizers[0]
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0.0
    assert id(module.drafter.norm.weight) not in decayed and id(module.drafter.fc.weight) in decayed


def test_activation_checkpointing_keeps_names_and_gradients():
    drafter, embed = tiny_drafter()
    ref, _ = tiny_drafter()
    enable_activation_checkpointing(drafter)
    assert list(drafter.state_dict()) == list(ref.state_dict())
    input_ids, loss_mask = _batch()
    aux, target = torch.randn(3, 12, 72), torch.randn(3, 12, 96)
    for d in (drafter, ref):
        ttt_loss(d, embed, input_ids, aux, target, loss_mask, steps=3).loss.backward()
    for a, b in zip(drafter.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_build_strategy_names_and_errors():
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    assert build_strategy("auto") == "auto"
    assert isinstance(build_strategy("ddp"), DDPStrategy)
    fsdp = build_strategy("fsdp", devices=2, accelerator="cpu")
    assert isinstance(fsdp, ModelParallelStrategy) and fsdp._data_parallel_size == 2
    with pytest.raises(ValueError, match="unknown strategy 'horovod'.*auto, ddp, fsdp"):
        build_strategy("horovod")
    with pytest.raises(ValueError, match="unknown strategy 'deepspeed'"):  # not offered: never tested working
        build_strategy("deepspeed")


def test_a_module_given_its_parts_later_equals_the_module_built_with_them(tiny_target):
    """`fit`'s module is constructed with its settings alone and takes its drafter and target in its `setup` hook
    (`set_parts`): the result is the module the constructor builds from the same parts (same state, same settings),
    and it takes them once."""
    model, adapter = tiny_target
    built = _module(model, adapter)
    later = DrafterModule(None, ttt_steps=3, lr=1e-3, warmup_steps=1)
    assert not later.has_parts and not list(later.parameters())
    later.set_parts(built.drafter, adapter, model)
    assert later.has_parts and later.state_dict().keys() == built.state_dict().keys()
    for name in ("mode", "ttt_steps", "step_weights", "optim_args", "schedule_args", "shard_target"):
        assert getattr(later, name) == getattr(built, name), name
    with pytest.raises(RuntimeError, match="already has its drafter"):
        later.set_parts(built.drafter, adapter, model)
    with pytest.raises(ValueError, match="online mode needs the target model"):
        DrafterModule(None).set_parts(built.drafter, adapter, None)


@pytest.mark.parametrize("val_check_interval", [None, 3])
def test_a_trainer_told_in_setup_that_there_is_no_validation_equals_one_built_without(tmp_path, val_check_interval):
    """`fit` builds its Trainer before the data stage, then learns there is no validation split: `without_validation`
    gives it the settings Lightning makes of `build_trainer(has_val=False)`."""
    from training_fixtures import tiny_recipe, write_chat_jsonl, write_recipe

    from eagle3_zoo.recipe.sections import load_recipe
    from eagle3_zoo.training.build import without_validation
    from eagle3_zoo.training.fit import build_trainer

    (tmp_path / "target").mkdir()
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", tiny_recipe(
        tmp_path, tmp_path / "target", write_chat_jsonl(tmp_path / "d.jsonl", n=2),
        trainer={"val_check_interval": val_check_interval})))
    names = ("limit_val_batches", "val_check_interval", "check_val_every_n_epoch")
    without, told = build_trainer(recipe, has_val=False, logger=False), build_trainer(recipe, logger=False)
    assert [getattr(told, n) for n in names] != [getattr(without, n) for n in names]  # else nothing is tested
    without_validation(told)
    assert [getattr(told, n) for n in names] == [getattr(without, n) for n in names]


def test_offline_module_reads_bf16_features(tiny_target):
    model, adapter = tiny_target
    online = _module(model, adapter)
    offline = DrafterModule(online.drafter, adapter, None, embed_tokens=adapter.embed_tokens(model),
                           lm_head=adapter.lm_head(model), mode="offline", ttt_steps=3)
    assert offline.target is None
    g = torch.Generator().manual_seed(2)
    batch = {"input_ids": torch.randint(512, (2, 16), generator=g), "attention_mask": torch.ones(2, 16).long(),
             "loss_mask": torch.ones(2, 16).long()}
    with torch.no_grad():
        aux, final, _ = adapter.forward_features(model, batch["input_ids"], layer_ids=(1, 2, 3))
    ref = online.loss(batch, 3)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.05)):
        out = offline.loss({**batch, "aux_hidden": aux.to(dtype), "final_hidden": final.to(dtype)}, 3)
        # supervised positions = those whose target argmax, computed from the features as stored, is in the draft
        # vocab: bf16 rounding of final_hidden may move an argmax in or out of it, so count from the same features
        _, valid = draft_target_logits(adapter.lm_head(model), final.to(dtype), online.drafter.t2d,
                                       batch["loss_mask"])
        assert torch.equal(out.num_supervised, supervised_positions(batch["loss_mask"], valid, 3))
        # ... and rounding moves at most a few of the 2 x 14 positions a step can supervise
        assert (out.num_supervised - ref.num_supervised).abs().max() <= (0 if dtype == torch.float32 else 2)
        torch.testing.assert_close(out.loss, ref.loss, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="online mode needs the target"):
        DrafterModule(online.drafter, adapter, None, embed_tokens=adapter.embed_tokens(model),
                     lm_head=adapter.lm_head(model), mode="online")


def test_trainer_max_time_is_lightnings_wall_clock_limit_and_resumable(tmp_path):
    """`trainer.max_time` (seconds) becomes the Trainer's Timer; null = none. A resume may change it."""
    from datetime import timedelta

    from lightning.pytorch.callbacks import Timer
    from training_fixtures import tiny_recipe, write_chat_jsonl, write_recipe

    from eagle3_zoo.recipe.sections import load_recipe
    from eagle3_zoo.training.fit import build_trainer
    from eagle3_zoo.training.rundir.resume import RESUMABLE_KEYS

    (tmp_path / "target").mkdir()
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, tmp_path / "target",
                                                          write_chat_jsonl(tmp_path / "d.jsonl", n=2)))
    timed = build_trainer(load_recipe(path, ["trainer.max_time=90"]), logger=False)
    timers = [c for c in timed.callbacks if isinstance(c, Timer)]
    assert len(timers) == 1 and timers[0]._duration == timedelta(seconds=90).total_seconds()
    assert not [c for c in build_trainer(load_recipe(path), logger=False).callbacks if isinstance(c, Timer)]
    with pytest.raises(Exception, match="trainer.max_time"):
        load_recipe(path, ["trainer.max_time=0"])
    assert "trainer.max_time" in RESUMABLE_KEYS
