"""A loopback stand-in for a vLLM hidden-states server (`extract_hidden_states` + a connector), for the default tier.

`/v1/completions` with a prompt of token ids writes what vLLM's connector writes, `<storage>/cmpl-<request id>-0-
<suffix>.safetensors` with `hidden_states [T, L, H]` and `token_ids` (plus its `.lock` file), and answers with its
path in `kv_transfer_params.hidden_states_path`. The states come from `states(ids)`: `tiny_states` runs a real tiny
HF model the way vLLM does (the residual stream entering each aux layer, and the last layer's output before the final
norm). `faults` (HTTP status codes) are returned by the next completions, in order; `stop()` closes the port
(connection refused, as a killed server) and `start()` serves again on the same port. `tamper(answer, file)` may
rewrite an answer (and its file) before it is sent: a lying server; `api_key` makes it refuse (401) a request
without `Authorization: Bearer <key>`, as vLLM with VLLM_API_KEY does on its /v1 routes.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def tiny_states(model: Any, aux_layer_ids: tuple[int, ...]) -> Callable[[list[int]], torch.Tensor]:
    """`ids -> [T, len(aux) + 1, H]` of an HF causal LM, as vLLM's extract_hidden_states returns them."""
    lock = threading.Lock()  # one forward at a time: the hook is the model's, the server answers in threads

    def states(ids: list[int]) -> torch.Tensor:
        captured = {}
        with lock, torch.no_grad():
            hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: captured.update(last=o))
            try:
                out = model(torch.tensor([ids]), output_hidden_states=True)
            finally:
                hook.remove()
        last = captured["last"][0] if isinstance(captured["last"], tuple) else captured["last"]
        return torch.stack([out.hidden_states[k][0] for k in aux_layer_ids] + [last[0]], dim=1)

    return states


class FakeHiddenStatesServer:
    def __init__(self, states: Callable[[list[int]], torch.Tensor], storage: Path, model: str = "fake-target",
                 port: int = 0, api_key: str | None = None) -> None:
        self.states, self.storage, self.model = states, Path(storage), model
        self.api_key = api_key
        self.tamper: Callable[[dict[str, Any], Path], dict[str, Any]] | None = None
        self.authorizations: list[str | None] = []  # the Authorization header of every /v1 request
        self.storage.mkdir(parents=True, exist_ok=True)
        self.faults: list[int] = []
        self.delay = 0.0
        self.request_ids: list[str] = []  # answered completions, in order
        self.files_seen: list[int] = []  # hidden-state files in `storage` when each answer is written
        self.on_request: Callable[[int], None] | None = None  # called with the number of answers so far
        # dies (this request and every later one unanswered) at the first request whose id it holds true for
        self.dies_at: Callable[[str], bool] | None = None
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self.port = port
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeHiddenStatesServer:
        self.dead = self.died_at_rule = False
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Die: requests in flight get no answer (the connection drops), new ones are refused."""
        self.dead = True
        with self._lock:  # a dying answer's thread and the test may both stop it
            server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def __enter__(self) -> FakeHiddenStatesServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _complete(self, payload: dict[str, Any]) -> dict[str, Any]:
        ids = [int(i) for i in payload["prompt"]]
        hidden = self.states(ids)
        request = payload.get("request_id") or uuid.uuid4().hex
        name = self.storage / f"cmpl-{request}-0-{uuid.uuid4().hex[:8]}.safetensors"
        Path(f"{name}.lock").touch()
        save_file({"hidden_states": hidden.contiguous(), "token_ids": torch.tensor(ids)}, str(name))
        with self._lock:
            self.request_ids.append(str(payload.get("request_id")))
            self.files_seen.append(len(list(self.storage.glob("*.safetensors"))))
            count = len(self.request_ids)
        if self.on_request is not None:
            self.on_request(count)
        answer = {"choices": [{"index": 0, "text": "x", "token_ids": [ids[-1]], "finish_reason": "length"}],
                  "kv_transfer_params": {"hidden_states_path": str(name)}}
        return self.tamper(answer, name) if self.tamper is not None else answer

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _refused(self) -> bool:
                header = self.headers.get("Authorization")
                if self.path.startswith("/v1"):
                    fake.authorizations.append(header)
                if fake.api_key is None or not self.path.startswith("/v1") or header == f"Bearer {fake.api_key}":
                    return False
                self._send(401, {"error": "Unauthorized"})
                return True

            def do_GET(self) -> None:
                if self._refused():
                    return
                if self.path == "/health":
                    self._send(200, {})
                elif self.path == "/v1/models":
                    self._send(200, {"data": [{"id": fake.model}]})
                else:
                    self._send(404, {"error": self.path})

            def do_POST(self) -> None:
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self._refused():
                    return
                with fake._lock:
                    fault = fake.faults.pop(0) if fake.faults else None
                    if fake.dies_at is not None and not fake.dead and fake.dies_at(str(payload.get("request_id"))):
                        fake.dies_at, fake.dead, fake.died_at_rule = None, True, True
                        threading.Thread(target=fake.stop).start()  # its port closes: later requests are refused
                    admitted = not fake.dead
                if fault is not None:
                    self._send(fault, {"error": {"message": "injected fault"}})
                    return
                time.sleep(fake.delay)
                # killed while this request was in flight (one admitted before a `dies_at` death is answered, so
                # that such a server answers exactly the requests before the one it dies at)
                if fake.dead and not (admitted and fake.died_at_rule):
                    self.close_connection = True
                    return
                self._send(200, fake._complete(payload))

        return Handler
