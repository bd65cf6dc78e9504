"""A small HTTP client for OpenAI-compatible servers (vLLM, SGLang, ...), standard library only.

Transient failures (connection refused or reset, timeouts, HTTP 429 and 5xx) are retried with exponential backoff;
when the retries are spent the error names the URL, the last failure and how many attempts were made. Other HTTP
errors (400: a bad request) are raised at once with the server's message.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class ServerError(ConnectionError):
    """The server could not be reached or kept failing (after retries), or refused the request."""


@dataclass
class OpenAIClient:
    """Requests to one server.

    Attributes:
        base_url: the server root, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted and dropped).
        api_key_env: name of the environment variable holding the API key (None = no key sent).
        timeout: seconds per request.
        retries: further attempts after a transient failure.
        backoff: seconds before the first retry; doubled each time.
    """

    base_url: str
    api_key_env: str | None = None
    timeout: float = 600.0
    retries: int = 4
    backoff: float = 1.0

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[: -len("/v1")]
        if self.api_key_env and not os.environ.get(self.api_key_env):
            raise ValueError(f"the API key variable {self.api_key_env} is not set in the environment (set it, or "
                             "set api_key_env to null for a server without a key)")

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key_env:
            headers["Authorization"] = f"Bearer {os.environ[self.api_key_env]}"
        return headers

    def request(self, path: str, payload: dict[str, Any] | None = None, *, retries: int | None = None,
                timeout: float | None = None) -> bytes:
        """GET (`payload` None) or POST JSON to `path`; the response body.

        Raises:
            ServerError: unreachable / transient failures after all retries, or a non-retryable HTTP error.
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
            req = urllib.request.Request(url, data=data, headers=self._headers(), method="GET" if data is None
                                         else "POST")
            try:
                with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                    return resp.read()
            except urllib.error.HTTPError as e:
                body = e.read().decode(errors="replace")[:300]
                if e.code not in RETRYABLE_STATUS:
                    raise ServerError(f"{url}: HTTP {e.code}: {body}") from None
                last = f"HTTP {e.code}: {body}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                reason = getattr(e, "reason", e)
                last = f"{type(reason).__name__}: {reason}"
        raise ServerError(f"{url}: {last} ({retries + 1} attempts); is the server at {self.base_url} running?")

    def post(self, path: str, payload: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        """POST `payload` as JSON; the decoded JSON response."""
        return json.loads(self.request(path, payload, **kwargs))

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
        """Ids of the served models (``/v1/models``)."""
        return [m["id"] for m in json.loads(self.request("/v1/models")).get("data", [])]

    def metrics(self) -> str:
        """The Prometheus text of ``/metrics``."""
        return self.request("/metrics").decode()
