"""A pickle weight file carrying code, as a target, a LoRA adapter or an evaluation target: refused unrun, in one line
that names the file and does not advise loading it unsafely (exit 2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hub_fixtures import canonical_dir, tiny_target_config
from safetensors.torch import load_file
from training_fixtures import save_tiny_target, tiny_recipe, write_chat_jsonl, write_recipe

from eagle3_zoo.cli import main


class _RunsAShellCommand:
    """Unpickled, it would run `command` (the safe loader refuses it: nothing runs)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _poison(folder: Path, safetensors_name: str, pickle_name: str, marker: Path) -> Path:
    """Replace `folder`'s safetensors weights by a pickle of the same tensors plus an object that runs a command."""
    state: dict = dict(load_file(folder / safetensors_name))
    state["payload"] = _RunsAShellCommand(f"touch {marker}")
    (folder / safetensors_name).unlink()
    torch.save(state, folder / pickle_name)
    return folder / pickle_name


def _assert_refused(err: str, file: Path, marker: Path) -> None:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"error: {file}: refused: it holds a reference to posix.system"), lines[0]
    assert "plain tensors only" in lines[0] and "convert" in lines[0] and "safetensors" in lines[0]
    assert "weights_only" not in err and "will likely succeed" not in err and "UnpicklingError" not in err
    assert not marker.exists()  # nothing in the file was run


@pytest.fixture
def tiny_fit(tmp_path):
    target = save_tiny_target(tmp_path / "target", num_layers=4)
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=8)
    return tmp_path, target, data


def test_a_target_pickle_with_code_is_refused_naming_the_file(tiny_fit, capsys):
    tmp, target, data = tiny_fit
    marker = tmp / "ran"
    file = _poison(target, "model.safetensors", "pytorch_model.bin", marker)
    recipe = write_recipe(tmp / "r.yaml", tiny_recipe(tmp, target, data))
    assert main(["fit", str(recipe)]) == 2
    _assert_refused(capsys.readouterr().err, file, marker)


def test_a_lora_pickle_with_code_is_refused_naming_the_file(tiny_fit, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    tmp, target, data = tiny_fit
    lora = tmp / "lora"
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(target), config).save_pretrained(lora)
    marker = tmp / "ran"
    file = _poison(lora, "adapter_model.safetensors", "adapter_model.bin", marker)
    recipe = write_recipe(tmp / "r.yaml", tiny_recipe(tmp, target, data, target={"lora_path": str(lora)}))
    assert main(["fit", str(recipe)]) == 2
    _assert_refused(capsys.readouterr().err, file, marker)


def test_an_eval_target_pickle_with_code_is_refused_naming_the_file(tmp_path, capsys):
    from transformers import LlamaForCausalLM

    from eagle3_zoo.adapters import get_adapter

    drafter, _ = canonical_dir(tmp_path)
    target = tmp_path / "target"
    LlamaForCausalLM(tiny_target_config()).save_pretrained(target)
    get_adapter("llama").tiny_tokenizer().save_pretrained(target)
    marker = tmp_path / "ran"
    file = _poison(target, "model.safetensors", "pytorch_model.bin", marker)
    assert main(["eval", str(drafter), "--target", str(target), "--bench", "mtbench", "--limit", "1",
                 "--max-new-tokens", "4", "--out", str(tmp_path / "r.json")]) == 2
    _assert_refused(capsys.readouterr().err, file, marker)
