"""The drafter-kind registry: names without torch, the unknown-kind message, the recipe's `drafter.kind`, EAGLE-3 as
the first kind, and a resume identity saved before `drafter.kind` existed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from eagle3_zoo.drafters import DrafterKind, get_kind, kind_names, kind_of, register_kind, unregister_kind


def test_kind_names_import_no_torch():
    code = ("import sys; from eagle3_zoo.drafters import kind_names; names = kind_names(); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(names)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "eagle3" in out


def test_unknown_kind_names_the_valid_ones_and_the_guide():
    with pytest.raises(ValueError, match=r"unknown drafter kind 'nope'; valid: eagle3.*adding-a-drafter-kind\.md"):
        get_kind("nope")


def test_eagle3_is_the_kind_of_an_eagle3_drafter():
    from tests.tiny import tiny_drafter

    kind = get_kind("eagle3")
    assert kind_of(tiny_drafter()[0]) is kind and kind.layouts and "sglang" in kind.layouts


def test_a_registered_kind_is_a_valid_recipe_kind():
    class Toy(DrafterKind):
        name = "toy_kind"

    register_kind(Toy())
    try:
        assert "toy_kind" in kind_names()
        with pytest.raises(ValueError, match="registered already"):
            register_kind(Toy())
    finally:
        unregister_kind("toy_kind")
    assert "toy_kind" not in kind_names()


def test_recipe_refuses_an_unknown_kind(tmp_path):
    from eagle3_zoo.recipe.sections import RecipeError, load_recipe
    from tests.training_fixtures import tiny_recipe, write_recipe

    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, tmp_path / "t", tmp_path / "d.jsonl",
                                                          drafter={"kind": "dflashh"}))
    with pytest.raises(RecipeError, match="unknown drafter kind 'dflashh'"):
        load_recipe(path)


def test_an_identity_saved_before_drafter_kind_resumes():
    from eagle3_zoo.training.rundir.resume import identity_differences

    old = {"drafter.fc_norm": "False"}
    assert identity_differences(old, {**old, "drafter.kind": repr("eagle3")}) == []
    assert identity_differences(old, {**old, "drafter.kind": repr("toy")})


# ---------------------------------------------------------------------------------------------- a toy kind, end to end
class _ToyConfig:
    """A toy drafter's config: it reads one target hidden state per position and proposes the token two ahead."""

    def __init__(self, hidden_size: int, vocab_size: int, aux_layer_ids: tuple[int, ...]):
        self.hidden_size, self.vocab_size, self.aux_layer_ids = hidden_size, vocab_size, tuple(aux_layer_ids)
        self.draft_vocab_size = vocab_size

    def to_json_dict(self) -> dict:
        return {"hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "aux_layer_ids": list(self.aux_layer_ids)}


def _toy_kind():
    import json
    from pathlib import Path

    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file
    from torch import nn

    from eagle3_zoo.drafters import FeatureNeeds

    class ToyDrafter(nn.Module):
        def __init__(self, config: _ToyConfig):
            super().__init__()
            self.config = config
            self.proj = nn.Linear(len(config.aux_layer_ids) * config.hidden_size, config.vocab_size)

    class ToyObjective(nn.Module):
        def __init__(self, drafter: ToyDrafter):
            super().__init__()
            self.drafter = drafter

        def forward(self, aux_hidden, input_ids, loss_mask):  # position t predicts x_{t+2}
            logits = self.drafter.proj(aux_hidden[:, :-2])
            mask = loss_mask[:, 2:].bool()
            return F.cross_entropy(logits[mask], input_ids[:, 2:][mask])

    class ToyProposer:  # `dflash_decode.BlockProposer`: one token after the anchor, from the last context feature
        num_draft = 1

        def __init__(self, drafter: ToyDrafter):
            self.drafter, self.last = drafter, None

        def reset(self):
            self.last = None

        def extend(self, aux_hidden):
            self.last = aux_hidden[0, -1]

        def propose(self, anchor_id: int) -> list[int]:
            return [int(self.drafter.proj(self.last).argmax())]

    class ToyKind(DrafterKind):
        name = "toy_e2e"
        config_class = _ToyConfig
        drafter_class = ToyDrafter

        def config_from(self, section, target_config, *, aux_layer_ids, defaults, target_name, torch_dtype):
            return _ToyConfig(target_config.hidden_size, target_config.vocab_size, aux_layer_ids or (2,))

        def features(self, config):
            return FeatureNeeds(aux_layer_ids=config.aux_layer_ids, final_hidden=False)

        def build(self, config, *, d2t, t2d, target_head=None):
            return ToyDrafter(config)

        def objective(self, drafter, loss, section=None):
            return ToyObjective(drafter)

        def training_loss(self, module, batch, steps, *, global_norm=False, read_along=False, with_alpha=True):
            aux_hidden, final_hidden = module.target_features(batch)
            assert final_hidden is None  # features() asked for none
            return type("Out", (), {"loss": module.objective(aux_hidden, batch["input_ids"], batch["loss_mask"])})

        def train_metrics(self, out, with_alpha):
            return {}, {}

        def validation_metrics(self, steps):
            from torchmetrics import MeanMetric

            class Loss(MeanMetric):
                def update(self, out):
                    super().update(out.loss.detach())

                def compute(self, prefix="val"):
                    return {f"{prefix}/loss": super().compute()}

            return Loss()

        def validation_loss(self, metrics, step_weights):
            return metrics.get("val/loss")

        def to_write(self, trained, state):
            drafter = ToyDrafter(trained.config)
            drafter.load_state_dict(state)
            return drafter

        def save(self, drafter, folder):
            state = {k: v.contiguous() for k, v in drafter.state_dict().items()}
            save_file(state, str(Path(folder) / "toy.safetensors"))
            (Path(folder) / "config.json").write_text(json.dumps(drafter.config.to_json_dict()))

        def load(self, folder):
            drafter = ToyDrafter(_ToyConfig(**json.loads((Path(folder) / "config.json").read_text())))
            drafter.load_state_dict(load_file(str(Path(folder) / "toy.safetensors")))
            return drafter

        def check_folder(self, folder):
            from safetensors import SafetensorError

            try:
                drafter = self.load(folder)
            except (OSError, ValueError, RuntimeError, SafetensorError) as e:
                return [str(e)]
            return [] if all(torch.isfinite(p).all() for p in drafter.parameters()) else ["non-finite weights"]

        def proposer(self, drafter):
            return ToyProposer(drafter)

    return ToyKind()


def test_a_toy_kind_trains_through_the_module_decodes_losslessly_and_writes_a_checked_folder(tmp_path):
    """The seam: a kind defined here (not in the package) is registered, trained by `DrafterModule` on a tiny target
    (online features at the layers its `features` names), decoded by the block decoder, written by the drafter-folder
    writer with its own `save` and `check_folder`, and read back."""
    import torch

    from eagle3_zoo.adapters import get_adapter
    from eagle3_zoo.checkpoint.folder import write_drafter_folder
    from eagle3_zoo.speculative.dflash_decode import DFlashGenerator
    from eagle3_zoo.speculative.generate import plain_generate
    from eagle3_zoo.training.module import DrafterModule
    from tests.test_speculative_support import tiny_target

    kind = register_kind(_toy_kind())
    try:
        target, adapter = tiny_target("llama"), get_adapter("llama")
        config = get_kind("toy_e2e").config_from(None, target.config, aux_layer_ids=(3,), defaults={},
                                                 target_name="tiny", torch_dtype="float32")
        torch.manual_seed(0)
        drafter = kind.build(config, d2t=None, t2d=None)
        module = DrafterModule(drafter, adapter, target, kind="toy_e2e", mode="online")
        assert kind_of(drafter) is kind and module.objective.drafter is drafter
        prompt = torch.tensor([1, 5, 9, 14, 3])
        text = plain_generate(target, prompt, 40, eos_token_id=[]).tokens  # the target's own text: learnable
        ids = torch.tensor([prompt.tolist() + text])
        batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
        opt = torch.optim.Adam(module.objective.parameters(), lr=1e-2)
        losses = []
        for _ in range(60):
            loss = module.loss(batch, 1).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < 0.2 * losses[0]

        out = DFlashGenerator(target, kind.proposer(drafter), adapter, layer_ids=config.aux_layer_ids).generate(
            prompt, 40, eos_token_id=[])
        assert out.tokens == text  # lossless
        assert sum(out.accept_lengths) > 0  # and the trained toy is accepted sometimes

        folder = write_drafter_folder(drafter, tmp_path / "toy", {"drafter": {"kind": "toy_e2e"}}, {"toy": True},
                                      kind=kind)
        assert kind.check_folder(folder) == []
        back = kind.load(folder)
        assert torch.equal(back.proj.weight, drafter.proj.weight)
        (folder / "toy.safetensors").write_bytes(b"broken")
        assert kind.check_folder(folder)
    finally:
        unregister_kind("toy_e2e")


def test_plan_builds_an_eagle3_config_without_importing_the_kind():
    """`drafters.config_from` answers EAGLE-3 from its torch-free sizing, the same config the kind builds."""
    code = (
        "import sys, json; from types import SimpleNamespace\n"
        "from eagle3_zoo.adapters.shipped import shipped_target_config\n"
        "from eagle3_zoo.drafters import config_from\n"
        "section = SimpleNamespace(draft_vocab_size=4096, fc_norm=True, norm_output=False, hidden_size=None,\n"
        "    intermediate_size=1024, num_attention_heads=None, num_key_value_heads=None, head_dim=None)\n"
        "cfg = config_from('eagle3', section, shipped_target_config('HuggingFaceTB/SmolLM2-135M-Instruct'),\n"
        "    aux_layer_ids=(1, 2, 3), defaults={'head_dim': 64}, target_name='t', torch_dtype='bfloat16')\n"
        "loaded = [m for m in ('eagle3_zoo.drafters.eagle3.kind', 'eagle3_zoo.modeling.drafter') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "print(json.dumps(cfg.to_json_dict(), sort_keys=True))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    import json
    from types import SimpleNamespace

    from eagle3_zoo.adapters.shipped import shipped_target_config

    section = SimpleNamespace(draft_vocab_size=4096, fc_norm=True, norm_output=False, hidden_size=None,
                              intermediate_size=1024, num_attention_heads=None, num_key_value_heads=None, head_dim=None)
    want = get_kind("eagle3").config_from(
        section, shipped_target_config("HuggingFaceTB/SmolLM2-135M-Instruct"), aux_layer_ids=(1, 2, 3),
        defaults={"head_dim": 64}, target_name="t", torch_dtype="bfloat16")
    assert json.loads(out) == json.loads(json.dumps(want.to_json_dict(), sort_keys=True))
    assert want.intermediate_size == 1024 and want.fc_norm and want.draft_vocab_size == 4096
