"""A model role's budget of requests in flight, watched with calls that take time (a few tenths of a
second each): a process's share of its endpoint's budget over a whole pipeline, each of a job's tasks
in turn keeping its own share, and time spent waiting for a slot not counted against the timeout. (The
shares' arithmetic: tests/unit/test_llm_roles.py.)"""

import threading
import time

import pandas as pd

from crag import stages
from crag.backends import build_backends
from crag.backends.base import Usage
from crag.backends.remote import Endpoint, running_task
from crag.config import EndpointPolicy, load_config
from tests.support import REPO

OAI = REPO / "conf" / "openai.yaml"


def test_requests_in_flight_respect_the_concurrency_budget(emulator, sample_indexes):
    emulator.behaviour["serving"].latency_s = 0.05
    cfg = load_config(
        OAI,
        [
            f"retriever.index={sample_indexes['kb']}",
            f"web_search.index={sample_indexes['web']}",
            "grader.policy.max_concurrency=4",
            "rewriter.policy.max_concurrency=4",
            "generator.policy.max_concurrency=4",
        ],
    )
    backends = build_backends(cfg, None, concurrent_tasks=2)  # half of the budget for this process
    assert backends.grader.concurrency == 2
    df = pd.DataFrame({"question_id": [f"q{i}" for i in range(8)], "question": ["How high is Mount Fuji?"] * 8})
    stages.run_pipeline(df, backends, cfg)
    assert emulator.peak_in_flight["serving"] == 2


def test_each_task_keeps_its_own_share_in_flight():
    endpoint = Endpoint("e", EndpointPolicy(max_concurrency=5), concurrent_tasks=3)
    assert endpoint.concurrency == 2  # threads a stage may use: the largest share
    peaks = []
    try:
        for task in range(3):  # one process running the job's three tasks one after the other
            running_task(task)
            in_flight, peak, lock = [0], [0], threading.Lock()

            def request():
                with lock:
                    in_flight[0] += 1
                    peak[0] = max(peak[0], in_flight[0])
                time.sleep(0.05)
                with lock:
                    in_flight[0] -= 1

            threads = [threading.Thread(target=endpoint.call, args=(request,)) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            peaks.append(peak[0])
    finally:
        running_task(0)
    assert peaks == [2, 2, 1]  # 5 in all


def test_time_waiting_for_a_slot_is_not_counted_against_the_timeout():
    """One slot, two calls at once, each taking 0.3 s against a 0.5 s timeout: the second waits 0.3 s
    on the client, then is sent and answers in time."""
    endpoint = Endpoint("slow", EndpointPolicy(max_concurrency=1, timeout_s=0.5, max_attempts=1), hard_timeout=True)
    usages = [Usage(), Usage()]
    results: list = [None, None]

    def call(i: int) -> None:
        results[i] = endpoint.call(lambda: time.sleep(0.3) or i, usages[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [0, 1]
    assert sum(u.queued_calls for u in usages) == 1 and sum(u.queue_ms for u in usages) >= 200
    assert [sum(u.call_ms_hist) for u in usages] == [1, 1]
