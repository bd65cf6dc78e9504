"""Sequence packing (`data.packing`): packs, the document-aware TTT attention of every backend, and the loss and
gradients of a packed batch equal to those of the same conversations unpacked (online and offline features)."""

from __future__ import annotations

import math

import pytest
import torch
from training_fixtures import REPO, tiny_llama_target

import eagle3_zoo.modeling.attention as attention
from eagle3_zoo.data.datamodule import FeatureDataModule, collate_right_padded
from eagle3_zoo.data.packing import PackedDataset, concat_documents, pack_lengths, padding_fraction
from eagle3_zoo.modeling import Eagle3Config, Eagle3Drafter, build_draft_vocab
from eagle3_zoo.modeling.attention import (
    _FLEX_BLOCK,
    _document_block_mask,
    ttt_attention,
    ttt_attention_reference,
)
from eagle3_zoo.training.module import DrafterModule


def test_pack_lengths_fills_rows_best_fit_and_keeps_every_example():
    lengths = [7, 3, 9, 2, 5, 5, 1, 12]
    packs = pack_lengths(lengths, 12)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in p) <= 12 for p in packs)
    assert len(packs) == math.ceil(sum(lengths) / 12)  # 49 tokens: 5 rows is the least possible, and found
    assert pack_lengths(lengths, 12) == packs  # depends on the lengths only
    assert pack_lengths([20, 3], 12) == [[0], [1]]  # longer than a row: a row of its own, never dropped
    assert padding_fraction([4, 2, 4], [[0, 1], [2]]) == pytest.approx(2 / 12)


def test_collate_of_packed_rows_gives_positions_and_documents():
    a = {"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.tensor([0, 1, 1])}
    b = {"input_ids": torch.tensor([8, 9]), "loss_mask": torch.tensor([1, 1])}
    c = {"input_ids": torch.tensor([4]), "loss_mask": torch.tensor([1])}
    batch = collate_right_padded([concat_documents([a, b]), concat_documents([c])])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [4, 0, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 0, 0, 0, 0]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1]]  # pads: one more document
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


DOCS = [[0] * 100 + [1] * 150 + [2] * 50, [0] * 20 + [1] * 5 + [2] * 260 + [3] * 15]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", ["cpu-flash", "explicit", "flex"])
@pytest.mark.parametrize("n_steps", [1, 3])
def test_ttt_attention_stays_inside_documents(backend, n_steps, monkeypatch):
    """Every backend equals the reference with documents, and the reference equals each document run alone."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *args: None)  # eager dense backward on CPU (flex)
    g = torch.Generator().manual_seed(0)
    doc = torch.tensor(DOCS)
    b, h, hk, t, d = 2, 4, 2, doc.shape[1], 8
    q = torch.randn(b, h, t, d, generator=g).requires_grad_()
    ks = [torch.randn(b, hk, t, d, generator=g).requires_grad_() for _ in range(n_steps)]
    vs = [torch.randn(b, hk, t, d, generator=g).requires_grad_() for _ in range(n_steps)]
    ref = ttt_attention_reference(q, ks, vs, doc)
    for row in range(b):
        for j in doc[row].unique():
            span = (doc[row] == j).nonzero().squeeze(1)
            s = slice(int(span[0]), int(span[-1]) + 1)
            alone = ttt_attention_reference(q[row : row + 1, :, s], [k[row : row + 1, :, s] for k in ks],
                                            [v[row : row + 1, :, s] for v in vs])
            torch.testing.assert_close(ref[row : row + 1, :, s], alone)
    d_out = torch.randn(ref.shape, generator=g)
    leaves = [q, *ks, *vs]
    out = ttt_attention(q, ks, vs, backend=backend, document_ids=doc)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    for got, want in zip(torch.autograd.grad((out * d_out).sum(), leaves),
                         torch.autograd.grad((ref * d_out).sum(), leaves)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("n_diag", [0, 2])
def test_document_block_mask_gives_exactly_the_packed_ttt_pattern(n_diag):
    """The block-sparse semantics the CUDA kernel executes (full blocks: all visible, partial: the mask function,
    unlisted: skipped) equal the TTT pattern within documents; the eager CPU path would not notice wrong blocks."""
    doc = torch.tensor([[0] * 100 + [1] * 300 + [2] * 100, [0] * 500, [0] * 128 + [1] * 128 + [2] * 200 + [3] * 44])
    b, t = doc.shape
    seg = math.ceil(t / _FLEX_BLOCK) * _FLEX_BLOCK
    bm = _document_block_mask(doc, seg, n_diag)
    n_q, n_kv = seg // _FLEX_BLOCK, (n_diag + 1) * seg // _FLEX_BLOCK
    q_idx, kv_idx = torch.arange(seg)[:, None], torch.arange((n_diag + 1) * seg)[None, :]
    step, pos = kv_idx // seg, kv_idx % seg
    padded = torch.cat([doc, doc[:, -1:].expand(b, seg - t)], 1)
    for row in range(b):
        def dense(num, idx, row=row):
            out = torch.zeros(n_q, n_kv, dtype=torch.bool)
            for i in range(n_q):
                out[i, idx[row, 0, i, : int(num[row, 0, i])].long()] = True
            return out.repeat_interleave(_FLEX_BLOCK, 0).repeat_interleave(_FLEX_BLOCK, 1)

        full, partial = dense(bm.full_kv_num_blocks, bm.full_kv_indices), dense(bm.kv_num_blocks, bm.kv_indices)
        assert not (full & partial).any()
        kernel = full | (partial & bm.mask_mod(torch.tensor(row), 0, q_idx, kv_idx))
        same = padded[row][q_idx] == padded[row][pos]
        truth = (((step == 0) & (pos <= q_idx)) | ((step > 0) & (pos == q_idx))) & same
        assert torch.equal(kernel[:t], truth[:t]), row  # every real query; padded queries are cut off
    assert int(bm.full_kv_num_blocks[1].sum()) == n_q * (n_q - 1) // 2  # one document: all lower blocks stay full


# ------------------------------------------------------------------------------ the loss: packed == unpacked
@pytest.fixture(scope="module")
def tiny():
    model, _, adapter = tiny_llama_target()
    g = torch.Generator().manual_seed(3)
    examples = []
    for n in (9, 14, 6, 11, 5, 13):
        mask = (torch.rand(n, generator=g) > 0.25).long()
        # supervised from x_1 (even examples), or from x_2; the fifth even from x_0 (which no position predicts)
        mask[0], mask[1] = int(len(examples) == 4), int(len(examples) % 2 == 0)
        examples.append({"input_ids": torch.randint(model.config.vocab_size, (n,), generator=g), "loss_mask": mask})
    with torch.no_grad():  # offline features: each conversation through the target alone, as the feature job runs
        for ex in examples:
            aux, final, _ = adapter.forward_features(model, ex["input_ids"][None], layer_ids=(1, 2, 3))
            ex["aux_hidden"], ex["final_hidden"] = aux[0], final[0]
        # the draft vocabulary: the target's own predictions first, so that most positions are supervised
        argmax = torch.cat([adapter.lm_head(model)(ex["final_hidden"]).argmax(-1) for ex in examples])
        counts = torch.bincount(argmax, minlength=model.config.vocab_size) * 10 + torch.arange(512) % 7
    return model, adapter, examples, counts


class _Examples(torch.utils.data.Dataset):
    def __init__(self, examples, keys):
        self.examples, self.keys = examples, keys

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return {k: self.examples[i][k] for k in self.keys}

    @property
    def lengths(self):
        return [len(ex["input_ids"]) for ex in self.examples]


def _module(model, adapter, mode, counts):
    cfg = Eagle3Config.from_target_config(model.config, draft_vocab_size=64, aux_layer_ids=(1, 2, 3))
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    drafter.reset_parameters(std=0.2)  # attention patterns matter
    drafter.set_vocab(*build_draft_vocab(counts, 64))
    target = model if mode == "online" else None
    return DrafterModule(drafter, adapter, target, embed_tokens=adapter.embed_tokens(model),
                        lm_head=adapter.lm_head(model), mode=mode, ttt_steps=3)


def _loss_and_grads(module, batch, steps):
    module.zero_grad()
    out = module.loss(batch, steps)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in module.drafter.named_parameters() if p.grad is not None}


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("backend,mode", [("cpu-flash", "online"), ("cpu-flash", "offline"), ("explicit", "online"),
                                          ("explicit", "offline"), ("flex", "online")])
def test_packed_loss_and_gradients_equal_unpacked(tiny, mode, steps, backend, monkeypatch):
    """Six conversations in 3 packed rows of <= 24 tokens against 6 right-padded rows: every step's loss, accuracy
    and supervised count and every drafter gradient agree (online: the target sees the positions restart). Each TTT
    backend (CPU: cpu-flash; CUDA: the flex formulation, here in its eager form; explicit elsewhere)."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(attention, "ttt_backend", lambda device_type: backend)
    monkeypatch.setattr(flex, "_validate_device", lambda *args: None)
    model, adapter, examples, counts = tiny
    keys = ["input_ids", "loss_mask"] + (["aux_hidden", "final_hidden"] if mode == "offline" else [])
    dataset = _Examples(examples, keys)
    packed_set = PackedDataset(dataset, 24)
    assert len(packed_set) == 3 and all(len(p) == 2 for p in packed_set.packs)
    packed = collate_right_padded([packed_set[i] for i in range(len(packed_set))])
    unpacked = collate_right_padded([dataset[i] for i in range(len(dataset))])
    module = _module(model, adapter, mode, counts)
    want, want_grads = _loss_and_grads(module, unpacked, steps)
    got, got_grads = _loss_and_grads(module, packed, steps)
    assert torch.equal(got.num_supervised, want.num_supervised) and int(want.num_supervised[-1]) > 20
    torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.step_losses, want.step_losses, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.step_acc, want.step_acc)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    # the same rows without their documents (one long sequence each): a different loss, so the test can tell
    crossed, _ = _loss_and_grads(module, {k: v for k, v in packed.items() if k != "document_ids"}, steps)
    assert not torch.allclose(crossed.loss, want.loss, atol=1e-4)


def test_datamodule_packs_rows_up_to_the_capacity(tiny):
    examples = tiny[2]
    dm = FeatureDataModule(_Examples(examples, ["input_ids", "loss_mask"]), None, batch_size=2, pack_length=24)
    batches = list(dm.train_dataloader())
    assert len(batches) == 1  # 3 rows, batch 2, the incomplete last batch dropped as unpacked
    assert batches[0]["document_ids"].shape[1] <= 24 and batches[0]["position_ids"].shape == (2, 24)
    with pytest.raises(ValueError, match=r"3 training rows \(6 examples packed\) cannot fill one batch of 4"):
        FeatureDataModule(_Examples(examples, ["input_ids"]), None, batch_size=4, pack_length=24).train_dataloader()


# ------------------------------------------------------------------------------ recipe key and run identity
RECIPES_DIR = REPO / "recipes"


def test_recipe_key_is_typed_and_refused_with_streamed_states():
    from eagle3_zoo.recipe.sections import RecipeError, load_recipe

    assert load_recipe(RECIPES_DIR / "smollm2_135m.yaml").data.packing is False
    assert load_recipe(RECIPES_DIR / "smollm2_135m.yaml", ["data.packing=true"]).data.packing is True
    with pytest.raises(RecipeError, match=r"data.packing = 'maybe': expected true or false"):
        load_recipe(RECIPES_DIR / "smollm2_135m.yaml", ["data.packing=maybe"])
    with pytest.raises(RecipeError, match=r"data.packing = True: cannot be combined with hidden states streamed from "
                                          r"the engine .* pack stored features \(data.mode = offline\)"):
        load_recipe(RECIPES_DIR / "llama3_70b.yaml", ["data.packing=true"])


def test_resume_with_another_packing_is_refused_like_other_data_settings():
    from eagle3_zoo.training.rundir.resume import identity_differences, run_identity

    ident = dict(data_fingerprint="f", d2t=torch.arange(3), target={"model_type": "llama"}, world_size=1)
    unpacked = run_identity({"data": {"packing": False, "max_length": 64}}, **ident)
    packed = run_identity({"data": {"packing": True, "max_length": 64}}, **ident)
    assert identity_differences(unpacked, packed) == ["data.packing: False -> True"]
    before = {k: v for k, v in unpacked.items() if k != "data.packing"}  # a checkpoint written before the key existed
    assert identity_differences(before, unpacked) == []
    assert identity_differences(before, packed) == ["data.packing: False -> True"]
