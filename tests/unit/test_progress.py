"""crag.progress on a fake terminal, a log file, and off."""

from __future__ import annotations

import io
import re

from crag.progress import ProgressReporter


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_one_bar_is_redrawn_in_place():
    terminal = FakeTerminal()
    with ProgressReporter(terminal).start(10) as progress:
        progress.advance(4)
        progress.advance(6)
    out = terminal.getvalue()
    frames = [f for f in out.split("\r") if f]
    assert frames[0].startswith("crag: 0/10 questions |")
    assert re.fullmatch(r"crag: 10/10 questions \|.+\| 100% \[\d\d:\d\d<00:00, [\d.]+ questions/s\]\n", frames[-1])
    assert out.count("\n") == 1  # the bar stays, on its own line, when it closes


def test_not_a_terminal_means_off():
    log = io.StringIO()
    progress = ProgressReporter(log).start(10)
    progress.advance(10)
    progress.close()
    assert not progress.enabled and log.getvalue() == ""
    terminal = FakeTerminal()
    ProgressReporter(terminal, enabled=False).start(5).advance(5)
    assert terminal.getvalue() == ""


def test_forced_on_a_log_it_writes_a_line_per_batch_with_rate_and_time_left():
    log = io.StringIO()
    clock = iter([100.0, 110.0, 120.0]).__next__  # start, then one batch every 10 s
    progress = ProgressReporter(log, enabled=True, clock=clock).start(100, done=20)  # a resumed run: 20 done before
    progress.advance(30)
    progress.advance(30)
    progress.close()
    assert log.getvalue().splitlines() == [
        "crag: 50/100 questions (50%), 3.00 questions/s, 00:10 elapsed, 00:16 left",  # 30 in 10 s; 50 left
        "crag: 80/100 questions (80%), 3.00 questions/s, 00:20 elapsed, 00:06 left",
    ]
    assert "\r" not in log.getvalue()
    slow = io.StringIO()
    clock = iter([0.0, 40.0, 440.0]).__next__
    progress = ProgressReporter(slow, enabled=True, clock=clock).start(100)
    progress.advance(10)  # 4 s per question
    progress.advance(1)  # 11 questions in 440 s
    assert slow.getvalue().splitlines() == [
        "crag: 10/100 questions (10%), 4.00 s/question, 00:40 elapsed, 06:00 left",
        "crag: 11/100 questions (11%), 40.00 s/question, 07:20 elapsed, 59:20 left",
    ]


def test_a_closed_or_odd_stream_is_not_a_terminal():
    closed = io.StringIO()
    closed.close()
    assert not ProgressReporter(closed).enabled
    assert not ProgressReporter(object()).enabled  # no isatty at all
