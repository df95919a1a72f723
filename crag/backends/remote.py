"""What every call to a remote service goes through: a concurrency budget, one retry policy, a timeout,
and credentials from the environment or a Databricks secret scope.

The client libraries' own retries are switched off (openai max_retries=0, Vector Search
total_retries=0, mlflow MLFLOW_HTTP_REQUEST_MAX_RETRIES=0 on its plain HTTP path), so that one policy
applies everywhere and every retry is counted. On Databricks without a configured token, the driver
resolves the runtime's own authentication into a workspace URL and token (`runtime_workspace`), so
the workers' clients take the same plain path.
"""

from __future__ import annotations

import email.utils
import os
import re
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_any,
    wait_exponential_jitter,
)
from tenacity.stop import stop_base

from crag.backends.base import Usage
from crag.config import EndpointPolicy
from crag.errors import ConfigError
from crag.secrets import remember

T = TypeVar("T")
RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
# Exceptions that name a rate limit without carrying a status code.
_RATE_LIMIT_NAMES = ("UsageLimitExceededError", "TooManyRequests", "RateLimitError", "RetryError")


class CallTimeout(TimeoutError):
    """A call that did not answer within the per-call timeout."""


class RefusedRequest(ValueError):
    """A request the service refused as invalid or unsupported: the same request would be refused
    again, so it is never retried. `reason`: what the service said, on one line."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


# A server that validates its request body with pydantic (llama-cpp-python's) answers a field it does
# not take with HTTP 500 and the validation error, not with 400 or 422: such a 500 is no server fault.
_VALIDATION_ERROR = re.compile(r"validation error|literal_error|Input should be|extra_forbidden|unsupported", re.I)


def error_message(exc: BaseException) -> str:
    """What the service said, on one line: the `message` of its error body when it has one, up to a
    blank line (llama-cpp-python's server adds its traceback after one)."""
    body = getattr(exc, "body", None)
    message = body.get("message") if isinstance(body, dict) else None
    if not isinstance(message, str) and isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = body["error"].get("message")
    said = str(message if isinstance(message, str) else exc)
    return " ".join(re.split(r"\n\s*\n", said, maxsplit=1)[0].split())


def refused_as_invalid(exc: BaseException) -> bool:
    """Whether the service refused the request itself (400, 404, 405, 422, or a 500 that reports a
    validation error of the request body)."""
    status = http_status(exc)
    return status in (400, 404, 405, 422) or (status == 500 and bool(_VALIDATION_ERROR.search(error_message(exc))))


def http_status(exc: BaseException) -> int | None:
    for candidate in (getattr(exc, "status_code", None), getattr(getattr(exc, "response", None), "status_code", None)):
        if isinstance(candidate, int):
            return candidate
    if type(exc).__name__ in _RATE_LIMIT_NAMES:
        return 429  # e.g. requests' RetryError: urllib3 gave up on 429s
    return None


def is_transient(exc: BaseException | None) -> bool:
    """Worth another try: rate limits, server errors, timeouts and dropped connections, also when a
    client library wraps them in an error of its own (mlflow: MlflowException from a requests error)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, RefusedRequest) or refused_as_invalid(exc):
            return False
        if http_status(exc) in RETRYABLE_STATUS:
            return True
        names = {cls.__name__ for cls in type(exc).__mro__}
        if isinstance(exc, (TimeoutError, ConnectionError)) or any(
            "Timeout" in n or "ConnectionError" in n for n in names
        ):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def retry_after_s(exc: BaseException) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), if the error carries one."""
    headers = getattr(getattr(exc, "response", None), "headers", None)
    value = headers.get("Retry-After") if headers is not None else None
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        parsed = email.utils.parsedate_to_datetime(value)
        return max(0.0, parsed.timestamp() - time.time()) if parsed else None


def call_with_deadline(fn: Callable[[], T], timeout_s: float, name: str) -> T:
    """fn() on a daemon thread, given up after timeout_s. The thread is abandoned, not killed: being a
    daemon, a call that never answers cannot keep the process from exiting (a pool's threads would be
    waited for at exit, and `crag` would hang after printing its error)."""
    done = threading.Event()
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name="crag-timeout", daemon=True).start()
    if not done.wait(timeout_s):
        raise CallTimeout(f"{name}: no answer within {timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def pooled_session(connections: int):
    """A requests Session that keeps up to `connections` connections to a host. requests keeps 10:
    each request in flight beyond them would open a connection of its own (a TLS handshake) and close
    it after the reply."""
    import requests  # noqa: PLC0415  # only the clients that send requests pay
    from requests.adapters import HTTPAdapter  # noqa: PLC0415

    session = requests.Session()
    adapter = HTTPAdapter(pool_maxsize=max(10, connections))
    session.mount("https://", adapter)
    session.mount("http://", adapter)
    return session


def budget_share(budget: int, tasks: int, task: int) -> int:
    """Task `task`'s share of a job-wide budget of requests in flight, among `tasks` tasks that run at
    once: the shares differ by one at most and add up to the budget exactly. At least 1: every task
    keeps one request in flight, which is why a job runs no more tasks than its smallest budget
    (crag.backends.smallest_budget)."""
    tasks = max(1, tasks)
    return max(1, budget // tasks + (task % tasks < budget % tasks))


# The task this process runs: a Spark Python worker runs one task at a time, and the task's Spark
# partition number tells which share of every budget is its own (set by crag.spark's task function;
# 0 outside Spark, where one process has every task's share when it is the only task).
_task = 0
# Tasks this process has started: what a client works out once per task (the request context mlflow
# describes in its headers) is keyed by it.
_tasks_started = 0


def running_task(index: int) -> None:
    global _task, _tasks_started
    _task, _tasks_started = index, _tasks_started + 1


def tasks_started() -> int:
    return _tasks_started


class Endpoint:
    """One remote endpoint as the job sees it.

    `policy.max_concurrency` is the budget of in-flight requests for the whole job. Spark runs
    `concurrent_tasks` partitions at once, each in its own Python process, and each process may have
    its task's share of the budget in flight (budget_share).
    """

    def __init__(self, name: str, policy: EndpointPolicy, concurrent_tasks: int = 1, hard_timeout: bool = False):
        self.name = name
        self.policy = policy
        self._tasks = max(1, concurrent_tasks)
        # the threads a stage may keep busy: the largest share a task gets (task 0's)
        self.concurrency = budget_share(policy.max_concurrency, self._tasks, 0)
        self._limits: dict[int, threading.BoundedSemaphore] = {}
        self._limits_lock = threading.Lock()
        self.hard_timeout = hard_timeout  # for clients without a timeout of their own (Vector Search)
        self.server_slots: int | None = None  # requests the server itself runs at once, when it says

    def limit_to_server(self, slots: int) -> None:
        """Keep no more requests in flight than the server runs at once (its slots): one sent beyond
        them waits in the server's queue, and its wait there counts against its timeout, where a wait
        on the client does not."""
        self.server_slots = max(1, slots)
        self.concurrency = min(self.concurrency, self.server_slots)

    def _slots(self) -> threading.BoundedSemaphore:
        """The running task's share of the budget. The backends outlive a task, and the next task in
        this process may have the other share size: one semaphore per size (no slot is held between
        two tasks: a request abandoned on a timeout gave its slot back when it was abandoned)."""
        share = budget_share(self.policy.max_concurrency, self._tasks, _task)
        share = min(share, self.server_slots or share)
        with self._limits_lock:
            if share not in self._limits:
                self._limits[share] = threading.BoundedSemaphore(share)
            return self._limits[share]

    def _wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        hinted = retry_after_s(exc) if exc else None
        initial = self.policy.backoff_initial_s
        backoff = wait_exponential_jitter(multiplier=initial, max=self.policy.backoff_max_s, jitter=initial)(state)
        return min(self.policy.backoff_max_s, hinted) if hinted is not None else backoff

    def call(self, fn: Callable[[], T], usage: Usage | None = None, unanswered_attempts: int | None = None) -> T:
        """fn() under the concurrency budget, retried on transient errors with exponential backoff and
        jitter (or the server's Retry-After), at most policy.max_attempts times. `unanswered_attempts`:
        give up after that many attempts the service did not answer (no HTTP status: a timeout, a
        refused connection), whatever attempts are left for errors it answered (429, 5xx)."""

        def before_sleep(state: RetryCallState) -> None:
            if usage is not None:
                usage.retries += 1

        stop: stop_base = stop_after_attempt(self.policy.max_attempts)
        if unanswered_attempts is not None:
            stop = stop_any(stop, _StopAfterUnanswered(unanswered_attempts))
        retrying = Retrying(
            retry=retry_if_exception(is_transient),
            wait=self._wait,
            stop=stop,
            before_sleep=before_sleep,
            reraise=True,
        )
        return retrying(self._attempt, fn, usage)

    def _attempt(self, fn: Callable[[], T], usage: Usage | None) -> T:
        slots = self._slots()
        if not slots.acquire(blocking=False):
            # Every slot is taken: the call waits here, on the client, and its timeout starts only
            # once it is sent.
            waiting = time.perf_counter()
            slots.acquire()
            if usage is not None:
                usage.queued_calls += 1
                usage.queue_ms += round((time.perf_counter() - waiting) * 1000)
        sent = time.perf_counter()
        try:
            if not self.hard_timeout:
                return fn()
            # On a timeout the request thread is abandoned, and its slot is released now.
            return call_with_deadline(fn, self.policy.timeout_s, self.name)
        finally:
            slots.release()
            if usage is not None:
                usage.add_call((time.perf_counter() - sent) * 1000)


class _StopAfterUnanswered(stop_base):
    """Stop once `attempts` attempts went unanswered: their error carries no HTTP status."""

    def __init__(self, attempts: int):
        self.attempts, self.unanswered = attempts, 0

    def __call__(self, retry_state: RetryCallState) -> bool:
        error = retry_state.outcome.exception() if retry_state.outcome is not None else None
        self.unanswered += error is not None and http_status(error) is None
        return self.unanswered >= self.attempts


def on_databricks() -> bool:
    return bool(os.environ.get("DATABRICKS_RUNTIME_VERSION"))


def secret(
    env_name: str,
    secret_ref: str | None,
    what: str,
    secrets: dict[str, str] | None = None,
    optional_on_databricks: bool = False,
) -> str | None:
    """A credential: from `secrets` (resolved on the driver and shipped to workers), the environment
    variable `env_name`, or a Databricks secret scope "scope/key". Never logged, never stored: every
    value read here is remembered by crag.secrets, which masks it in every error text and stored config.
    `optional_on_databricks`: on a Databricks cluster the workspace URL and token may be left to the
    runtime's own authentication (None is returned). `env_name` and `secret_ref` are names, checked as
    such when the config was loaded (crag.config.EnvName, SecretRef)."""
    value = _read_secret(env_name, secret_ref, what, secrets, optional_on_databricks)
    if value is not None:
        # A key pasted or read from a file often ends in a newline; one holding a control character
        # inside would be echoed, escaped, by the HTTP library's error.
        value = value.strip()
        remember([value])
        if _CONTROL.search(value):
            raise ConfigError(f"the credential for {what} ({env_name}) holds a control character: it is not usable")
    return value


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def credential_key(env_name: str, secret_ref: str | None) -> str:
    """How a resolved credential is filed among the `secrets` shipped to workers: by its variable and
    its secret reference, since sections that share the variable's name (every Databricks section
    defaults to DATABRICKS_TOKEN) may each name a secret of their own."""
    return env_name if secret_ref is None else f"{env_name} {secret_ref}"


def workspace_credentials(auth, what: str, secrets: dict[str, str] | None) -> tuple[str, str] | None:
    """(workspace URL, token) of a Databricks client from a section's host_env / token_env /
    token_secret, or None: on Databricks, with neither at hand, the runtime's own authentication (a job
    resolves the runtime's on its driver: see crag.backends.resolve_credentials). A token without a
    workspace URL is refused: the client would drop it and use the runtime's identity."""
    host = secret(auth.host_env, None, f"{what} (workspace URL)", secrets, optional_on_databricks=True)
    token = secret(auth.token_env, auth.token_secret, what, secrets, optional_on_databricks=True)
    if token and not host:
        raise ConfigError(
            f"{what} has a token ({auth.token_env} or token_secret) but no workspace URL: set {auth.host_env} "
            f"to the workspace it belongs to"
        )
    return (host, token) if host and token else None


def runtime_workspace() -> tuple[str, str]:
    """On a Databricks driver left to the runtime's own authentication: its workspace URL and a bearer
    token of the job's identity, from databricks-sdk (auth type `runtime`). The driver resolves them
    for the Spark workers, which cannot: they run outside the notebook context the runtime's auth
    reads (on serverless, without even the driver's environment)."""
    from databricks.sdk.core import Config  # noqa: PLC0415  # only on Databricks

    advice = (
        "give the Databricks sections a token (token_secret: scope/key) and set DATABRICKS_HOST to the workspace URL"
    )
    try:
        config = Config()
        scheme, _, token = config.authenticate().get("Authorization", "").partition(" ")
    except Exception as exc:
        raise ConfigError(
            f"the Databricks runtime's own authentication gave no token ({type(exc).__name__}): {advice}"
        ) from None
    if scheme.lower() != "bearer" or not token.strip() or not config.host:
        raise ConfigError(
            f"the Databricks runtime's own authentication ({config.auth_type}) gives no bearer token the "
            f"workers can use: {advice}"
        )
    remember([token.strip()])
    return config.host, token.strip()


def _read_secret(
    env_name: str, secret_ref: str | None, what: str, secrets: dict[str, str] | None, optional_on_databricks: bool
) -> str | None:
    key = credential_key(env_name, secret_ref)
    if secrets and key in secrets:
        return secrets[key]
    value = os.environ.get(env_name)
    if value:
        return value
    if secret_ref and on_databricks():  # elsewhere the SDK would go looking for a workspace
        scope, _, key = secret_ref.partition("/")
        try:
            from databricks.sdk.runtime import dbutils  # noqa: PLC0415  # only on Databricks

            return dbutils.secrets.get(scope=scope, key=key)
        except Exception as exc:  # no such secret, or no permission to read it: the config asked for it
            raise ConfigError(
                f"missing credential for {what}: {env_name} is not set and secret {secret_ref!r} "
                f"could not be read ({type(exc).__name__})"
            ) from None
    if optional_on_databricks and on_databricks():
        return None
    where = f" (secret {secret_ref!r} is read only on Databricks)" if secret_ref else ""
    raise ConfigError(f"missing credential for {what}: set the environment variable {env_name}{where}")
