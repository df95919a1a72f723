"""Spark Connect's waits, each with a deadline (spark.connect_timeout_s).

pyspark's Connect client retries a call that finds no server (gRPC's UNAVAILABLE) for about ten
minutes, silently, and each attempt to connect to a server that accepts and says nothing lasts 20 s.
A session crag makes is bounded instead:
- it is first asked for Spark's version: the one call that tells a Spark Connect server from anything
  else listening there (an HTTP server, a closed port, a TLS mismatch), said in one line;
- each call is retried as pyspark retries it (its DefaultPolicy: which errors, and its backoff) until
  the deadline, counted from the call's start, and once one call has given up the server is taken for
  gone: the calls after it (recording the run's failure, pyspark's clean-up at exit) are not retried;
- on Ctrl-C or SIGTERM, and once the server is gone, `release_sessions` closes the client, so that no
  call holds the process at exit.

Only public parts of pyspark's client are used: its ChannelBuilder (with gRPC channel options), its
RetryPolicy classes and `SparkConnectClient.set_retry_policies`.
"""

from __future__ import annotations

import os
import re
import threading
import time
import warnings
from typing import Any

from crag.config import connect_url_parts
from crag.errors import ConfigError, describe

# Sessions this process made, with their deadlines (policies): closed by release_sessions
_SESSIONS: list[tuple[Any, Any]] = []
_LOCK = threading.Lock()


# gRPC's C core logs each failed TLS handshake to stderr at INFO: only its errors, unless asked
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def attempt_s(timeout_s: float) -> float:
    """How long one attempt to connect may last: a quarter of the deadline (gRPC's default is 20 s), so
    a server that accepts and never answers is tried a few times within it."""
    return min(20.0, max(0.5, timeout_s / 4))


def _policy_classes():
    from pyspark.sql.connect.client.retries import DefaultPolicy, RetryPolicyState  # noqa: PLC0415  # Spark-free callers

    class Deadline(DefaultPolicy):
        """pyspark's DefaultPolicy within `timeout_s` per call; after one call gave up, no retry."""

        def __init__(self, timeout_s: float, where: str) -> None:
            super().__init__(max_retries=None)
            self.timeout_s, self.where, self.gave_up = timeout_s, where, False

        def can_retry(self, exception: BaseException) -> bool:
            return not self.gave_up and super().can_retry(exception)

        def to_state(self) -> RetryPolicyState:  # made when a call starts
            return DeadlineState(self)

    class DeadlineState(RetryPolicyState):
        def __init__(self, policy: Deadline) -> None:
            super().__init__(policy)
            self.deadline = policy
            self.started = time.monotonic()

        def next_attempt(self, exception: BaseException | None = None) -> int | None:
            policy = self.deadline
            wait_ms = super().next_attempt(exception)
            # the last attempt starts early enough to end, connecting included, by the deadline
            left_s = policy.timeout_s - (time.monotonic() - self.started) - attempt_s(policy.timeout_s)
            if wait_ms is None or left_s <= 0:
                policy.gave_up = True
                return None
            return int(min(wait_ms, left_s * 1000))

    return Deadline


def shown_url(url: str) -> str:
    """sc://host:port, without user info or parameters (a token)."""
    parts, _ = connect_url_parts(url)
    host = parts.hostname or "?"
    try:
        port = str(parts.port or 15002)
    except ValueError:  # config checks the URL first; said rather than raised here
        port = "?"
    return f"sc://{host if ':' not in host else f'[{host}]'}:{port}"


def connect_session(url: str, timeout_s: float):
    """A Spark Connect session on the server at `url` whose every wait is bounded by `timeout_s`:
    made without a call, then asked for Spark's version; ConfigError with the reason when no Spark
    Connect server answers there in time."""
    from pyspark.sql.connect.client import DefaultChannelBuilder  # noqa: PLC0415  # as above
    from pyspark.sql.connect.session import SparkSession  # noqa: PLC0415

    where = shown_url(url)
    # gRPC's attempt to connect lasts 20 s by default; it lasts this long at least
    channel = DefaultChannelBuilder(url, [("grpc.min_reconnect_backoff_ms", int(attempt_s(timeout_s) * 1000))])
    session = SparkSession.builder.channelBuilder(channel).getOrCreate()  # no setting given: no call yet
    deadline = bound_waits(session, where, timeout_s)
    try:
        session.version  # noqa: B018  # a call (AnalyzePlan)
        session.conf.set("spark.sql.session.timeZone", "UTC")
    except Exception as exc:
        if not deadline.gave_up and grpc_status(exc) not in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            raise  # a server answered: its own error (authentication, a refused setting) is the message
        _forget(session)
        raise ConfigError(
            f"no Spark Connect server answers at {where} within {timeout_s:g} s (spark.connect_timeout_s): "
            f"{_why(exc, where)}"
        ) from None
    # as pyspark's builder.remote() sets it once it has a session: pyspark.sql.functions then build
    # Connect's expressions (set only now, so that a server that did not answer leaves the process
    # free to start a classic session)
    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
    return session


def bound_waits(session, where: str, timeout_s: float) -> Any:
    """Every call of `session` retried within `timeout_s` (see the module's text); the policy."""
    deadline = _policy_classes()(timeout_s, where)
    session.client.set_retry_policies([deadline])
    # pyspark warns when it gives up retrying; the error that follows is crag's line
    warnings.filterwarnings("ignore", message=r"\[RETRIES_EXCEEDED\]", category=UserWarning)
    with _LOCK:
        _SESSIONS.append((session, deadline))
    return deadline


def grpc_status(exc: BaseException | None) -> str | None:
    """The gRPC status name (UNAVAILABLE, ...) of a Spark Connect client error, or of its cause."""
    seen = 0
    while exc is not None and seen < 10:
        if callable(getattr(exc, "getGrpcStatusCode", None)):  # pyspark's SparkConnectGrpcException
            code = exc.getGrpcStatusCode()  # type: ignore[attr-defined]
        else:  # grpc.RpcError
            code = exc.code() if callable(getattr(exc, "code", None)) else None  # type: ignore[attr-defined]
        name = getattr(code, "name", None)
        if isinstance(name, str) and name != "UNKNOWN":
            return name
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


_DETAILS = re.compile(r'details = "([^"]*)"')


def _details(exc: BaseException) -> str:
    """gRPC's own words for a failed call: its `details`, else the error's first line."""
    found = _DETAILS.search(str(exc))
    return found[1] if found else describe(exc, limit=200, with_type=False)


def _why(exc: BaseException, where: str) -> str:
    """What is at `where`, by what gRPC found there."""
    details = _details(exc)
    lowered = details.lower()
    if "settings frame" in lowered and "timed out" in lowered:
        return "something accepts connections there but does not answer in Spark Connect's protocol (gRPC)"
    if "http/2" in lowered or "http1" in lowered or "settings frame" in lowered:
        return f"something answers there, but not in Spark Connect's protocol (gRPC over HTTP/2): {details}"
    if "ssl" in lowered or "tls" in lowered or "handshake" in lowered:
        return (
            f"the TLS handshake failed ({details}); the client speaks TLS when the URL has a token or use_ssl=true: "
            f"give the server a TLS endpoint, or reach a local server without TLS as sc://localhost:{where.rpartition(':')[2]}"
        )
    if "refused" in lowered:
        return "nothing listens there (connection refused)"
    return details


def lost_server(exc: BaseException) -> str | None:
    """The line for an error that ended a command because its Spark Connect server stopped answering
    (a call gave up at its deadline); None for any other error."""
    with _LOCK:
        gone = [deadline for _, deadline in _SESSIONS if deadline.gave_up]
    if not gone or grpc_status(exc) not in ("UNAVAILABLE", "DEADLINE_EXCEEDED", None):
        return None
    return (
        f"the Spark Connect server at {gone[0].where} stopped answering: no answer within "
        f"{gone[0].timeout_s:g} s (spark.connect_timeout_s): {_details(exc)}"
    )


def stop_retrying() -> None:
    """No call of this process's Connect sessions is retried from now on: the command was interrupted,
    and what it does before it ends (recording a run's failure) is tried once. Called from a signal
    handler: no lock is taken and no call made."""
    for _, deadline in list(_SESSIONS):
        deadline.gave_up = True


def release_sessions(interrupted: bool) -> None:
    """Close the Connect sessions of this process that should make no further call: all of them when
    the command was interrupted, else those whose server is gone. pyspark's clean-up at exit would
    otherwise call a server that does not answer."""
    with _LOCK:
        ending = [(s, d) for s, d in _SESSIONS if interrupted or d.gave_up]
    for session, deadline in ending:
        deadline.gave_up = True  # whatever is still under way is not retried
        _forget(session)


def _forget(session) -> None:
    """Close `session`'s client without a call to its server (stop() would release the session on the
    server first), and no longer hand it out as the active session."""
    session.release_session_on_close = False
    try:
        session.stop()
    except Exception:  # noqa: S110  # best effort, as pyspark's stop() itself is
        pass
    with _LOCK:
        _SESSIONS[:] = [(s, d) for s, d in _SESSIONS if s is not session]
