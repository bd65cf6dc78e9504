"""Two CPU processes (gloo) with ddp and fsdp (FSDP2 via ModelParallelStrategy) train the same drafter as one
process with the whole batch: the loss weighting makes the rank-averaged gradient equal the global-batch gradient.
Their checkpoints resume (the step count continues); FSDP's sharded checkpoint consolidates into the drafter folder
the run wrote and resumes under another world size. FSDP fills a meta-device target with each rank's own slices.

Slow ones: `pytest -m slow tests/test_distributed.py`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from training_fixtures import (
    REPO,
    run_fit_cli,
    save_tiny_target,
    subprocess_env,
    tiny_recipe,
    write_chat_jsonl,
    write_recipe,
)

TOL = 2e-5


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The reference: one process, batch 2, 4 steps."""
    tmp = tmp_path_factory.mktemp("dist")
    target = save_tiny_target(tmp / "target")
    data = write_chat_jsonl(tmp / "chat.jsonl", n=24)
    recipe = write_recipe(tmp / "tiny.yaml", tiny_recipe(tmp, target, data, trainer={"batch_size": 2}))
    r = run_fit_cli(recipe, f"output_dir={tmp / 'single'}")
    assert r.returncode == 0, r.stderr[-4000:]
    return tmp, recipe


def _losses(run, version=0):
    rows = (run / f"logs/version_{version}/metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    step, loss = header.index("step"), header.index("train/loss")
    return {int(r.split(",")[step]): float(r.split(",")[loss]) for r in rows[1:] if r.split(",")[loss]}


def _run_parallel(tmp, recipe, strategy, *extra):
    run = tmp / strategy
    r = run_fit_cli(recipe, f"trainer.strategy={strategy}", "trainer.devices=2", "trainer.batch_size=1",
                    f"output_dir={run}", *extra, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return run


def _assert_same_training(tmp, run):
    ref = _losses(tmp / "single")
    got = _losses(run)
    assert sorted(got) == sorted(ref) == [0, 1, 2, 3]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=TOL), step
    a = load_file(tmp / "single" / "drafter" / "model.safetensors")
    b = load_file(run / "drafter" / "model.safetensors")
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=TOL, rtol=0)


def _consolidate(*args):
    return subprocess.run([sys.executable, "-m", "eagle3_zoo.cli", "consolidate", *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=REPO)


def test_fsdp_two_processes_match_one(single):
    """Also: the target was read shard by shard, the checkpoint is sharded (one DCP file per rank), and
    `eagle3-zoo consolidate` turns it into the very drafter folder the run wrote (bitwise), equal to the unsharded
    run's to tolerance."""
    tmp, recipe = single
    run = _run_parallel(tmp, recipe, "fsdp")
    _assert_same_training(tmp, run)
    last = run / "checkpoints" / "last.ckpt"
    assert last.is_dir() and sorted(p.name for p in last.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert torch.load(last / "meta.pt", weights_only=True)["global_step"] == 4
    r = _consolidate(last, tmp / "consolidated")
    assert r.returncode == 0, r.stderr[-4000:]
    written, consolidated = run / "drafter", tmp / "consolidated"
    assert sorted(p.name for p in consolidated.iterdir()) == sorted(p.name for p in written.iterdir())
    for name in ("model.safetensors", "config.json", "recipe.yaml"):
        assert (consolidated / name).read_bytes() == (written / name).read_bytes(), name
    a = load_file(tmp / "single" / "drafter" / "model.safetensors")
    b = load_file(consolidated / "model.safetensors")
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=TOL, rtol=0)


def test_consolidate_refuses_what_is_not_a_checkpoint_of_fit(tmp_path):
    r = _consolidate(tmp_path / "missing", tmp_path / "out")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: checkpoint {tmp_path / 'missing'} does not exist (pass a run's checkpoints/last.ckpt)"]
    torch.save({"state_dict": {}}, tmp_path / "foreign.ckpt")
    r = _consolidate(tmp_path / "foreign.ckpt", tmp_path / "out")
    assert r.returncode == 2 and "was not written by an eagle3-zoo fit" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_fsdp_resumes_under_another_world_size(single):
    """2 processes x batch 1 for 4 steps, resumed by 1 process x batch 2 to step 6 (DCP reshards the drafter and
    its optimizer state), ends where one process resumed the same way ends; 1 process x batch 1 (another global
    batch) is refused."""
    tmp, recipe = single
    run = tmp / "fsdp-world"
    r = run_fit_cli(recipe, "trainer.strategy=fsdp", "trainer.devices=2", "trainer.batch_size=1", f"output_dir={run}",
                    timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    r = run_fit_cli(recipe, "trainer.strategy=fsdp", "trainer.devices=1", "trainer.batch_size=1",
                    "trainer.max_steps=6", f"output_dir={run}")
    assert r.returncode == 2 and "global batch (trainer.batch_size x devices x num_nodes): 2 -> 1" in r.stderr
    r = run_fit_cli(recipe, "trainer.strategy=fsdp", "trainer.devices=1", "trainer.max_steps=6", f"output_dir={run}")
    assert r.returncode == 0, r.stderr[-4000:]
    assert sorted(_losses(run, version=1)) == [4, 5]
    ref = tmp / "single-resumed"
    shutil.copytree(tmp / "single", ref)
    r = run_fit_cli(recipe, "trainer.max_steps=6", f"output_dir={ref}")
    assert r.returncode == 0, r.stderr[-4000:]
    got, want = _losses(run, version=1), _losses(ref, version=1)
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=TOL), step
    a, b = load_file(ref / "drafter" / "model.safetensors"), load_file(run / "drafter" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=TOL, rtol=0)


@pytest.mark.slow
def test_fsdp_checkpoint_resumes(single):
    tmp, recipe = single
    run = tmp / "fsdp"
    if not (run / "checkpoints" / "last.ckpt").exists():
        run = _run_parallel(tmp, recipe, "fsdp")
    _run_parallel(tmp, recipe, "fsdp", "trainer.max_steps=6")
    assert sorted(_losses(run, version=1)) == [4, 5]
    assert torch.load(run / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == 6


@pytest.mark.slow
def test_ddp_two_processes_match_one_and_resume(single):
    tmp, recipe = single
    run = _run_parallel(tmp, recipe, "ddp")
    _assert_same_training(tmp, run)
    _run_parallel(tmp, recipe, "ddp", "trainer.max_steps=6")
    assert sorted(_losses(run, version=1)) == [4, 5]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shard_worker(rank: int, world: int, port: int, target_dir: str, out: str) -> None:
    """One rank: skeleton target -> FSDP2 on a flat mesh (num_nodes=1) and on a 2-D one (num_nodes=2) -> this rank's
    slices; results (bytes read, equality with the plain load, mesh, mixed precision) saved to `out/rank{r}-*.pt`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the ranks share the CPU cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from eagle3_zoo.adapters.loading import load_target, load_target_skeleton
        from eagle3_zoo.training.strategies import fsdp_mesh, shard_fsdp2

        plain, _, _ = load_target(target_dir)
        ids = torch.randint(0, plain.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
        lightning_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
        for num_nodes in (1, 2):
            model, _, adapter = load_target_skeleton(target_dir)
            on_meta = sorted({n.split(".")[1] for n, p in model.named_parameters() if p.is_meta})
            real = sorted(n for n, p in model.named_parameters() if not p.is_meta)
            mesh = fsdp_mesh(lightning_mesh, num_nodes)
            objective = torch.nn.Linear(8, 8)
            read = shard_fsdp2(model, adapter, objective, mesh, precision="bf16-mixed")
            equal = all(torch.equal(p.full_tensor() if hasattr(p, "full_tensor") else p, q)
                        for p, q in zip(model.parameters(), plain.parameters()))
            with torch.no_grad():
                logits_equal = torch.equal(model(ids).logits, plain(ids).logits)
            policy = fully_shard.state(objective)._mp_policy
            torch.save({"read": read, "on_meta": on_meta, "real": real, "equal": equal, "logits_equal": logits_equal,
                        "mesh": (tuple(mesh.shape), mesh.mesh_dim_names), "param_dtype": policy.param_dtype,
                        "reduce_dtype": policy.reduce_dtype, **_fsdp_roots(model, adapter)},
                       f"{out}/rank{rank}-nodes{num_nodes}.pt")
        dist.barrier()  # no rank leaves while the other may still be in a collective
    finally:
        dist.destroy_process_group()
    # Results are on disk. The rank ends without the interpreter's teardown: CI once saw a rank abort there
    # ("terminate called without an active exception", SIGABRT) after passing every check, in a C++ destructor
    # of the gloo groups its device meshes still held.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _fsdp_roots(model, adapter) -> dict:
    """After a forward: the target's FSDP roots (by name), whether every decoder layer is resharded, and the
    module each layer prefetches in forward."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(m): n for n, m in model.named_modules()}
    roots = [names[id(m)] for m in model.modules() if isinstance(m, FSDPModule) and m._get_fsdp_state()._is_root]
    layers = list(adapter.decoder_layers(model))
    resharded = all(m._get_fsdp_state()._fsdp_param_group.is_sharded for m in layers)
    prefetch = [[names[id(s._modules[0])] for s in m._get_fsdp_state()._states_to_forward_prefetch] for m in layers]
    return {"roots": roots, "resharded": resharded, "prefetch": prefetch}


def _check_shards(tmp_path, world, expected):
    """Spawn `world` ranks of `_shard_worker`; `expected[num_nodes]` = (mesh shape and names, share of the decoder
    weights each rank reads)."""
    target = save_tiny_target(tmp_path / "target")
    plain = load_file(target / "model.safetensors")
    layer_bytes = sum(v.numel() * v.element_size() for k, v in plain.items() if ".layers." in k)
    layer_tensors = sum(".layers." in k for k in plain)
    mp.spawn(_shard_worker, args=(world, _free_port(), str(target), str(tmp_path)), nprocs=world)
    for rank in range(world):
        for num_nodes, (mesh, share) in expected.items():
            got = torch.load(tmp_path / f"rank{rank}-nodes{num_nodes}.pt", weights_only=True)
            assert got["on_meta"] == ["layers"] and got["real"] == ["lm_head.weight", "model.embed_tokens.weight",
                                                                    "model.norm.weight"]
            assert got["equal"] and got["logits_equal"], (rank, num_nodes)
            # one FSDP root for the whole target (every layer a root of its own: no all-gather overlaps compute)
            assert got["roots"] == ["model"] and got["resharded"], (got["roots"], got["resharded"])
            assert got["prefetch"] == [["model.layers.1"], ["model.layers.2"], ["model.layers.3"], []]
            assert got["mesh"] == mesh
            assert got["read"] == {"tensors": layer_tensors, "bytes": layer_bytes // share}, (rank, num_nodes)
            assert (got["param_dtype"], got["reduce_dtype"]) == (torch.bfloat16, torch.float32)


def test_fsdp_target_from_meta_reads_only_each_ranks_slices(tmp_path):
    """2 gloo ranks: a skeleton target (decoder layers on meta) sharded by FSDP2 and filled per rank equals the plain
    load bitwise, and each rank reads half the decoder weights (2 nodes of one rank each: still a flat mesh, a
    2-D one would replicate everything). The target has one FSDP root (its base model), its layers are resharded
    after a forward and each prefetches the next. The drafter gets bf16 params and fp32 gradient reduction
    (bf16-mixed)."""
    flat = ((2,), ("data_parallel",))
    _check_shards(tmp_path, 2, {1: (flat, 2), 2: (flat, 2)})


def test_skeleton_of_a_tied_embedding_target(tmp_path):
    """A target whose lm_head is its embedding (stored once, as Llama-3.2-1B, Qwen2.5-0.5B and SmolLM2 store it) loads
    as a skeleton: lm_head is the embedding parameter, read from the file, and the layers wait on meta (the GPU check
    found such a target loaded whole: the empty-weights init had left lm_head untied and unreadable)."""
    from eagle3_zoo.adapters.loading import load_target, load_target_skeleton

    target = save_tiny_target(tmp_path / "target", tied=True)
    assert "lm_head.weight" not in load_file(target / "model.safetensors")
    model, _, _ = load_target_skeleton(target)
    plain, _, _ = load_target(target)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, plain.lm_head.weight)
    assert {n.split(".")[1] for n, p in model.named_parameters() if p.is_meta} == {"layers"}


@pytest.mark.slow
def test_fsdp_hsdp_mesh_across_nodes(tmp_path):
    """4 gloo ranks as 2 nodes x 2: HSDP (replicated across nodes, sharded within), so each rank reads half the
    decoder weights; as one node each reads a quarter."""
    _check_shards(tmp_path, 4, {1: (((4,), ("data_parallel",)), 4), 2: (((2, 2), ("replicate", "shard")), 2)})


@pytest.mark.slow
def test_fsdp_fit_logs_the_tau_of_its_drafter(tmp_path):
    """`fit` under fsdp on 2 processes (bf16-mixed) with trainer.tau_eval measures tau during training: the figure
    logged at the last step equals one process decoding the same MT-bench prompts with the drafter the run wrote
    (the weights of that step), exactly."""
    import types

    from eagle3_zoo.adapters.loading import load_target
    from eagle3_zoo.modeling import Eagle3Drafter
    from eagle3_zoo.recipe.sections import load_recipe
    from eagle3_zoo.training.fit import _tau_eval_callbacks

    target_dir = save_tiny_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=12)
    tau_eval = {"every_n_steps": 2, "num_prompts": 2, "max_new_tokens": 8}
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, target_dir, data, trainer={
        "max_steps": 2, "batch_size": 1, "precision": "bf16-mixed", "tau_eval": tau_eval}))
    run = tmp_path / "run"
    r = run_fit_cli(recipe, "trainer.strategy=fsdp", "trainer.devices=2", f"output_dir={run}", timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = (run / "logs/version_0/metrics.csv").read_text().splitlines()
    logged = [dict(zip(rows[0].split(","), row.split(","))) for row in rows[1:]]
    taus = {int(row["step"]): float(row["val/tau"]) for row in logged if row.get("val/tau")}
    assert list(taus) == [1]  # global step 2, logged as step index 1
    target, tokenizer, adapter = load_target(target_dir)
    loaded = load_recipe(recipe)
    callback, = _tau_eval_callbacks(loaded.trainer.tau_eval, loaded.data, tokenizer)
    drafter = Eagle3Drafter.from_pretrained(run / "drafter", dtype=torch.float32)
    summary = callback.measure(types.SimpleNamespace(drafter=drafter, target=target, adapter=adapter))
    assert taus[1] == pytest.approx(summary["tau"], rel=1e-6)


def test_a_data_parallel_step_reduces_without_barriers(monkeypatch):
    """A ddp training step all_reduces twice (the supervised counts that weight the loss; the non-finite flag with
    the loss it logs) and never stops at a barrier, which would block the host until every rank gets there. Counted
    in one process: a ddp strategy over one gloo rank whose module is told the world has 2. Before: 3 barriers and
    3 all_reduces per step (Lightning's `_sync_ddp` barriers before each: `strategy.reduce` twice, `train/loss`
    logged with `sync_dist`)."""
    import lightning as L
    from transformers import LlamaForCausalLM

    from eagle3_zoo.adapters import get_adapter
    from eagle3_zoo.data.datamodule import ExampleDataset, FeatureDataModule
    from eagle3_zoo.modeling import Eagle3Config, Eagle3Drafter, build_draft_vocab
    from eagle3_zoo.training.module import DrafterModule

    adapter = get_adapter("llama")
    target = LlamaForCausalLM(adapter.tiny_config()).eval().requires_grad_(False)
    cfg = Eagle3Config.from_target_config(target.config, draft_vocab_size=64, aux_layer_ids=(1, 2, 3))
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab(*build_draft_vocab(torch.arange(512) % 7, 64))
    module = DrafterModule(drafter, adapter, target, ttt_steps=3, lr=1e-3)
    g = torch.Generator().manual_seed(1)
    examples = [{"input_ids": torch.randint(512, (int(n),), generator=g), "loss_mask": torch.ones(int(n)).long()}
                for n in torch.randint(8, 20, (6,), generator=g)]
    steps: list[list[str]] = []
    window = {"open": False}

    def counted(name, fn):
        def call(*args, **kwargs):
            if window["open"]:
                steps[-1].append(name)
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(dist, "barrier", counted("barrier", dist.barrier))
    monkeypatch.setattr(dist, "all_reduce", counted("all_reduce", dist.all_reduce))

    class Window(L.Callback):
        def on_train_start(self, trainer, pl_module):
            trainer.strategy.cluster_environment.set_world_size(2)  # the module reduces as on 2 ranks

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            steps.append([])
            window["open"] = True

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            window["open"] = False

    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    trainer = L.Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Window()], limit_val_batches=0, accelerator="cpu",
                        devices=1, strategy="ddp", use_distributed_sampler=False)
    try:
        trainer.fit(module, datamodule=FeatureDataModule(ExampleDataset(examples), ExampleDataset([]), batch_size=2))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert steps == [["all_reduce", "all_reduce"]] * 3, steps
