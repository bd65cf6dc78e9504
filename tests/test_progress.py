"""Long work shows a sign of life: a bar on a terminal, log lines with rate and ETA in a log file."""

from __future__ import annotations

import logging

from eagle3_zoo.util.progress import Progress


def test_log_lines_without_a_terminal(caplog):
    log = logging.getLogger("test-progress")
    with caplog.at_level(logging.INFO, logger="test-progress"):
        with Progress(4, "regenerating", "conv", logger=log, log_every_s=0.0, bar=False) as p:
            p.update(1, tokens=100)
            p.update(3, tokens=300)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("regenerating: 1/4 conv (25%)") and "ETA" in lines[0] and "tokens 100" in lines[0]
    assert lines[1].startswith("regenerating: 4/4 conv (100%)") and "tokens 400" in lines[1] and "ETA" not in lines[1]


def test_log_lines_are_spaced_but_the_last_one_always_comes(caplog):
    log = logging.getLogger("test-progress")
    with caplog.at_level(logging.INFO, logger="test-progress"):
        p = Progress(100, "features", "sample", logger=log, log_every_s=3600.0, bar=False)
        for _ in range(100):
            p.update(1)
    assert [r.getMessage().split(",")[0] for r in caplog.records] == ["features: 100/100 sample (100%)"]


def test_bar_on_a_terminal(capsys):
    with Progress(2, "regenerating", "conv", bar=True) as p:
        p.update(2, tokens=64)
    err = capsys.readouterr().err
    assert "regenerating" in err and "2/2" in err and "tokens/s" in err


def test_status_and_disabled(caplog):
    log = logging.getLogger("test-progress")
    with caplog.at_level(logging.INFO, logger="test-progress"):
        p = Progress(2, "eval", "request", logger=log, log_every_s=0.0, bar=False)
        p.update(1, status="mtbench, running tau 1.50")
        p.update(1)
        quiet = Progress(2, "eval", "request", logger=log, log_every_s=0.0, bar=False, enabled=False)
        quiet.update(2)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(line.endswith("elapsed") for line in lines)
    assert "mtbench, running tau 1.50" in lines[0] and "mtbench, running tau 1.50" in lines[1]  # kept until replaced


def test_a_terminal_without_columns_gets_log_lines_not_a_bar():
    """A pty of zero width (some job runners) is a tty on which a bar draws nothing: progress must log instead."""
    import fcntl
    import os
    import struct
    import termios

    from eagle3_zoo.util.progress import use_bar

    main_fd, tty_fd = os.openpty()
    try:
        with os.fdopen(tty_fd, "w", closefd=False) as tty:
            for cols, expected in ((0, False), (80, True)):
                fcntl.ioctl(tty_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, cols, 0, 0))
                assert use_bar(tty) is expected, cols
    finally:
        os.close(main_fd)
        os.close(tty_fd)
    assert use_bar(open(os.devnull, "w")) is False


def test_a_timer_writes_lines_while_no_item_completes_and_stops_when_closed(caplog):
    """Lines at the interval although `update` is not called (an item that takes many intervals), and none once
    closed (fails without the timer: no line at all before the first update)."""
    import time

    log = logging.getLogger("test-progress")
    with caplog.at_level(logging.INFO, logger="test-progress"):
        p = Progress(4, "regenerating", "conv", logger=log, log_every_s=0.1, bar=False)
        p.update(1)
        time.sleep(0.75)
        waited = [r.getMessage() for r in caplog.records]
        p.close()
        time.sleep(0.3)
    assert len(caplog.records) == len(waited)  # nothing after close
    assert len(waited) >= 4, waited
    assert all(line.startswith("regenerating: 1/4 conv (25%)") and "ETA" in line for line in waited)
    assert "s for the next conv" in waited[-1]


def test_a_rank_waiting_for_the_others_logs_at_the_interval(monkeypatch, caplog):
    """`wait_until` (a rank done with its share of regeneration or the feature job) logs every
    EAGLE3_ZOO_LOG_EVERY_S, not every 60 s whatever the setting."""
    import time

    from eagle3_zoo.data.ranks import wait_until

    monkeypatch.setenv("EAGLE3_ZOO_LOG_EVERY_S", "0.2")
    end = time.monotonic() + 0.9
    with caplog.at_level(logging.INFO, logger="eagle3_zoo.data.ranks"):
        wait_until(lambda: (int(time.monotonic() >= end), 1), "feature parts (x)", poll_s=0.05)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) >= 3 and lines[0] == "waiting for the other ranks' feature parts (x): 0 of 1 done", lines
