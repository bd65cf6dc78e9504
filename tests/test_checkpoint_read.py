"""Reading a checkpoint of `fit` without a run: `consolidate_checkpoint` and `read_checkpoint_identity` take the same
header from a single-file checkpoint and from a sharded (DCP) directory's meta.pt, and refuse an unreadable or
foreign one with their own one-line messages."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tiny import tiny_drafter

from eagle3_zoo.training.rundir.checkpoint_io import DRAFTER_INFO_KEY
from eagle3_zoo.training.rundir.outputs import consolidate_checkpoint, drafter_info
from eagle3_zoo.training.rundir.resume import IDENTITY_KEY, ResumeError, read_checkpoint_identity

IDENTITY = {"optim.lr": "0.001", "data.fingerprint": "abc"}


def _write_checkpoint(path, sharded: bool):
    """A checkpoint as `fit` writes it: one file, or a DCP directory with the weights and a meta.pt with the rest."""
    drafter, _ = tiny_drafter()
    info = drafter_info(drafter.config, None, {"output_dir": "run"}, {"training": {"max_steps": 7}})
    state = {f"objective.drafter.{k}": v for k, v in drafter.state_dict().items()}
    header = {"global_step": 7, DRAFTER_INFO_KEY: info, IDENTITY_KEY: dict(IDENTITY)}
    if sharded:
        dcp.save({f"state_dict.{k}": v for k, v in state.items()}, checkpoint_id=str(path), no_dist=True)
        torch.save(header, path / "meta.pt")
    else:
        torch.save({**header, "state_dict": state}, path)
    return drafter


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as consolidate reads it
@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_checkpoint_header_is_read_from_a_file_and_a_sharded_directory(tmp_path, sharded):
    checkpoint = tmp_path / "last.ckpt"
    drafter = _write_checkpoint(checkpoint, sharded)
    assert read_checkpoint_identity(checkpoint) == IDENTITY
    out = consolidate_checkpoint(checkpoint, tmp_path / "drafter")
    drafter.save_pretrained(tmp_path / "reference")
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "reference" / "model.safetensors").read_bytes()
    training = json.loads((out / "provenance.json").read_text())["training"]
    assert training["global_step"] == 7 and training["max_steps"] == 7
    assert training["consolidated_from"] == str(checkpoint.resolve())


@pytest.mark.parametrize("kind", ["garbage", "garbage_sharded", "foreign", "not_a_dict", "entries_not_dicts"])
def test_unreadable_or_foreign_checkpoint_is_refused_in_one_line(tmp_path, kind):
    checkpoint = tmp_path / "last.ckpt"
    header = checkpoint / "meta.pt" if kind == "garbage_sharded" else checkpoint
    header.parent.mkdir(parents=True, exist_ok=True)
    if kind.startswith("garbage"):
        header.write_bytes(b"PK\x03\x04 this is not a checkpoint")
    else:
        torch.save({"foreign": {"state_dict": {"w": torch.zeros(2)}}, "not_a_dict": [1, 2],
                    "entries_not_dicts": {DRAFTER_INFO_KEY: "x", IDENTITY_KEY: "x"}}[kind], header)

    with pytest.raises(ValueError) as consolidate_error:
        consolidate_checkpoint(checkpoint, tmp_path / "out")
    with pytest.raises(ResumeError) as resume_error:
        read_checkpoint_identity(checkpoint)
    consolidate_msg, resume_msg = str(consolidate_error.value), str(resume_error.value)
    assert "\n" not in consolidate_msg + resume_msg and "weights_only" not in consolidate_msg + resume_msg
    assert not (tmp_path / "out").exists()
    hint = f"To start a fresh run, set another output_dir (or delete {tmp_path});"
    if kind.startswith("garbage"):  # the header file that failed; torch's reason (type and first line) in brackets
        assert consolidate_msg.startswith(f"{header} is not a readable checkpoint (")
        assert consolidate_msg.endswith(")") and ": " in consolidate_msg
        assert resume_msg.startswith(f"{checkpoint} is not a readable checkpoint of this run (") and hint in resume_msg
    else:
        assert consolidate_msg == (f"{checkpoint} was not written by an eagle3-zoo fit that records its drafter "
                                   f"({DRAFTER_INFO_KEY} is missing)")
        assert resume_msg.startswith(f"{checkpoint} was not written by an eagle3-zoo fit (it has no run identity). "
                                     f"{hint}")


def test_consolidate_asks_the_kind_for_the_drafter_it_writes(tmp_path, monkeypatch):
    """`consolidate` hands the checkpoint's config, weights and recorded entry to the drafter's kind
    (`DrafterKind.from_checkpoint`): EAGLE-3's folds the run's recorded fc preconditioning scale into fc.weight, as
    the folder `fit` writes has it."""
    from eagle3_zoo.drafters import get_kind
    from eagle3_zoo.drafters.eagle3.kind import drafter_from_state

    drafter, _ = tiny_drafter()
    scale = torch.linspace(0.5, 2.0, drafter.fc.weight.shape[1])
    info = drafter_info(drafter.config, scale, {"output_dir": "run"}, {"training": {}})
    state = {f"objective.drafter.{k}": v for k, v in drafter.state_dict().items()}
    torch.save({"global_step": 3, DRAFTER_INFO_KEY: info, IDENTITY_KEY: dict(IDENTITY), "state_dict": state},
               tmp_path / "last.ckpt")
    kind, asked = get_kind("eagle3"), []
    real = type(kind).from_checkpoint

    def spy(self, config, weights, recorded):
        asked.append(recorded)
        return real(self, config, weights, recorded)

    monkeypatch.setattr(type(kind), "from_checkpoint", spy)
    out = consolidate_checkpoint(tmp_path / "last.ckpt", tmp_path / "drafter")
    assert len(asked) == 1 and torch.equal(asked[0]["fc_input_scale"], scale)
    folded = drafter_from_state(drafter.config, drafter.state_dict(), scale)
    assert not torch.equal(folded.fc.weight, drafter.fc.weight.float())  # else the fold is not tested
    folded.save_pretrained(tmp_path / "reference")
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "reference" / "model.safetensors").read_bytes()
