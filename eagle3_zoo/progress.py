"""Progress of long work (regeneration, the feature job): a live bar on a terminal, and a log line every
`log_every_s` seconds (and at the end) when output goes to a file, so CI logs and batch jobs show a sign of life."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any


def _eta(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Items done of `total` with their rate and ETA, plus extra counters (e.g. tokens).

    Args:
        total: items to do.
        desc: what is being done ("regenerating").
        unit: what an item is ("conv").
        logger: where the log lines go when there is no terminal.
        log_every_s: seconds between log lines.
        bar: force the live bar on or off (default: when stderr is a terminal).
        enabled: False shows nothing at all.
    """

    def __init__(self, total: int, desc: str, unit: str = "it", *, logger: logging.Logger | None = None,
                 log_every_s: float = 30.0, bar: bool | None = None, enabled: bool = True):
        self.total, self.desc, self.unit = total, desc, unit
        self.done, self.counters, self.status = 0, {}, ""
        self.logger = logger or logging.getLogger(__name__)
        self.log_every_s = log_every_s if enabled else float("inf")
        self.enabled = enabled
        self._start = self._last_log = time.monotonic()
        self._bar = None
        if enabled and (sys.stderr.isatty() if bar is None else bar) and total:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, file=sys.stderr)

    def update(self, n: int = 1, status: str | None = None, **counters: int) -> None:
        """`n` more items done; `counters` (e.g. tokens=512) are added up and shown with their rate; `status`
        (e.g. "tau 1.42") replaces the last one."""
        self.done += n
        if status is not None:
            self.status = status
        for key, value in counters.items():
            self.counters[key] = self.counters.get(key, 0) + value
        now = time.monotonic()
        if self._bar is not None:
            elapsed = max(now - self._start, 1e-9)
            postfix = {f"{k}/s": f"{v / elapsed:.0f}" for k, v in self.counters.items()}
            items = [f"{k}={v}" for k, v in postfix.items()] + ([self.status] if self.status else [])
            self._bar.set_postfix_str(", ".join(items), refresh=False)
            self._bar.update(n)
        elif self.enabled and (now - self._last_log >= self.log_every_s or self.done >= self.total):
            self._last_log = now
            self.logger.info("%s", self.line())

    def line(self) -> str:
        """`regenerating: 64/128 conv (50%), 0.8 conv/s, tokens 8192 (102/s), ETA 0:01:20, 80 s elapsed`."""
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rate = self.done / elapsed
        parts = [f"{self.desc}: {self.done}/{self.total} {self.unit} ({self.done / max(self.total, 1):.0%})",
                 f"{rate:.2f} {self.unit}/s"]
        parts += [f"{k} {v} ({v / elapsed:.0f}/s)" for k, v in self.counters.items()]
        if self.status:
            parts.append(self.status)
        if rate > 0 and self.done < self.total:
            parts.append(f"ETA {_eta((self.total - self.done) / rate)}")
        parts.append(f"{elapsed:.0f} s elapsed")
        return ", ".join(parts)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
