"""A loopback OpenAI-compatible server for tests, with fault injection.

`/v1/completions` answers deterministically from the prompt (a prompt of token ids [.., a, b] gets the reply
[b+1, b+2, ...] up to `max_tokens`, ending with a stop id when `stop_after` tokens are reached), so a test knows the
expected text without a model. `faults` is a list of HTTP status codes returned, in order, by the next completion
requests (e.g. [429, 500]); `delay` sleeps before every completion (timeouts). `/metrics` serves `metrics_text`.

Misbehaviour for the safety tests: `answer` replaces every completion's body (a JSON value, or raw bytes);
`redirect = (status, location)` answers every request to `redirect_path` (default: the completions path) with that
redirect; `trickle` sends the body one byte per `trickle` seconds; `echo_auth` answers completions with HTTP 400 whose
body quotes the request's Authorization header. `requests` logs (method, path) of every request. `hidden_states_dir`
makes it a hidden-states server: every completion writes a file there and names it (`kv_transfer_params`).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


class FakeOpenAIServer:
    def __init__(self, *, stop_after: int = 5, stop_id: int = 2, model: str = "fake-model",
                 generate: Any = None, port: int = 0) -> None:
        self.stop_after, self.stop_id, self.model = stop_after, stop_id, model
        self.generate = generate  # (prompt ids, max_tokens, stop ids) -> reply ids: a real model behind the API
        self.faults: list[int] = []
        self.delay = 0.0
        self.metrics_text = ""
        self.completions: list[dict[str, Any]] = []  # successful completion payloads, in order
        self.headers: list[dict[str, str]] = []
        self.fail_after: int | None = None  # refuse (HTTP 503) every completion after this many successes
        self.answer: Any = None
        self.redirect: tuple[int, str] | None = None
        self.redirect_path = "/v1/completions"
        self.trickle = 0.0
        self.echo_auth = False
        self.requests: list[tuple[str, str]] = []
        # a hidden-states server: each completion writes a file (and its lock) here, named in kv_transfer_params
        self.hidden_states_dir: Any = None
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def reply_ids(self, prompt: list[int], max_tokens: int) -> list[int]:
        n = min(max_tokens, self.stop_after)
        ids = [(prompt[-1] + 1 + i) % 1000 + 3 for i in range(n)]
        return ids + ([self.stop_id] if n < max_tokens else [])

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: Any, ctype: str = "application/json") -> None:
                data = body if isinstance(body, bytes) else body.encode() if isinstance(body, str) else \
                    json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not fake.trickle:
                    self.wfile.write(data)
                    return
                for i in range(len(data)):  # one byte at a time: each read is quick, the answer never ends in time
                    try:
                        self.wfile.write(data[i : i + 1])
                        self.wfile.flush()
                    except OSError:  # the client gave up
                        return
                    time.sleep(fake.trickle)

            def _redirected(self) -> bool:
                with fake._lock:
                    fake.requests.append((self.command, self.path))
                if fake.redirect is None or self.path != fake.redirect_path:
                    return False
                self.send_response(fake.redirect[0])
                self.send_header("Location", fake.redirect[1])
                self.send_header("Content-Length", "0")
                self.end_headers()
                return True

            def do_GET(self) -> None:
                if self._redirected():
                    return
                if self.path == "/health":
                    self._send(200, "")
                elif self.path == "/v1/models":
                    self._send(200, {"data": [{"id": fake.model}]})
                elif self.path == "/metrics":
                    self._send(200, fake.metrics_text, "text/plain")
                else:
                    self._send(404, {"error": self.path})

            def do_POST(self) -> None:
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self._redirected():
                    return
                with fake._lock:
                    fake.headers.append(dict(self.headers))
                    fault = fake.faults.pop(0) if fake.faults else None
                    refused = fake.fail_after is not None and len(fake.completions) >= fake.fail_after
                if fault is not None or refused:
                    self._send(fault or 503, {"error": {"message": "injected fault"}})
                    return
                if self.path != "/v1/completions":
                    self._send(400, {"error": {"message": f"unsupported {self.path}"}})
                    return
                if fake.echo_auth:
                    self._send(400, {"error": {"message": f"bad key {self.headers.get('Authorization')}"}})
                    return
                time.sleep(fake.delay)
                if fake.answer is not None:
                    with fake._lock:
                        fake.completions.append(payload)
                    self._send(200, fake.answer)
                    return
                if fake.generate is not None:
                    with fake._lock:
                        ids = fake.generate(list(payload["prompt"]), int(payload["max_tokens"]),
                                            list(payload.get("stop_token_ids") or []))
                else:
                    ids = fake.reply_ids(list(payload["prompt"]), int(payload["max_tokens"]))
                with fake._lock:
                    fake.completions.append(payload)
                text = " ".join(f"t{i}" for i in ids if i != fake.stop_id)
                body: dict[str, Any] = {"choices": [{"index": 0, "text": text, "token_ids": ids,
                                                     "finish_reason": "stop" if ids and ids[-1] == fake.stop_id
                                                     else "length"}]}
                if fake.hidden_states_dir is not None:
                    path = Path(fake.hidden_states_dir) / f"cmpl-{uuid.uuid4().hex}-0.safetensors"
                    path.write_bytes(b"states")
                    path.with_name(path.name + ".lock").touch()
                    body["kv_transfer_params"] = {"hidden_states_path": f"/server/side/{path.name}"}
                self._send(200, body)

        return Handler

    def __enter__(self) -> FakeOpenAIServer:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
