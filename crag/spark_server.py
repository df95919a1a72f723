"""`crag spark start | status | stop`: a warm local Spark for every command, as a Databricks user has a
warm cluster or serverless compute.

`start` runs Spark's own Spark Connect server (SparkConnectServer, from the installed pyspark) in the
background, with Delta Lake configured exactly as crag configures a local session, waits until it
answers, and warms it with the Delta operations a run makes. While it runs, every crag command that
would start local Spark connects to it instead (crag.spark.get_spark) and says so in its first line:
only `start` pays the JVM's start and Delta's warm-up. `stop` ends the server and its Python workers.

The server is this machine's and this user's: its address, process and the fingerprint of the crag
code it serves are kept in a state file (CRAG_HOME, default ~/.crag). Every command joins one Spark
session of the server (its id is in the state file too): Spark Connect starts Python workers per
session, so a session shared by the commands keeps its workers, with crag imported and the indexes
loaded, from one command to the next. (Its runtime settings, spark.conf, are then the last command's.)
Its Python workers import crag once and keep it: a command run with other crag code than the server's
does not use the server.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from crag.config import SparkConfig, crag_home
from crag.errors import CragError

log = logging.getLogger("crag")

PACKAGE = Path(__file__).resolve().parent


def code_fingerprint() -> str:
    """Which crag code this is: the names, sizes and times of its source files."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        stat = path.stat()
        digest.update(f"{path.relative_to(PACKAGE)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


@dataclass
class ServerState:
    pid: int
    port: int
    code: str  # code_fingerprint() of the crag that started it
    log: str
    session: str = field(default_factory=lambda: str(uuid.uuid4()))  # the Spark session commands join

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    @property
    def session_url(self) -> str:
        return f"{self.url}/;session_id={self.session}"

    @staticmethod
    def path() -> Path:
        return crag_home() / "spark-server.json"

    @classmethod
    def read(cls) -> ServerState | None:
        """The running server's state, or None (no state file, or its process is gone)."""
        try:
            state = cls(**json.loads(cls.path().read_text()))
        except (OSError, ValueError, TypeError):
            return None
        return state if _alive(state.pid) else None

    def write(self) -> None:
        self.path().parent.mkdir(parents=True, exist_ok=True)
        self.path().write_text(json.dumps(asdict(self)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process has the pid now
        return False
    return True


def server_command(port: int, cfg: SparkConfig) -> list[str]:
    """spark-submit of Spark's SparkConnectServer on 127.0.0.1:`port`, with the settings, jars and task
    slots of a local session (crag.spark), and the config's own Spark settings (`spark.conf`: its
    heap, say) as a local session gets them."""
    import pyspark  # noqa: PLC0415  # only who starts a server needs pyspark's location

    from crag.spark import LOCAL_SETTINGS, jars, java_options, local_master  # noqa: PLC0415  # crag.spark imports this module

    master, slots = local_master(cfg.master) or local_master("local[2]")  # type: ignore[misc]
    settings = {
        **cfg.conf,
        **LOCAL_SETTINGS,
        "spark.jars": ",".join(jars(cfg)),
        "spark.driver.extraJavaOptions": java_options(cfg),
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
        "spark.default.parallelism": str(slots),
    }
    submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    args = [str(submit), "--class", "org.apache.spark.sql.connect.service.SparkConnectServer", "--master", master]
    for key, value in settings.items():
        args += ["--conf", f"{key}={value}"]
    return args + ["spark-internal"]


def server_environment() -> dict[str, str]:
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    env.pop("SPARK_REMOTE", None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cfg: SparkConfig, port: int | None = None, timeout_s: float = 300) -> ServerState:
    """A running server: the one there is, or a new one, started, answering and warmed up."""
    running = ServerState.read()
    if running is not None:
        return running
    port = port or free_port()
    crag_home().mkdir(parents=True, exist_ok=True)
    log_path = crag_home() / "spark-server.log"
    with log_path.open("w") as out:
        server = subprocess.Popen(
            server_command(port, cfg),
            env=server_environment(),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: `stop` ends it with its Python workers
        )
    state = ServerState(server.pid, port, code_fingerprint(), str(log_path))
    try:
        _wait_until_answering(state, server, timeout_s)
        state.write()
        _warm_up(state)
    except BaseException:
        _end(server.pid)
        ServerState.path().unlink(missing_ok=True)
        raise
    return state


def _wait_until_answering(state: ServerState, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise CragError(f"the Spark server stopped as it started (exit {server.returncode}): see {state.log}")
        try:
            socket.create_connection(("127.0.0.1", state.port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.3)
    raise CragError(f"the Spark server did not answer within {timeout_s:g} s: see {state.log}")


def _warm_up(state: ServerState) -> None:
    """The Delta operations a run makes, once, on a scratch warehouse, and one Python worker per task
    slot: what a new JVM is slow at the first time."""
    from crag.spark_warm import warm_up  # noqa: PLC0415

    spark = shared_session(state, SparkConfig().connect_timeout_s)
    with tempfile.TemporaryDirectory(prefix="crag-warm-") as scratch:
        warm_up(spark, Path(scratch))


def stop() -> ServerState | None:
    """End the running server and its Python workers; the state it had, or None when none ran."""
    state = ServerState.read()
    ServerState.path().unlink(missing_ok=True)
    if state is not None:
        _end(state.pid)
    return state


def _end(pid: int, grace_s: float = 30) -> None:
    """SIGTERM to the server's process group (the JVM and its Python workers), SIGKILL after `grace_s`."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def usable() -> ServerState | None:
    """The running server, when it serves this crag's code and answers; a line says why not otherwise."""
    state = ServerState.read()
    if state is None:
        return None
    if state.code != code_fingerprint():
        log.info(
            "the Spark server at %s (crag spark start) serves other crag code than this one's: local Spark is "
            "started instead (crag spark stop, then crag spark start, serves this code)",
            state.url,
        )
        return None
    try:
        socket.create_connection(("127.0.0.1", state.port), timeout=2).close()
    except OSError:
        return None
    return state


def shared_session(state: ServerState, timeout_s: float):
    """The server's shared Spark session (`state.session`), joined; kept open on the server when this
    process ends. A session the server has closed (idle too long, or released) is replaced by a new
    one, whose id the state file then holds."""
    from crag.connect import connect_session  # noqa: PLC0415  # crag.connect imports pyspark's client

    try:
        session = connect_session(state.session_url, timeout_s)
    except Exception as exc:
        if "SESSION_CLOSED" not in str(exc) and "SESSION_NOT_FOUND" not in str(exc):
            raise
        state.session = str(uuid.uuid4())
        state.write()
        session = connect_session(state.session_url, timeout_s)
    session.release_session_on_close = False  # the next command joins it
    return session
