"""Progress of long work (regeneration, the feature job, training, evaluation): a live bar on a terminal, and a log
line every `log_every_s` seconds (and at the end) otherwise, so CI logs and batch jobs show a sign of life.

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
        log_every_s: seconds between log lines.
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
        self._start = self._last_log = time.monotonic()
        self._bar = None
        if enabled and (use_bar() if bar is None else bar) and total:
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
