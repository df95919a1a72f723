"""What a run readies beside its answering for the commits after its last reply
(crag.batches._ready_last_commits): the totals they observe built and the state of the tables they
write read while it answers a long batch (the metrics' only when its questions carry gold), and
nothing done by a short one, whose reads would only slow its own commits."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from crag.batches import WRITTEN_LAST, _ready_last_commits, finished

WAIT_S = 30  # generous: the machine may be busy


class Warehouse:
    def __init__(self, answered: threading.Event | None = None):
        self.read: list[str] = []
        self._answered = answered

    def load_states(self, tables: tuple[str, ...]) -> None:
        self.read.extend(tables)
        if self._answered is not None:  # the answering ends while the first table is read
            self._answered.set()


class Plan:
    """A run's plan as the readying sees it: its warehouse, its questions with gold, and its totals,
    whose building is logged with the reads (and fails when `failing`)."""

    def __init__(self, warehouse: Warehouse, failing: bool = False, gold_rows: int = 3):
        self.warehouse, self.failing, self.gold_rows = warehouse, failing, gold_rows

    @property
    def result_totals(self) -> list:
        self.warehouse.read.append("totals")
        if self.failing:
            raise RuntimeError("the session is gone")
        return []


AFTER_S = 0.2  # the answering's time after the hold before the reads start (1 s in a run)


def _reader(
    warehouse: Warehouse, held: Future, answered: threading.Event, failing: bool = False, gold_rows: int = 3
) -> threading.Thread:
    plan = Plan(warehouse, failing, gold_rows)
    thread = threading.Thread(target=_ready_last_commits, args=(plan, held, answered, AFTER_S))
    thread.start()
    return thread


def test_a_long_answering_builds_the_totals_then_reads_every_table_written_after_the_last_reply():
    warehouse, answered = Warehouse(), threading.Event()
    reader = _reader(warehouse, finished(), answered)
    reader.join(WAIT_S)
    assert warehouse.read == ["totals", *WRITTEN_LAST] and "runs" in warehouse.read


def test_a_run_without_gold_leaves_the_metrics_table_unread():
    """Its last commits write no metrics (crag.batches._score, crag.job.evaluate need gold)."""
    warehouse = Warehouse()
    _reader(warehouse, finished(), threading.Event(), gold_rows=0).join(WAIT_S)
    assert warehouse.read == ["totals", *(t for t in WRITTEN_LAST if t != "metric_values")]
    assert "metric_values" in WRITTEN_LAST


def test_an_answering_over_soon_after_the_hold_reads_nothing():
    """Nothing is read before the run is held, and nothing when the answering ends within `after_s`
    of the hold (here 30 s, ended 0.2 s after the hold)."""
    warehouse, answered = Warehouse(), threading.Event()
    held: Future = Future()
    plan = Plan(warehouse)
    reader = threading.Thread(target=_ready_last_commits, args=(plan, held, answered, WAIT_S))
    reader.start()
    threading.Event().wait(3 * AFTER_S)  # the hold takes long
    assert warehouse.read == []
    held.set_result(None)
    threading.Event().wait(AFTER_S)
    answered.set()
    reader.join(WAIT_S)
    assert not reader.is_alive() and warehouse.read == []


def test_the_reads_stop_when_the_answering_ends_and_a_failed_hold_reads_nothing():
    answered = threading.Event()
    warehouse = Warehouse(answered)
    _reader(warehouse, finished(), answered).join(WAIT_S)
    assert warehouse.read == ["totals", WRITTEN_LAST[0]]
    failed: Future = Future()
    failed.set_exception(RuntimeError("claimed by another process"))
    untouched = Warehouse()
    _reader(untouched, failed, threading.Event()).join(WAIT_S)
    assert untouched.read == []


def test_totals_that_cannot_be_built_ahead_leave_the_reads_to_go_on():
    """A failure to build the totals ahead is the commit's to tell (it builds them again): the state
    reads go on, and nothing escapes the thread."""
    warehouse, escaped = Warehouse(), []
    hook, threading.excepthook = threading.excepthook, lambda args: escaped.append(args.exc_value)
    try:
        _reader(warehouse, finished(), threading.Event(), failing=True).join(WAIT_S)
    finally:
        threading.excepthook = hook
    assert warehouse.read == ["totals", *WRITTEN_LAST] and escaped == []


def test_a_runs_totals_are_built_once(monkeypatch):
    """RunPlan.result_totals: built at the first use (by the readying thread, or the first commit) and
    kept for every later commit."""
    import crag.job
    from crag.config import CragConfig

    built = []
    monkeypatch.setattr(crag.job, "aggregates", lambda: built.append(1) or ["a column"])
    plan = crag.job.RunPlan(CragConfig(), None, {}, None)
    assert plan.result_totals is plan.result_totals and built == [1]
