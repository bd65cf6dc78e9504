"""What `check --engine vllm` and `eval --engine vllm` hand to vLLM: the folder as shipped when vLLM loads its layout
(canonical, and vLLM's own speculators format: what a user downloads is what is checked), a canonical export only of
layouts vLLM does not read (official pickles, SpecForge's prefixed keys). The engine tier loads both in a real
server (tests/test_engine_vllm.py)."""

from __future__ import annotations

from eagle3_zoo.checkpoint import detect_format, export_drafter
from eagle3_zoo.speculative.engine_eval import served_drafter_dir
from tests.hub_fixtures import canonical_dir, official_dir


def test_vllm_is_given_a_speculators_folder_as_shipped(tmp_path):
    src, drafter = canonical_dir(tmp_path)
    spec = export_drafter(src, "speculators", tmp_path / "speculators")
    assert served_drafter_dir(spec, tmp_path / "work-spec") == spec.resolve()
    assert not (tmp_path / "work-spec").exists()  # nothing converted
    assert served_drafter_dir(src, tmp_path / "work-canon") == src.resolve()
    official = official_dir(tmp_path, drafter)
    served = served_drafter_dir(official, tmp_path / "work-official")
    assert served == (tmp_path / "work-official").resolve() and detect_format(served) == "sglang"
