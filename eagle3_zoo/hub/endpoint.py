"""The Hub endpoint: which URL requests go to, and a fast probe of whether it answers at all. Publish and pull both
probe it first, so that with no network they fail within `PROBE_TIMEOUT_S` seconds with one line naming the endpoint
(a `HubUnreachableError`) instead of an HTTP client traceback after the client's own retries and timeouts.
"""

from __future__ import annotations

import os
import threading

PROBE_TIMEOUT_S = 5.0  # seconds an unreachable Hub may take to fail (DNS included): fail fast, not after retries
# base classes of "no answer at all" errors in the HTTP clients huggingface_hub uses (httpx, older: requests)
_TRANSPORT_ERRORS = {"TransportError", "ConnectionError", "Timeout", "TimeoutException"}


class HubUnreachableError(ConnectionError):
    """The Hub endpoint did not answer (no network, DNS, proxy, firewall, wrong `--endpoint`)."""


def resolve_endpoint(endpoint: str | None) -> str | None:
    """`endpoint`, else `HF_ENDPOINT` read now (huggingface_hub reads it once, at import time)."""
    return endpoint or os.environ.get("HF_ENDPOINT") or None


def hub_url(endpoint: str | None) -> str:
    """The URL requests go to: `resolve_endpoint(endpoint)`, else huggingface_hub's default."""
    from huggingface_hub import constants

    return (resolve_endpoint(endpoint) or constants.ENDPOINT).rstrip("/")


def unreachable_error(url: str, cause: BaseException | str) -> HubUnreachableError:
    """One line: which endpoint did not answer, why, and what to do."""
    if not isinstance(cause, str):
        first_line = next(iter(str(cause).splitlines()), "")
        cause = f"{type(cause).__name__}: {first_line}" if first_line else type(cause).__name__
    return HubUnreachableError(f"Hub endpoint {url} is not reachable ({cause}); check the network or "
                               "proxy (HTTPS_PROXY), or pass --endpoint / set HF_ENDPOINT to a reachable Hub")


def is_transport_error(error: BaseException) -> bool:
    """Whether `error` means no answer came back (refused, DNS, timeout), as opposed to an HTTP error status."""
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    return any(c.__name__ in _TRANSPORT_ERRORS and c.__module__.split(".")[0] in ("httpx", "httpx2", "requests")
               for c in type(error).__mro__)


def require_reachable(endpoint: str | None, timeout: float | None = None) -> str:
    """Return the Hub URL if it answers an HTTP request within `timeout` seconds (default `PROBE_TIMEOUT_S`; any
    status counts as an answer), else raise.

    The probe runs in a daemon thread joined with a deadline: the client's connect timeout does not cover DNS.

    Raises:
        HubUnreachableError: no answer (or `HF_HUB_OFFLINE` is set).
    """
    from huggingface_hub import constants, get_session

    url = hub_url(endpoint)
    timeout = PROBE_TIMEOUT_S if timeout is None else timeout
    if constants.HF_HUB_OFFLINE:
        raise unreachable_error(url, "HF_HUB_OFFLINE is set")
    outcome: dict[str, BaseException | None] = {}

    def probe() -> None:
        try:
            get_session().head(url, timeout=timeout)  # no token: an anonymous request is enough to see an answer
            outcome["error"] = None
        except Exception as e:  # any failure to get an answer means unreachable
            outcome["error"] = e

    thread = threading.Thread(target=probe, name="eagle3-zoo-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if "error" not in outcome:
        raise unreachable_error(url, f"no answer within {timeout:g} s")
    if outcome["error"] is not None:
        raise unreachable_error(url, outcome["error"])
    return url
