"""Requests in flight beyond a client's ten pooled connections keep theirs: Databricks model serving
through the real mlflow deployments client (in a process of its own, as a Spark worker is), and Tavily
through tavily-python. Each sends waves of requests to an emulator that answers slowly."""

import os
import subprocess
import sys

from crag.backends.tavily_search import TavilySearch
from crag.config import load_config
from tests.support import REPO

DBX = REPO / "conf" / "databricks.yaml"


# A process that sends its serving endpoints' budgets in waves, as a pipeline's stages do: 12
# batch-grading and 12 chat requests at once through mlflow's one session, four waves one after another.
_KEEP_24_IN_FLIGHT = """
from concurrent.futures import ThreadPoolExecutor
from crag.backends import _chat_model, shared_policies
from crag.backends.base import Usage
from crag.config import load_config

cfg = load_config(
    {conf!r}, ["grader.policy.max_concurrency=12", "rewriter.policy.max_concurrency=12", "generator.policy.max_concurrency=12"]
)
policies, shared = shared_policies(cfg), {{}}
grader, chat = (_chat_model(role, None, 1, shared, policies) for role in (cfg.grader, cfg.generator))

def ask(i):
    if i % 2:
        grader.batch("Grade the document.", ["Sapporo hosted the 1972 Winter Olympics."], Usage(), max_tokens=5, temperature=0.0)
    else:
        chat.chat([{{"role": "user", "content": f"question {{i}}"}}], Usage(), max_tokens=5, temperature=0.0)

with ThreadPoolExecutor(24) as pool:
    for wave in range(4):
        list(pool.map(ask, range(24 * wave, 24 * (wave + 1))))
"""


def test_serving_requests_in_flight_beyond_ten_keep_their_connections(emulator):
    """mlflow keeps 10 idle connections to the workspace unless told more: after a wave of the serving
    budgets' 24 requests it closes 14, and the next wave opens 14 anew (each a TLS handshake on a
    workspace). Run in a new process (mlflow makes its session once per process), as a Spark worker is."""
    emulator.behaviour["serving"].latency_s = 0.1
    done = subprocess.run(
        [sys.executable, "-c", _KEEP_24_IN_FLIGHT.format(conf=str(DBX))],
        env={k: v for k, v in os.environ.items() if k != "MLFLOW_HTTP_POOL_MAXSIZE"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(emulator.of("serving")) == 96
    assert emulator.peak_in_flight["serving"] > 10  # the requests did overlap beyond mlflow's default
    assert emulator.connections <= 24, f"{emulator.connections} connections for 24 requests in flight"


def test_tavily_requests_in_flight_beyond_ten_keep_their_connections(emulator):
    """requests keeps 10 idle connections to a host: after a wave of 24 searches it closes 14, and the
    next wave opens 14 anew (each a TLS handshake with Tavily's API). A pipeline's stages send such
    waves: every question of a stage at once, then the next stage's."""
    from concurrent.futures import ThreadPoolExecutor

    emulator.behaviour["tavily"].latency_s = 0.1
    search = TavilySearch(load_config(DBX, ["web_search.policy.max_concurrency=24"]).web_search)
    with ThreadPoolExecutor(24) as pool:
        for wave in range(4):
            list(pool.map(lambda i: search.search(f"HEPA filter {wave} {i}", 3), range(24)))
    assert len(emulator.of("tavily")) == 96
    assert emulator.peak_in_flight["tavily"] > 10  # the searches did overlap beyond requests' default
    assert emulator.connections <= 24, f"{emulator.connections} connections for 24 searches in flight"
