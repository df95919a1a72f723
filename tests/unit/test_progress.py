"""crag.progress on a fake terminal, a log file, and off."""

from __future__ import annotations

import io
import re
import time
from pathlib import Path

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
    # a bar moved twice a second by the tasks' counts: a line at most every line_every_s, and the last one
    often = io.StringIO()
    clock = iter([0.0, 0.5, 1.0, 10.5, 11.0, 11.5]).__next__
    progress = ProgressReporter(often, enabled=True, clock=clock).start(50)
    for _ in range(5):
        progress.advance(10)
    assert [line.split(" (")[0] for line in often.getvalue().splitlines()] == [
        "crag: 30/50 questions",
        "crag: 50/50 questions",
    ]
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


def test_the_bar_moves_with_the_tasks_reports_and_settles_on_each_commit():
    """Tasks report how many of their batch's questions they have answered; the bar shows the committed
    count plus what the uncommitted batches' tasks report, never going back."""
    from crag.progress import LiveProgress, report_answered

    terminal = FakeTerminal()
    reporter = ProgressReporter(terminal)
    with LiveProgress(reporter, every_s=0.05) as live:
        live.start(100, 0)
        live.batch(0)
        report_answered(live.path, 0, 0, 10)  # task 0 of batch 0
        report_answered(live.path, 0, 1, 15)  # task 1
        report_answered(live.path, 0, 1, 20)  # task 1 again: its latest count replaces the earlier one
        deadline = time.monotonic() + 5
        while reporter._done < 30 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reporter._done == 30
        live.committed(0, 30)  # batch 0's rows: its tasks' files count no more
        live.batch(1)
        report_answered(live.path, 1, 0, 5)
        while reporter._done < 35 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reporter._done == 35
        live.committed(1, 4)  # fewer than reported (a task retried): the bar does not go back
        assert reporter._done == 35
    assert not Path(live.path).exists()  # the folder is removed when the run is done


def test_a_task_where_the_folder_is_not_reports_nothing(tmp_path):
    from crag.progress import report_answered

    report_answered(str(tmp_path / "elsewhere"), 0, 0, 5)  # a cluster worker: the driver's folder is not here
    report_answered(None, 0, 0, 5)
    assert list(tmp_path.iterdir()) == []
