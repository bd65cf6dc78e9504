"""The data stage split by rank (`eagle3_zoo.data.ranks`): regeneration and the feature job run by two processes
(each its share, waiting for the other through the files) write exactly what one process writes."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from training_fixtures import regenerate_share, write_feature_share


def _run_ranks(fn, world_size, *args):
    with mp.get_context("fork").Pool(world_size) as pool:  # one rank per worker: each waits for the other's parts
        return pool.starmap(fn, [(r, world_size, *args) for r in range(world_size)], chunksize=1)


def _files(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and not p.name.endswith(".lock")}


def test_rank_split_regeneration_equals_one_process(tmp_path):
    one, two = tmp_path / "one" / "answers.jsonl", tmp_path / "two" / "answers.jsonl"
    assert regenerate_share(0, 1, str(one)) == 5
    generated = _run_ranks(regenerate_share, 2, str(two))
    assert generated == [3, 2]  # batches of 2, 2, 1 in prompt-length order: rank 0 takes the first and last
    assert two.read_bytes() == one.read_bytes()
    assert _files(two.parent) == _files(one.parent)  # the part files are merged and gone
    assert not list(two.parent.glob("*.part-[0-9]*[0-9]"))
    # a rerun with another world size finds everything done
    assert _run_ranks(regenerate_share, 2, str(one)) == [0, 0]
    assert two.read_bytes() == one.read_bytes()


def _served_ranks(tmp_path, server, name, world_size, *overrides):
    """The data stage over `tmp_path/chat.jsonl` by `world_size` processes (each its share) regenerating through
    `server` into the cache `tmp_path/name`; every rank's regeneration summary, and the regenerated file's bytes."""
    from training_fixtures import prepare_share_served, tiny_recipe, write_chat_jsonl, write_recipe

    data = tmp_path / "chat.jsonl"
    if not data.exists():
        write_chat_jsonl(data, n=10, turns=2)
    recipe = write_recipe(tmp_path / f"{name}.yaml", tiny_recipe(tmp_path / name, tmp_path, data))
    args = [(r, world_size, str(recipe), server.url, "data.regenerate.concurrency=2", *overrides)
            for r in range(world_size)]
    with mp.get_context("fork").Pool(world_size) as pool:  # a rank waiting for a share nobody answers fails here
        summaries = pool.starmap_async(prepare_share_served, args, chunksize=1).get(120)
    cache = tmp_path / name / "cache" / "regenerated"
    assert not list(cache.glob("*.part-[0-9]*[0-9]"))  # the parts are merged and gone
    (answers,) = cache.glob("*.jsonl")
    return summaries, answers.read_bytes()


def _what_the_data_holds(summary):
    return {k: summary[k] for k in ("conversations", "answer_turns", "skipped")}


def test_rank_split_served_regeneration_equals_one_process(tmp_path):
    """Regeneration through an OpenAI-compatible server split across two processes (`prepare --rank`, `fit` under
    ddp): each rank sends its share of the conversations, and the file is byte-identical to one process's."""
    from training_fixtures import in_vocabulary_server

    with in_vocabulary_server() as server:
        (one,), one_file = _served_ranks(tmp_path, server, "one", 1)
        asked = len(server.completions)
        two, two_file = _served_ranks(tmp_path, server, "two", 2)
        assert len(server.completions) == 2 * asked  # every turn asked once by one of the ranks
    assert one["generated"] == 10 and one["answer_turns"] == 20
    assert [s["generated"] for s in two] == [6, 4]  # batches of 2 (concurrency): rank 0 takes 3 of the 5
    assert two_file == one_file
    assert [_what_the_data_holds(s) for s in two] == [_what_the_data_holds(one)] * 2


def test_rank_split_served_regeneration_skips_refused_answers_like_one_process(tmp_path):
    """With data.on_error=skip, the conversations whose answers are refused are left out and counted the same way
    by one process and by every rank of two (none waits for them), and the next run asks again for exactly those."""
    from training_fixtures import in_vocabulary_server

    with in_vocabulary_server(refuse_every=3) as server:
        (one,), one_file = _served_ranks(tmp_path, server, "one", 1)
        two, two_file = _served_ranks(tmp_path, server, "two", 2)
    refused = one["skipped"]["server_answer_refused"]
    assert 0 < refused < 10 and one["generated"] == 10 - refused
    assert two_file == one_file and sum(s["generated"] for s in two) == one["generated"]
    assert [_what_the_data_holds(s) for s in two] == [_what_the_data_holds(one)] * 2
    with in_vocabulary_server() as server:  # the server is fixed: only the refused conversations are asked again
        again, _ = _served_ranks(tmp_path, server, "two", 2)
    assert sum(s["generated"] for s in again) == refused and again[0]["conversations"] == 10
    assert all(s["skipped"] == {} for s in again)


def test_rank_split_feature_job_equals_one_process(tmp_path):
    from eagle3_zoo.data.features import FeatureReader

    write_feature_share(0, 1, str(tmp_path / "one"))
    _run_ranks(write_feature_share, 2, str(tmp_path / "two"))
    one, two = _files(tmp_path / "one"), _files(tmp_path / "two")
    assert sorted(one) == sorted(two) and "manifest.json" in one and "part-00005/manifest.json" in one
    assert one == two  # shards, part manifests and the merged manifest, byte for byte
    a, b = FeatureReader(tmp_path / "one", verify="hash"), FeatureReader(tmp_path / "two", verify="hash")
    assert a.sample_ids == b.sample_ids and len(a) == 11


def test_offline_fit_reads_only_the_target_heads(tmp_path, monkeypatch):
    """Training on stored features reads the embedding, final norm and lm_head tensors of the target, no other
    (and never builds the whole model); the feature job loaded the whole target while it had features to extract."""
    from safetensors.torch import load_file
    from training_fixtures import save_tiny_target, tiny_recipe, write_chat_jsonl, write_recipe

    from eagle3_zoo.adapters import loading
    from eagle3_zoo.data.stage import prepare_recipe
    from eagle3_zoo.recipe.sections import load_recipe
    from eagle3_zoo.training.build import build_run

    target = save_tiny_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=8)
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, target, data)), ["data.mode=offline"])
    prepare_recipe(recipe)  # the feature job, with the whole target

    read, real_open = [], loading.safe_open

    class CountingOpen:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key):
            read.append(key)
            return self.f.get_tensor(key)

        def get_slice(self, key):  # the heads loader reads a tensor's dtype from its slice (no data)
            return self.f.get_slice(key)

    def no_whole_model(*args, **kwargs):
        raise AssertionError("the whole target was loaded")

    monkeypatch.setattr(loading, "safe_open", CountingOpen)
    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", no_whole_model)
    run = build_run(recipe)
    assert sorted(read) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    saved = load_file(target / "model.safetensors")
    assert torch.equal(run.module._frozen.embed_tokens.weight, saved["model.embed_tokens.weight"])
    assert torch.equal(run.module._frozen.lm_head.weight, saved["lm_head.weight"])
    assert run.module.target is None and run.target.model.layers[0].mlp.up_proj.weight.is_meta


def test_tau_eval_under_two_process_ddp_equals_one_process(tmp_path):
    """Each rank decodes its share of the prompts and the results are gathered: every rank logs the figure of one
    process. The same group finds which ranks share a cache directory (`split_for`): both share `shared`, each alone
    sees its node-local `local-<rank>`."""
    from training_fixtures import TAU_PROMPTS, tau_eval_rank

    def timeless(summary):
        return {k: v for k, v in summary.items() if "second" not in k and "per_s" not in k and "tok_s" not in k}

    one = tau_eval_rank(0, 1, "", [str(tmp_path / "alone")])
    assert one["splits"] == [(0, 1)] and one["summary"]["requests"] == len(TAU_PROMPTS)
    assert one["summary"]["tau_per_request_mean"] != one["summary"]["tau"]  # acceptance varies by prompt
    shared, local = str(tmp_path / "shared"), str(tmp_path / "local-{rank}")
    with mp.get_context("fork").Pool(2) as pool:
        ranks = pool.starmap(tau_eval_rank, [(r, 2, str(tmp_path / "pg"), [shared, local.format(rank=r)])
                                             for r in range(2)], chunksize=1)
    for r, got in enumerate(ranks):
        assert timeless(got["summary"]) == timeless(one["summary"])
        assert got["splits"] == [(r, 2), (0, 1)]


@pytest.mark.slow
def test_ddp_fit_splits_regeneration_and_features_like_one_process(tmp_path):
    """`fit` with ddp on 2 processes starts both ranks before the data stage: they split the regeneration and the
    feature job (both ranks write a part) and the cache ends up byte-identical to a one-process fit's."""
    from training_fixtures import run_fit_cli, save_tiny_target, tiny_recipe, write_chat_jsonl, write_recipe

    target = save_tiny_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=12)
    for name, extra in (("one", []), ("two", ["trainer.strategy=ddp", "trainer.devices=2"])):
        recipe = tiny_recipe(tmp_path / name, target, data, trainer={"max_steps": 2})
        recipe["data"].update(mode="offline", regenerate={"enabled": True, "max_new_tokens": 4, "batch_size": 2})
        r = run_fit_cli(write_recipe(tmp_path / f"{name}.yaml", recipe), f"output_dir={tmp_path / name / 'run'}",
                        *extra, timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
    two = tmp_path / "two" / "cache"
    assert sorted(p.name for p in (two / "regenerated").glob("*.part-*.lock")) == [
        f"{next((two / 'regenerated').glob('*.jsonl')).name}.part-0000{r}.lock" for r in (0, 1)]  # both ranks wrote
    for sub in ("regenerated", "features"):
        assert _files(two / sub) == _files(tmp_path / "one" / "cache" / sub) != {}


def test_tau_eval_under_two_process_fsdp_equals_one_process(tmp_path):
    """FSDP (drafter and target decoder layers sharded, bf16-mixed policy on the drafter): every rank decodes every
    prompt in lockstep with a plain copy of the drafter's fp32 weights and logs the figure of one process; ranks that
    decode differently all raise at the first target forward that differs instead of hanging. With only the drafter
    sharded (offline mode) the ranks split the prompts."""
    from training_fixtures import fsdp_tau_eval_rank

    def timeless(summary):
        return {k: v for k, v in summary.items() if "second" not in k and "per_s" not in k and "tok_s" not in k}

    def two_ranks(*args):  # ranks whose collectives do not pair up would wait forever: fail instead
        with mp.get_context("fork").Pool(2) as pool:
            return pool.starmap_async(fsdp_tau_eval_rank, [(r, 2, *args) for r in range(2)], chunksize=1).get(120)

    one = fsdp_tau_eval_rank(0, 1, "")
    assert one["summary"]["tau"] > 1 and one["summary"]["tau_per_request_mean"] != one["summary"]["tau"]
    for got in two_ranks(str(tmp_path / "pg")):
        assert timeless(got["summary"]) == timeless(one["summary"])
        assert got["held"] == torch.bfloat16  # the root kept the policy's compute copy after the validation forward
        assert got["fc_scaled"] and torch.equal(got["fc_input_scale"], one["fc_input_scale"])
        assert got["state"].keys() == one["state"].keys()
        for k, v in one["state"].items():  # the decode copy: the fp32 weights, bitwise
            assert got["state"][k].dtype == v.dtype and torch.equal(got["state"][k], v), k
    for got in two_ranks(str(tmp_path / "pg2"), False, False):  # a whole target: the ranks split the prompts
        assert timeless(got["summary"]) == timeless(one["summary"]) and torch.equal(got["state"]["fc.weight"],
                                                                                     one["state"]["fc.weight"])
    for got in two_ranks(str(tmp_path / "pg3"), True):
        assert "the ranks decoded differently under FSDP at target forward 1" in got["error"], got
