"""What a location string names: one rule for Hub ids and local paths, shared by recipes, readers, cards and the zoo."""

from __future__ import annotations

import pytest

from eagle3_zoo.values.locations import is_hub_id, looks_like_hub_id, path_problem


@pytest.mark.parametrize("name,hub", [
    ("org/name", True), ("Qwen/Qwen3-8B", True), ("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", True),
    ("org/chats.jsonl", False), ("org/chats.json.gz", False),  # a data file, not a repo
    ("./org/name", False), ("/abs/path", False), ("~/x", False), ("name", False), ("a/b/c", False), ("", False),
    ("org/", False), ("org/na me", False), ("existing/dir", False),  # a local folder of that name exists (below)
])
def test_is_hub_id(tmp_path, monkeypatch, name, hub):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "existing" / "dir").mkdir(parents=True)
    assert is_hub_id(name) is hub
    assert looks_like_hub_id("existing/dir")  # the form alone, for names that are never local (zoo targets)


def test_path_problem_kinds(tmp_path):
    (tmp_path / "f").write_text("x")
    assert path_problem(str(tmp_path / "new" / "dir")) is None
    assert path_problem(str(tmp_path / "f")) == "exists and is not a directory"
    assert path_problem(str(tmp_path / "f" / "x"), True, "a directory") == \
        f"cannot be created: '{tmp_path / 'f'}' is a file; expected a directory"
    assert path_problem(str(tmp_path), False, "a file") == "is a directory; expected a file"
    assert path_problem(str(tmp_path / "f"), False, "a file") is None


def test_safetensors_codes_match_what_safetensors_writes(tmp_path):
    """`dtypes.safetensors_code` / `SAFETENSORS_ITEMSIZE` (the one dtype-code table, used to read headers without
    loading tensors) agree with the headers the safetensors library itself writes."""
    import json
    import struct

    import torch
    from safetensors.torch import save_file

    from eagle3_zoo.values.dtypes import SAFETENSORS_FLOATS, SAFETENSORS_ITEMSIZE, safetensors_code

    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool]
    save_file({str(d): torch.zeros(3, dtype=d) for d in dtypes}, tmp_path / "w.safetensors")
    raw = (tmp_path / "w.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    for d in dtypes:
        code = header[str(d)]["dtype"]
        assert safetensors_code(d) == code and SAFETENSORS_ITEMSIZE[code] == d.itemsize, d
        assert (code in SAFETENSORS_FLOATS) == d.is_floating_point, d
