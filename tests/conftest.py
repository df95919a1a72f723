"""Shared fixtures of every tier: one SparkSession and one pair of sample indexes per test run, the
emulators, and the LangChain stores."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import LOCAL_CONF, SAMPLE, TOKEN, crag_command

# The real-model tier needs llama-cpp-python's server, which `make test-llm` builds and names here.
collect_ignore = [] if os.environ.get("CRAG_LLM_PYTHON") else ["llm"]

# Configs name tests/langchain_stores.py as a top-level module ("langchain_stores:faiss_store"), as a
# user's own factory module would be named; Spark workers get it with addPyFile.
sys.path.insert(0, str(Path(__file__).parent))


# The tiers whose tests run without a JVM in their process (the others use the session's Spark). Both
# kinds may use the run's warm Spark Connect server (spark_server), a process of its own.
NO_JVM_TIERS = ("unit", "slow")


def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest-xdist workers (`-n 2 --dist loadgroup`) in two groups: one worker takes
    the tiers that use a JVM, the other the tiers that must not (tests/unit, tests/slow), whose tests
    mostly wait (time limits, child processes) while the JVM works. (Groups by tier, not by xdist_group
    marks: pytest-xdist 3.8 marks a group in the test's node id, which pytest 9.2 no longer lets it set.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByTier(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "no-jvm" if nodeid.split("/")[1] in NO_JVM_TIERS else "jvm"

    return ByTier(config, log)


# The CRAG_HOME of a test run (the warm Spark server's state, the MLflow store template), made by the
# controlling process before the xdist workers start, which inherit its name.
SHARED_HOME = "CRAG_TESTS_HOME"


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controlling process, or a run without xdist
        os.environ[SHARED_HOME] = tempfile.mkdtemp(prefix="crag-tests-home-")


def pytest_unconfigure(config):
    """The controlling process ends the run's warm Spark server (if a test started one) once every
    worker is done with it."""
    if hasattr(config, "workerinput") or SHARED_HOME not in os.environ:
        return
    home = os.environ.pop(SHARED_HOME)
    try:
        if (Path(home) / "spark-server.json").exists():
            crag_command("spark", "stop", home=Path(home), timeout=120).check_returncode()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _jvm_gateway():
    """The JVM gateway pyspark has started in this process, if any."""
    context = sys.modules.get("pyspark.core.context")
    return None if context is None else context.SparkContext._gateway


@pytest.fixture(autouse=True)
def no_jvm_outside_the_spark_tier(request):
    """tests/unit and tests/slow run without a JVM: a test there that starts one (a command that opens a
    Spark session before it fails, say) fails, and the JVM is shut down so that the next test starts clean.
    (In a session that has run Spark tests first, the JVM they started is theirs: it is left alone.)"""
    before = _jvm_gateway()
    yield
    tier = request.node.path.relative_to(Path(__file__).parent).parts[0]
    if tier not in NO_JVM_TIERS or before is not None or _jvm_gateway() is None:
        return
    context = sys.modules["pyspark.core.context"]
    if context.SparkContext._active_spark_context is not None:
        context.SparkContext._active_spark_context.stop()
    context.SparkContext._gateway.shutdown()
    context.SparkContext._gateway = context.SparkContext._jvm = None
    pytest.fail(f"tests/{tier} runs without a JVM, but this test started one: it belongs in tests/spark")


@pytest.fixture(scope="session")
def spark():
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from crag.config import SparkConfig
    from crag.spark import get_spark

    # Hundreds of runs in one JVM: C2 pays off over them (tiered_jit), and a heap above Spark's
    # 1 GB default spares its collector (near the limit, G1 ran concurrent cycles without end: 3.5 of
    # a 20-minute suite's CPU-minutes; a test subset 165 -> 153 s with 2 GB).
    cfg = SparkConfig(master="local[2]", conf={"spark.driver.memory": "3g"})
    session = get_spark(cfg, tiered_jit=True)
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def crag_home() -> Path:
    """The run's CRAG_HOME, one for both xdist workers: the server's state and the MLflow store
    template live there."""
    return Path(os.environ[SHARED_HOME])


@pytest.fixture(scope="session")
def spark_server(crag_home):
    """The warm server of `crag spark start`, in a process of its own: its state (ServerState). One
    for the whole run: the first worker to need it starts it (`start` returns the running one to the
    other, which waits on the lock meanwhile); `crag spark stop` when the run ends (pytest_unconfigure)."""
    with open(crag_home / "spark-server.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        started = crag_command("spark", "start", home=crag_home)
    assert started.returncode == 0, started.stderr[-3000:]
    from crag.spark_server import ServerState

    os.environ["CRAG_HOME"] = str(crag_home)
    try:
        state = ServerState.read()
    finally:
        os.environ.pop("CRAG_HOME")
    assert state is not None, started.stdout
    return state


@contextlib.contextmanager
def _holding(crag_home: Path, how: int):
    """The run's server held for one test: shared by tests that may overlap, alone for one that counts
    the server's free task slots."""
    with open(crag_home / "spark-server.busy", "w") as busy:
        fcntl.flock(busy, how)
        yield


@pytest.fixture
def connect_url(spark_server, crag_home) -> Iterator[str]:
    """The run's warm server, shared with whatever else runs on it meanwhile."""
    with _holding(crag_home, fcntl.LOCK_SH):
        yield spark_server.url


@pytest.fixture
def connect_url_alone(spark_server, crag_home) -> Iterator[str]:
    """The run's warm server with no other test's run on it (the other worker's wait meanwhile)."""
    with _holding(crag_home, fcntl.LOCK_EX):
        yield spark_server.url


@pytest.fixture(scope="session")
def sample_indexes(tmp_path_factory) -> dict[str, str]:
    from crag.config import load_config
    from crag.indexing import build_index

    root = tmp_path_factory.mktemp("indexes")
    cfg = load_config(LOCAL_CONF, ["indexing.embedding_cache=null"])  # the model embeds, not a cache in the checkout
    build_index(SAMPLE / "kb", root / "kb", cfg.indexing)
    build_index(SAMPLE / "web.jsonl", root / "web", cfg.indexing)
    return {"kb": str(root / "kb"), "web": str(root / "web")}


@pytest.fixture(scope="session")
def index_overrides(sample_indexes) -> list[str]:
    # MLflow logging is tested on its own (test_variants); elsewhere it would only add set-up time.
    return [
        f"retriever.index={sample_indexes['kb']}",
        f"web_search.index={sample_indexes['web']}",
        "mlflow.enabled=false",
    ]


@pytest.fixture(scope="session")
def sample_config(index_overrides):
    from crag.config import load_config

    return load_config(LOCAL_CONF, index_overrides)


@pytest.fixture(scope="session")
def sample_backends(sample_config):
    from crag.backends import build_backends

    return build_backends(sample_config)


@pytest.fixture(scope="session")
def emulator_server(sample_indexes):
    from crag.emulators import Emulator

    with Emulator(sample_indexes["kb"], sample_indexes["web"], token=TOKEN, hang_s=2.5) as emulator:
        yield emulator


@pytest.fixture
def emulator(emulator_server, monkeypatch):
    """The shared emulator, cleared, with the credentials and URLs the production configs read."""
    from crag.emulators import ServiceBehaviour

    emulator_server.reset()
    for service in emulator_server.behaviour:
        emulator_server.behaviour[service] = ServiceBehaviour()
    url = emulator_server.url
    for name, value in {
        "DATABRICKS_HOST": url,
        "DATABRICKS_TOKEN": TOKEN,
        "TAVILY_API_KEY": TOKEN,
        "OPENAI_API_KEY": TOKEN,
        "TAVILY_API_BASE_URL": url,
        "OPENAI_BASE_URL": f"{url}/v1",
    }.items():
        monkeypatch.setenv(name, value)
    return emulator_server


@pytest.fixture(scope="session")
def stores(tmp_path_factory) -> dict[str, list[str]]:
    """--set overrides that configure each LangChain store whose library is installed (tests/langchain_stores.py)."""
    import langchain_stores

    root = tmp_path_factory.mktemp("langchain")
    common = ["retriever.backend=langchain", "retriever.k=4", "web_search.backend=none", "mlflow.enabled=false"]
    found = {}
    if importlib.util.find_spec("faiss"):
        faiss = langchain_stores.write_faiss(root / "faiss")
        found["faiss"] = [*common, "retriever.factory=langchain_stores:faiss_store", f"retriever.kwargs.path={faiss}"]
    if importlib.util.find_spec("langchain_chroma"):
        chroma = langchain_stores.write_chroma(root / "chroma")
        found["chroma"] = [
            *common,
            "retriever.factory=langchain_stores:chroma_store",
            f"retriever.kwargs.path={chroma}",
        ]
    if importlib.util.find_spec("rank_bm25"):
        docs = langchain_stores.write_documents(root / "docs.jsonl")
        found["bm25"] = [
            *common,
            "retriever.factory=langchain_stores:bm25_retriever",
            f"retriever.kwargs.documents={docs}",
            "retriever.kwargs.k=4",
        ]
    return found


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fresh_registry(monkeypatch):
    """An empty registry of the secret values crag has resolved (which its scrubber masks)."""
    from crag import secrets

    monkeypatch.setattr(secrets, "_known", set())


@pytest.fixture
def restore_env():
    """For code that sets credentials in os.environ itself (the benchmark scenarios)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
