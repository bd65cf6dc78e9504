"""A small HTTP client for OpenAI-compatible servers (vLLM, SGLang, ...), standard library only.

Transient failures (connection refused or reset, timeouts, HTTP 429 and 5xx) are retried with exponential backoff;
when the retries are spent the error names the URL, the last failure and how many attempts were made. Other HTTP
errors (400: a bad request) are raised at once with the server's message.

What the client refuses, so that no key leaks and no request silently changes meaning:

- a `base_url` with credentials in it (``http://user:password@host``): they would end up in logs and errors;
- a redirect to another origin (scheme, host, port): the API key would be sent there; and a 301/302/303 redirect
  of a POST, which turns it into a GET without its body;
- an answer that is not UTF-8 JSON of the expected shape (`BadAnswerError`, naming the URL).

`timeout` is a deadline for the whole request (connect, send, the complete answer), not per socket read: a server
that trickles its answer one byte at a time is cut off when it is spent. No message ever holds the API key.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

from eagle3_zoo.values.locations import env_name_problem, redact_url, url_problem

logger = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
REDIRECT_STATUS = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 5


class ServerError(ConnectionError):
    """The server could not be reached or kept failing (after retries), or refused the request."""


class BadAnswerError(ServerError):
    """The server answered, but not with what the request asks for (not JSON, missing or mistyped fields)."""


class _Transient(Exception):
    """A failure worth retrying (no answer in time, connection trouble, HTTP 429/5xx); its text is the reason."""


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(parts.scheme)


@dataclass
class OpenAIClient:
    """Requests to one server.

    Attributes:
        base_url: the server root, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted and dropped).
        api_key_env: name of the environment variable holding the API key (None = no key sent).
        timeout: seconds one request may take in all (connect, send, the whole answer), > 0.
        retries: further attempts after a transient failure, >= 0.
        backoff: seconds before the first retry; doubled each time.

    Raises:
        ValueError: a bad `base_url` (credentials in it included), `timeout`, `retries` or `backoff`, or an
            `api_key_env` that is not set (or not a variable name).
    """

    base_url: str
    api_key_env: str | None = None
    timeout: float = 600.0
    retries: int = 4
    backoff: float = 1.0

    def __post_init__(self) -> None:
        if problem := url_problem(self.base_url):
            raise ValueError(f"server URL {redact_url(self.base_url)}: {problem}")
        self.base_url = self.base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[: -len("/v1")]
        for name, value, ok, valid in (
                ("timeout", self.timeout, lambda v: v > 0 and math.isfinite(v), "a number of seconds > 0"),
                ("retries", self.retries, lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
                ("backoff", self.backoff, lambda v: v >= 0 and math.isfinite(v), "a number of seconds >= 0")):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ValueError(f"server client for {self.base_url}: {name} = {value!r}; expected {valid}")
        if self.api_key_env and (problem := env_name_problem(self.api_key_env)):
            raise ValueError(f"api_key_env {problem}")
        if self.api_key_env and not os.environ.get(self.api_key_env):
            raise ValueError(f"the API key variable {self.api_key_env} is not set in the environment (set it, or "
                             "set api_key_env to null for a server without a key)")

    def _key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    def scrub(self, text: str) -> str:
        """`text` with the API key (if any) replaced by ``***``: for every message that may quote the server."""
        key = self._key()
        return text.replace(key, "***") if key else text

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if key := self._key():
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def request(self, path: str, payload: dict[str, Any] | None = None, *, retries: int | None = None,
                timeout: float | None = None) -> bytes:
        """GET (`payload` None) or POST JSON to `path`; the response body.

        Raises:
            ServerError: unreachable / transient failures after all retries, a non-retryable HTTP error, or a
                redirect that is refused (another origin; a POST turned into a GET).
        """
        url = self.base_url + path
        data = None if payload is None else json.dumps(payload).encode()
        retries = self.retries if retries is None else retries
        last = ""
        for attempt in range(retries + 1):
            if attempt:
                delay = self.backoff * 2 ** (attempt - 1)
                logger.warning("%s: %s; retry %d/%d in %.1f s", url, last, attempt, retries, delay)
                time.sleep(delay)
            try:
                return self._follow(url, data, timeout or self.timeout)
            except _Transient as e:
                last = self.scrub(str(e))
        raise ServerError(f"{url}: {last} ({retries + 1} attempts); is the server at {self.base_url} running?")

    def _follow(self, url: str, data: bytes | None, timeout: float) -> bytes:
        """One attempt, following same-origin redirects that keep the request as it is, within one deadline."""
        deadline, method = time.monotonic() + timeout, "GET" if data is None else "POST"
        for _ in range(MAX_REDIRECTS + 1):
            status, location, body = self._exchange(method, url, data, deadline, timeout)
            if status in REDIRECT_STATUS:
                url = self._redirect(url, location, status, method)
                continue
            if status >= 400:
                text = self.scrub(body.decode(errors="replace")[:300])
                if status in RETRYABLE_STATUS:
                    raise _Transient(f"HTTP {status}: {text}")
                raise ServerError(f"{url}: HTTP {status}: {text}")
            return body
        raise ServerError(f"{url}: more than {MAX_REDIRECTS} redirects; point the URL at the server itself")

    def _redirect(self, url: str, location: str | None, status: int, method: str) -> str:
        """The URL a redirect leads to, if it may be followed (same origin; a POST only by 307/308)."""
        if not location:
            raise ServerError(f"{url}: HTTP {status} redirect without a Location header")
        target = urljoin(url, location)
        if _origin(target) != _origin(self.base_url) or url_problem(target):
            why = "the API key would be sent there" if self._key() else "requests go to the configured server only"
            raise ServerError(f"{url}: HTTP {status} redirect to another origin ({self.scrub(redact_url(target))}) "
                              f"not followed ({why}); if that server is the one to use, set the URL to it")
        if method == "POST" and status not in (307, 308):
            raise ServerError(f"{url}: HTTP {status} redirect of a POST to {self.scrub(redact_url(target))} not "
                              "followed (it would turn the POST into a GET without its body); set the URL to the "
                              "final server root")
        return target

    def _exchange(self, method: str, url: str, data: bytes | None, deadline: float,
                  timeout: float) -> tuple[int, str | None, bytes]:
        """One HTTP exchange: (status, Location header, the whole body), all of it before `deadline`.

        A watchdog shuts the socket down when the deadline passes, so a server that trickles its answer (each read
        within the per-read timeout) cannot hold the request open forever.
        """
        remaining = deadline - time.monotonic()
        late = f"no complete answer within {timeout:g} s (the deadline of one request)"
        if remaining <= 0:
            raise _Transient(late)
        parts = urlsplit(url)
        conn: http.client.HTTPConnection = (
            http.client.HTTPSConnection(parts.hostname, parts.port, timeout=remaining,
                                        context=ssl.create_default_context())
            if parts.scheme == "https" else http.client.HTTPConnection(parts.hostname, parts.port, timeout=remaining))
        expired, sockets = threading.Event(), []

        def expire() -> None:
            expired.set()
            for sock in sockets:  # the response keeps reading from it after the connection hands it over
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked read in the requesting thread
                except OSError:
                    pass

        watchdog = threading.Timer(remaining, expire)
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.connect()
            sockets.append(conn.sock)
            if expired.is_set():  # the deadline passed while connecting
                raise _Transient(late)
            target = parts.path + (f"?{parts.query}" if parts.query else "")
            conn.request(method, target or "/", body=data, headers=self._headers())
            resp = conn.getresponse()
            body = resp.read()
            if expired.is_set():
                raise _Transient(late)
            return resp.status, resp.getheader("Location"), body
        except (OSError, http.client.HTTPException) as e:
            if expired.is_set() or isinstance(e, TimeoutError):
                raise _Transient(late) from None
            raise _Transient(f"{type(e).__name__}: {e}") from None
        finally:
            watchdog.cancel()
            conn.close()

    def decode_json(self, path: str, body: bytes) -> dict[str, Any]:
        """The JSON object of an answer from `path`.

        Raises:
            BadAnswerError: not UTF-8, not JSON, or not a JSON object (naming the URL).
        """
        url = self.base_url + path
        try:
            value = json.loads(body.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise BadAnswerError(f"{url}: the answer is not UTF-8 text (byte 0x{body[e.start]:02x} at offset "
                                 f"{e.start}); is {self.base_url} an OpenAI-compatible server?") from None
        except json.JSONDecodeError as e:
            start = self.scrub(body[:60].decode(errors="replace"))
            raise BadAnswerError(f"{url}: the answer is not JSON ({e.msg} at line {e.lineno} column {e.colno}; it "
                                 f"starts with {start!r}); is {self.base_url} an OpenAI-compatible server?") from None
        if not isinstance(value, dict):
            raise BadAnswerError(f"{url}: expected a JSON object, got a JSON {type(value).__name__}")
        return value

    def post(self, path: str, payload: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        """POST `payload` as JSON; the decoded JSON object of the answer."""
        return self.decode_json(path, self.request(path, payload, **kwargs))

    def completion(self, payload: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        """POST to ``/v1/completions``; the first choice (an object).

        Raises:
            BadAnswerError: the answer has no ``choices`` list holding an object.
        """
        return self.first_choice(self.post("/v1/completions", payload, **kwargs))

    def first_choice(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The first choice (an object) of a ``/v1/completions`` answer.

        Raises:
            BadAnswerError: the answer has no ``choices`` list holding an object.
        """
        choices = answer.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            found = f"{type(choices).__name__} {self.scrub(str(choices))[:80]}" if "choices" in answer else \
                f"no 'choices' (keys: {', '.join(map(str, list(answer)[:8])) or 'none'})"
            raise BadAnswerError(f"{self.base_url}/v1/completions: expected 'choices' to be a non-empty list of "
                                 f"objects, got {found}")
        return choices[0]

    def healthy(self, timeout: float = 5.0) -> bool:
        """Whether ``/health`` answers 200 now (one attempt)."""
        try:
            self.request("/health", retries=0, timeout=timeout)
            return True
        except ServerError:
            return False

    def check(self) -> None:
        """Raise a clear error naming the URL when the server is down.

        Raises:
            ServerError: ``/v1/models`` does not answer.
        """
        try:
            self.request("/v1/models", retries=0, timeout=min(self.timeout, 30.0))
        except ServerError as e:
            raise ServerError(f"no OpenAI-compatible server answers at {self.base_url} ({e})") from None

    def models(self) -> list[str]:
        """Ids of the served models (``/v1/models``), at least one.

        Raises:
            BadAnswerError: the answer lists no model, or not as ``{"data": [{"id": ...}, ...]}``.
        """
        data = self.decode_json("/v1/models", self.request("/v1/models")).get("data")
        ids = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        if not ids or not all(isinstance(i, str) and i for i in ids):
            raise BadAnswerError(f"{self.base_url}/v1/models: expected {{\"data\": [{{\"id\": NAME}}, ...]}} with at "
                                 "least one served model")
        return ids

    def metrics(self) -> str:
        """The Prometheus text of ``/metrics``."""
        return self.request("/metrics").decode(errors="replace")
