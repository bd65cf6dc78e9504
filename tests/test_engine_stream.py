"""Hidden states streamed from an engine, against loopback stand-ins for vLLM hidden-states servers
(tests/engine_fake.py, backed by a tiny HF model): plan order, the prefetch window and disk budget, read-once files,
resume, retries and one clear error, requests split over two servers and handed over when one dies; then whole
fits: fed by the engine == the target in the training step, and hybrid (the first pass writes the store, later ones
read it) == online."""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch
from engine_fake import FakeHiddenStatesServer, tiny_states
from safetensors.torch import load_file
from training_fixtures import run_fit_cli, save_tiny_target, tiny_recipe, write_chat_jsonl, write_recipe

from eagle3_zoo.data.datamodule import LengthBucketBatchSampler
from eagle3_zoo.data.engine.feed import EngineFeed, EngineFeedError, final_norm_on_cpu, run_tag
from eagle3_zoo.data.engine.stream import FeatureStream
from eagle3_zoo.recipe.sections import load_recipe
from eagle3_zoo.targets.deployment import EngineDeployment

AUX = (1, 2, 3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaForCausalLM

    from eagle3_zoo.adapters import get_adapter

    tmp = tmp_path_factory.mktemp("engine")
    target = save_tiny_target(tmp / "target")
    model = LlamaForCausalLM.from_pretrained(target).eval().requires_grad_(False)
    return tmp, target, model, get_adapter("llama")


def _examples(n: int, length: int | None = None, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    sizes = [length or int(t) for t in torch.randint(6, 40, (n,), generator=g)]
    return [{"id": f"s{i}", "input_ids": torch.randint(3, 500, (t,), generator=g), "loss_mask": torch.ones(t)}
            for i, t in enumerate(sizes)]


def _feed(tiny, storage: Path, urls: list[str], budget: int = 2**30, retries: int = 2, tag: str = "e3ztestr0"):
    tmp, target, _, _ = tiny
    data = write_chat_jsonl(tmp / "chat.jsonl", n=4)
    recipe = load_recipe(write_recipe(tmp / "attach.yaml", tiny_recipe(tmp, target, data, engine={
        "mode": "attach", "urls": urls, "hidden_states_dir": str(storage), "retries": retries})))
    feed = EngineFeed(EngineDeployment(recipe, AUX, 4), tag, budget, concurrency=4).start()
    for server in feed.deployment.servers:
        server.client.backoff = 0.01  # retries in milliseconds, not seconds
    return feed


def _stream(tiny, feed, examples, prefetch=2):
    _, _, model, adapter = tiny
    return FeatureStream(feed, examples, layers=len(AUX) + 1, hidden_size=model.config.hidden_size, itemsize=4,
                         final_norm=final_norm_on_cpu(adapter.final_norm(model)), prefetch_batches=prefetch)


def _served(tiny, tmp_path, name="hs"):
    _, _, model, _ = tiny  # a copy: the server's forward hooks must not meet the reference forward of the test
    return FakeHiddenStatesServer(tiny_states(copy.deepcopy(model), AUX), tmp_path / name)


def _reference(tiny, ids):
    _, _, model, adapter = tiny
    aux, final, _ = adapter.forward_features(model, ids.unsqueeze(0), layer_ids=AUX, use_cache=False)
    return aux[0], final[0]


def test_stream_serves_the_planned_batches_in_order_with_the_targets_states(tiny, tmp_path):
    examples = _examples(7)
    plan = [[2, 0], [5], [1, 3, 6], [4]]
    with _served(tiny, tmp_path) as server:
        feed = _feed(tiny, tmp_path / "hs", [server.url])
        stream = _stream(tiny, feed, examples)
        stream.plan(plan)
        for batch in plan:
            for i, sample in zip(batch, stream.take(batch)):
                aux, final = _reference(tiny, examples[i]["input_ids"])
                assert torch.equal(sample["input_ids"], examples[i]["input_ids"])
                torch.testing.assert_close(sample["aux_hidden"], aux, rtol=0, atol=1e-6)
                torch.testing.assert_close(sample["final_hidden"], final, rtol=0, atol=1e-6)
        with pytest.raises(RuntimeError, match="the stream planned none"):
            stream.take([0])
        feed.close()
    assert not list((tmp_path / "hs").iterdir())  # every file (and lock) read once and deleted
    assert feed.stats.requests == 7 and feed.stats.tokens == sum(e["input_ids"].numel() for e in examples)


def test_prefetch_keeps_to_its_batches_and_its_disk_budget(tiny, tmp_path, caplog):
    examples = _examples(10, length=20)
    with _served(tiny, tmp_path) as server:
        server.delay = 0.02
        one = 20 * (len(AUX) + 1) * 64 * 4  # bytes of one sample's file
        feed = _feed(tiny, tmp_path / "hs", [server.url], budget=3 * one)
        stream = _stream(tiny, feed, examples, prefetch=4)
        stream.plan([[i] for i in range(10)])
        for i in range(10):
            stream.take([i])
            time.sleep(0.05)
        assert max(server.files_seen) <= 3 and feed.peak_reserved == 3 * one  # the budget, not the 4-batch window
        assert len(server.request_ids) == 10  # each sample requested once

        wide = _feed(tiny, tmp_path / "hs", [server.url], budget=100 * one)
        server.files_seen.clear()
        stream = _stream(tiny, wide, examples, prefetch=2)
        stream.plan([[i] for i in range(10)])
        for i in range(10):
            stream.take([i])
            time.sleep(0.05)  # a slow training step: whatever is requested ahead piles up on disk
        assert max(server.files_seen) <= 3 and len(server.files_seen) == 10  # the batch being read + 2 ahead

        tight = _feed(tiny, tmp_path / "hs", [server.url], budget=one // 2)  # less than one batch
        stream = _stream(tiny, tight, examples, prefetch=4)
        with caplog.at_level(logging.WARNING, "eagle3_zoo.data.engine.feed"):
            stream.plan([[0, 1], [2]])
            assert len(stream.take([0, 1])) == 2 and len(stream.take([2])) == 1  # requested anyway, one at a time
        assert "exceed data.prefetch_disk_gib" in caplog.text
        for f in (feed, wide, tight):
            f.close()
    assert not list((tmp_path / "hs").iterdir())


def test_a_resumed_pass_plans_the_rest_and_a_killed_runs_files_are_removed(tiny, tmp_path):
    examples = _examples(12)
    sampler = LengthBucketBatchSampler([int(e["input_ids"].numel()) for e in examples], 2, seed=3, bucket_batches=2)
    full = sampler.planned()
    sampler.resume(0, 2)
    assert sampler.planned() == full[2:] and list(sampler) == full[2:] and list(sampler) == full  # skip once
    storage = tmp_path / "hs"
    storage.mkdir()
    tag = run_tag(tmp_path / "run", 0)
    ours = [storage / f"cmpl-{tag}-t3-0a1b2c3d-0-ffffffff.safetensors{s}" for s in ("", ".lock")]
    theirs = storage / "cmpl-e3zsomeoner0-t3-00000000-0-eeeeeeee.safetensors"
    for p in (*ours, theirs):
        p.touch()
    with _served(tiny, tmp_path) as server:
        feed = _feed(tiny, storage, [server.url], tag=tag)  # start(): a restarted run cleans up after itself
        assert not any(p.exists() for p in ours) and theirs.exists()
        first = _stream(tiny, feed, examples)
        first.plan(full)
        seen = [first.take(b) for b in full[:4]]
        first.cancel()  # killed mid-pass: its prefetched files go too
        resumed = _stream(tiny, feed, examples)
        resumed.plan(full[2:])
        again = [resumed.take(b) for b in full[2:4]]
        resumed.cancel()
        feed.close()
    for old, new in zip(seen[2:], again):
        for a, b in zip(old, new):
            assert torch.equal(a["aux_hidden"], b["aux_hidden"]) and torch.equal(a["final_hidden"], b["final_hidden"])
    assert sorted(p.name for p in storage.iterdir()) == [theirs.name]


def test_transient_errors_are_retried_then_one_clear_error(tiny, tmp_path):
    examples = _examples(3)
    with _served(tiny, tmp_path) as server:
        feed = _feed(tiny, tmp_path / "hs", [server.url], retries=2)
        server.faults = [503, 429]
        stream = _stream(tiny, feed, examples)
        stream.plan([[0]])
        assert len(stream.take([0])) == 1 and len(server.request_ids) == 1  # two transient failures, then the answer
        server.faults = [503] * 20
        stream.plan([[1], [2]])
        with pytest.raises(EngineFeedError, match=rf"no engine server delivered .*HTTP 503.*\(3 attempts\).*tried "
                                                  rf"{server.url}, each with 2 retries"):
            stream.take([1])
        feed.close()
    assert not list((tmp_path / "hs").iterdir())


def test_two_servers_share_the_requests_and_one_that_dies_hands_over(tiny, tmp_path):
    examples = _examples(12)
    plan = [[i, i + 1] for i in range(0, 12, 2)]

    def run(urls):
        feed = _feed(tiny, tmp_path / "hs", urls)
        stream = _stream(tiny, feed, examples, prefetch=3)
        stream.plan(plan)
        out = [s for b in plan for s in stream.take(b)]
        feed.close()
        return out, feed.stats

    with _served(tiny, tmp_path) as a, _served(tiny, tmp_path) as b:
        single, _ = run([a.url])
        both, stats = run([a.url, b.url])
        assert set(stats.per_server) == {a.url, b.url} and sum(stats.per_server.values()) == 12
        a.delay = 0.05  # requests are in flight at a when it dies
        start, killer = len(a.request_ids), threading.Thread(target=a.stop)
        # a dies at its first answer of this run, while its other requests are in flight: dead at once (in the
        # answering thread), then shut down (a thread started from here can run too late under load, and a later
        # death can come after the last request it was sent: both let every request be answered)
        a.on_request = lambda n: n == start + 1 and (setattr(a, "dead", True), killer.start())
        handed, stats = run([a.url, b.url])
        killer.join()
        assert stats.failovers >= 1 and sum(stats.per_server.values()) == 12
    for x, y, z in zip(single, both, handed):  # whichever server answered, the same states
        assert torch.equal(x["aux_hidden"], y["aux_hidden"]) and torch.equal(x["aux_hidden"], z["aux_hidden"])
        assert torch.equal(x["final_hidden"], z["final_hidden"])
    assert not list((tmp_path / "hs").iterdir())


# --------------------------------------------------------------------------------------------- whole fits
@pytest.fixture(scope="module")
def fits(tiny):
    """Three 2-epoch fits of the tiny target: in process, fed by the engine (online), and hybrid."""
    tmp, target, model, _ = tiny
    data = write_chat_jsonl(tmp / "fit.jsonl", n=24)
    out = {}
    with FakeHiddenStatesServer(tiny_states(model, AUX), tmp / "fit-hs") as server:
        recipe = write_recipe(tmp / "fit.yaml", tiny_recipe(tmp, target, data, engine={
            "mode": "attach", "urls": [server.url], "hidden_states_dir": str(tmp / "fit-hs")}))
        common = ["trainer.max_steps=null", "trainer.max_epochs=2", "trainer.val_check_interval=null"]
        for name, extra in (("in_process", []), ("engine", ["data.features_backend=vllm"]),
                            ("hybrid", ["data.features_backend=vllm", "data.mode=hybrid"])):
            before = len(server.request_ids)
            r = run_fit_cli(recipe, *common, *extra, f"output_dir={tmp / name}", f"data.features_dir={tmp / 'store'}")
            assert r.returncode == 0, r.stderr[-4000:]
            out[name] = (load_file(tmp / name / "drafter" / "model.safetensors"), r.stderr,
                         len(server.request_ids) - before)
    return tmp, out


def test_a_fit_fed_by_the_engine_equals_the_target_in_the_training_step(fits):
    _, out = fits
    (ref, _, none), (fed, log, requests) = out["in_process"], out["engine"]
    assert none == 0 and requests == 2 * (18 + 5)  # 9 batches of 2 and 5 validation samples, every epoch
    for k in ref:
        torch.testing.assert_close(fed[k], ref[k], rtol=0, atol=1e-5)
    assert "engine_tok_s=" in log and "engine_wait=" in log  # the progress line
    assert "engine feed (rank 0): 46 requests" in log


def test_hybrid_writes_the_store_on_the_first_pass_and_reads_it_after(fits):
    tmp, out = fits
    (online, _, _), (hybrid, log, requests) = out["engine"], out["hybrid"]
    assert requests == 24  # every sample once: 18 + 5 in epoch 0, the one drop_last left out when epoch 1 began
    manifest = json.loads((tmp / "store" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["parts"] == 1 and manifest["num_samples"] == 24
    assert all(shard["sha256"] for shard in manifest["shards"]) and not (tmp / "store" / ".hybrid").exists()
    assert "fetching 1 sample(s) the first pass did not read" in log
    for k in online:  # fp32 store: the later epoch reads exactly what the first one streamed
        torch.testing.assert_close(hybrid[k], online[k], rtol=0, atol=1e-5)


def test_a_server_that_dies_stops_the_fit_with_what_it_kept_and_the_rerun_resumes(tiny, fits):
    tmp, out = fits
    _, target, model, _ = tiny
    data = tmp / "fit.jsonl"
    with FakeHiddenStatesServer(tiny_states(model, AUX), tmp / "kill-hs") as server:
        recipe = write_recipe(tmp / "kill.yaml", tiny_recipe(tmp, target, data, engine={
            "mode": "attach", "urls": [server.url], "hidden_states_dir": str(tmp / "kill-hs"), "retries": 1}))
        common = ["trainer.max_steps=null", "trainer.max_epochs=2", "trainer.val_check_interval=null",
                  "data.features_backend=vllm", f"output_dir={tmp / 'killed'}"]
        asked: set[str] = set()

        def second_epoch(request_id: str) -> bool:  # e3z<run>r0-t<sample>-<nonce>: a sample asked for again
            sample = request_id.split("-")[1]
            again = sample.startswith("t") and sample in asked
            asked.add(sample)
            return again

        # dies at the first request of epoch 1 (whatever the load: epoch 0's are all answered, epoch 1's none)
        server.dies_at = second_epoch
        r = run_fit_cli(recipe, *common)
        assert r.returncode == 1, r.stderr[-3000:]
        error = r.stderr.strip().splitlines()[-1]
        assert error.startswith("error: EngineFeedError: no engine server delivered the hidden states") and \
            f"tried {server.url}, each with 1 retries" in error, error
        # epoch 0's 9 steps done, the checkpoint of step 8 kept (trainer.checkpoint_every_n_steps = 2)
        assert "; training stopped at step 9;" in error and "; the last checkpoint (step 8) is kept" in error and \
            "run the same command again to resume" in error, error
        server.start()  # back on the same port
        r = run_fit_cli(recipe, *common)
        assert r.returncode == 0 and "resuming from" in r.stderr, r.stderr[-3000:]
    killed = load_file(tmp / "killed" / "drafter" / "model.safetensors")
    for k, v in out["engine"][0].items():  # the same batches and states as the uninterrupted run
        torch.testing.assert_close(killed[k], v, rtol=0, atol=1e-6)
    assert not list((tmp / "kill-hs").iterdir())


@pytest.mark.slow  # two processes: the slow tier, with the other DDP runs (tests/test_distributed.py)
def test_two_ranks_stream_their_shares_and_complete_one_hybrid_store(tiny, fits):
    """DDP over two CPU processes (batch 1 each = the single process's batch 2): each rank streams its share and
    writes its own part; when epoch 1 begins they complete and merge the store together."""
    tmp, out = fits
    _, target, model, _ = tiny
    with FakeHiddenStatesServer(tiny_states(model, AUX), tmp / "ddp-hs") as server:
        recipe = write_recipe(tmp / "ddp.yaml", tiny_recipe(tmp, target, tmp / "fit.jsonl", engine={
            "mode": "attach", "urls": [server.url], "hidden_states_dir": str(tmp / "ddp-hs")}))
        r = run_fit_cli(recipe, "trainer.max_steps=null", "trainer.max_epochs=2", "trainer.val_check_interval=null",
                        "data.features_backend=vllm", "data.mode=hybrid", "trainer.strategy=ddp", "trainer.devices=2",
                        "trainer.batch_size=1", f"output_dir={tmp / 'ddp'}", f"data.features_dir={tmp / 'ddp-store'}",
                        timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
    manifest = json.loads((tmp / "ddp-store" / "manifest.json").read_text())
    single = json.loads((tmp / "store" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["parts"] == 2
    assert {sid for s in manifest["shards"] for sid in s["samples"]} == \
        {sid for s in single["shards"] for sid in s["samples"]}  # all 24 samples, in two parts
    got = load_file(tmp / "ddp" / "drafter" / "model.safetensors")
    for k, v in out["hybrid"][0].items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=2e-5)  # tests/test_distributed.py's bound
