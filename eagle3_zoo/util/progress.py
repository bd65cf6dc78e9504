"""Progress of long work (regeneration, the feature job, training, evaluation): a live bar on a terminal, and a log
line every `log_every_s` seconds (and at the end) otherwise, so CI logs and batch jobs show a sign of life. The lines
of `Progress` come from a timer, not only when an item completes: one item can take many minutes (a batch of 64
conversations answered by a CPU target under load), and the line still comes, saying how long the current item has
been waited for.

"A terminal" means one a bar can be drawn on: stderr is a tty *with columns* (a pty of zero width, as some job
runners give, would draw nothing at all). Without one, the bars of Hugging Face libraries are off too (they would
print a line per refresh into log files), and while a bar is drawn, log records are written above it instead of
through it (`bars_and_logs`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any, TextIO

LOG_EVERY_S = 30.0  # seconds between progress lines in a log file (docs/performance.md: "a log line ... every 30 s")
LOG_EVERY_ENV = "EAGLE3_ZOO_LOG_EVERY_S"  # overrides it (0: a line per step / item)


def progress_interval_s() -> float:
    """Seconds between progress lines in a log file: `EAGLE3_ZOO_LOG_EVERY_S` if set, else 30.

    Raises:
        ValueError: the variable is not a number of seconds >= 0.
    """
    raw = os.environ.get(LOG_EVERY_ENV, "").strip()
    if not raw:
        return LOG_EVERY_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{LOG_EVERY_ENV}={raw!r}: expected a number of seconds >= 0 (0: a line per step)")
    return value


def _eta(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def use_bar(stream: TextIO | None = None) -> bool:
    """Whether a live bar can be drawn on `stream` (default stderr): a terminal that reports a non-zero width."""
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):  # no fileno (captured), or not a terminal after all
        return False


class _NotLightningTip(logging.Filter):
    """Lightning advertises its cloud logger at every Trainer start; that line is no progress of this run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def quiet_third_party_output() -> None:
    """Keep what other libraries print to what a user needs: no Hugging Face bars without a terminal, no Lightning
    advert, no deprecation warning about Lightning's own use of torch internals (nothing a user can change).
    Call before those libraries are imported (the settings are read then)."""
    if not use_bar():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # huggingface_hub's and transformers' bars
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NotLightningTip) for f in logger.filters):
            logger.addFilter(_NotLightningTip())
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")


@contextlib.contextmanager
def bars_and_logs() -> Iterator[None]:
    """While live bars may be drawn, write the console's log records above them (tqdm.write) instead of into them."""
    if not use_bar():
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in ("lightning", "lightning.pytorch"))]
    with logging_redirect_tqdm(loggers=loggers):
        yield


class Progress:
    """Items done of `total` with their rate and ETA, plus extra counters (e.g. tokens).

    Args:
        total: items to do.
        desc: what is being done ("regenerating").
        unit: what an item is ("conv").
        logger: where the log lines go when there is no terminal.
        log_every_s: seconds between log lines (a background timer writes them while no item completes; 0: a line
            per update, no timer).
        bar: force the live bar on or off (default: `use_bar()`).
        enabled: False shows nothing at all.
    """

    def __init__(self, total: int, desc: str, unit: str = "it", *, logger: logging.Logger | None = None,
                 log_every_s: float | None = None, bar: bool | None = None, enabled: bool = True):
        log_every_s = progress_interval_s() if log_every_s is None else log_every_s
        self.total, self.desc, self.unit = total, desc, unit
        self.done, self.counters, self.status = 0, {}, ""
        self.logger = logger or logging.getLogger(__name__)
        self.log_every_s = log_every_s if enabled else float("inf")
        self.enabled = enabled
        self._start = self._last_log = self._last_update = time.monotonic()
        self._bar = None
        self._lock = threading.Lock()  # `update` (the worker) and the timer both read and write the counts
        self._closed = threading.Event()
        if enabled and (use_bar() if bar is None else bar) and total:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, file=sys.stderr)
        elif enabled and 0 < self.log_every_s < float("inf") and total:
            threading.Thread(target=self._timer, name=f"progress: {desc}", daemon=True).start()

    def update(self, n: int = 1, status: str | None = None, **counters: int) -> None:
        """`n` more items done; `counters` (e.g. tokens=512) are added up and shown with their rate; `status`
        (e.g. "tau 1.42") replaces the last one."""
        with self._lock:
            self.done += n
            if status is not None:
                self.status = status
            for key, value in counters.items():
                self.counters[key] = self.counters.get(key, 0) + value
            now = self._last_update = time.monotonic()
            due = now - self._last_log >= self.log_every_s or self.done >= self.total
            if due:
                self._last_log = now
        if self._bar is not None:
            elapsed = max(now - self._start, 1e-9)
            postfix = {f"{k}/s": f"{v / elapsed:.0f}" for k, v in self.counters.items()}
            items = [f"{k}={v}" for k, v in postfix.items()] + ([self.status] if self.status else [])
            self._bar.set_postfix_str(", ".join(items), refresh=False)
            self._bar.update(n)
        elif self.enabled and due:
            self.logger.info("%s", self.line())

    def _timer(self) -> None:
        """A line every `log_every_s` seconds in which no update wrote one, until closed or done."""
        while not self._closed.wait(max(self._last_log + self.log_every_s - time.monotonic(), 0.01)):
            with self._lock:  # held while logging: once `close` returns, no line comes
                if self.done >= self.total or self._closed.is_set():
                    return
                if time.monotonic() - self._last_log >= self.log_every_s:
                    self._last_log = time.monotonic()
                    self.logger.info("%s", self.line())

    def line(self) -> str:
        """`regenerating: 64/128 conv (50%), 0.8 conv/s, tokens 8192 (102/s), ETA 0:01:20, 80 s elapsed`; a line
        written while the current item has taken longer than `log_every_s` says so (`waiting 95 s for the next
        conv`)."""
        now = time.monotonic()
        elapsed = max(now - self._start, 1e-9)
        rate = self.done / elapsed
        parts = [f"{self.desc}: {self.done}/{self.total} {self.unit} ({self.done / max(self.total, 1):.0%})",
                 f"{rate:.2f} {self.unit}/s"]
        parts += [f"{k} {v} ({v / elapsed:.0f}/s)" for k, v in self.counters.items()]
        if self.status:
            parts.append(self.status)
        if rate > 0 and self.done < self.total:
            parts.append(f"ETA {_eta((self.total - self.done) / rate)}")
        if self.done < self.total and 0 < self.log_every_s <= now - self._last_update:
            parts.append(f"waiting {now - self._last_update:.0f} s for the next {self.unit}")
        parts.append(f"{elapsed:.0f} s elapsed")
        return ", ".join(parts)

    def close(self) -> None:
        with self._lock:
            self._closed.set()  # the timer stops
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
