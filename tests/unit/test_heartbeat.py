"""The run's heartbeat: beats on its own thread from `start` (once the run is claimed) while batches run,
survives a failed beat, and has finished its last beat when the block ends (the run's outcome is
recorded after it)."""

from __future__ import annotations

import logging
import threading

import pytest

from crag.ledger import Heartbeat, RunTakenOver

WAIT_S = 30  # generous: the machine may be busy; the waits end as soon as the beats happen


def test_it_beats_until_the_block_ends():
    beats, third = [], threading.Event()

    def beat():
        beats.append(threading.current_thread().name)
        if len(beats) == 3:
            third.set()

    with Heartbeat(beat, every_s=0.01) as heartbeat:
        threading.Event().wait(0.1)
        assert beats == []  # not before it is started: the run is not claimed yet
        heartbeat.start()
        heartbeat.start()  # once only: the claim and a resume both start it
        assert third.wait(WAIT_S)
    after = len(beats)
    threading.Event().wait(0.1)
    assert len(beats) == after  # stopped with the block
    assert set(beats) == {"crag-heartbeat"}  # never on the caller's thread


def test_a_failed_beat_is_logged_and_the_next_one_tries_again(caplog):
    calls, recovered = [], threading.Event()

    def beat():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("ConcurrentAppendException at http://user:hunter2@host/x")
        recovered.set()

    with caplog.at_level(logging.WARNING, logger="crag"), Heartbeat(beat, every_s=0.01) as heartbeat:
        heartbeat.start()
        assert recovered.wait(WAIT_S)
    assert "heartbeat not recorded" in caplog.text and "ConcurrentAppendException" in caplog.text
    assert "hunter2" not in caplog.text


def test_leaving_the_block_waits_for_a_beat_in_progress():
    started, finished = threading.Event(), threading.Event()

    def slow_beat():
        started.set()
        threading.Event().wait(0.3)
        finished.set()

    with Heartbeat(slow_beat, every_s=0.01) as heartbeat:
        heartbeat.start()
        assert started.wait(WAIT_S)
    assert finished.is_set()


def test_a_beat_that_finds_the_run_taken_over_ends_the_beats_and_the_block_raises_it():
    calls = []

    def beat():
        calls.append(1)
        raise RunTakenOver("run 'r' was taken over by another crag process")

    heartbeat = Heartbeat(beat, every_s=0.01)
    with pytest.raises(RunTakenOver), heartbeat:
        heartbeat.start()
        for _ in range(WAIT_S * 100):
            if heartbeat.lost is not None:
                break
            threading.Event().wait(0.01)
        threading.Event().wait(0.1)
        assert calls == [1]  # no beat after it
        heartbeat.check()
    with pytest.raises(RunTakenOver), Heartbeat(beat, every_s=0.01) as other:
        other.start()
        while other.lost is None:
            threading.Event().wait(0.01)
    # the block's own exception is the one that propagates
    with pytest.raises(KeyError), Heartbeat(beat, every_s=0.01) as third:
        third.start()
        while third.lost is None:
            threading.Event().wait(0.01)
        raise KeyError("the batch failed")
