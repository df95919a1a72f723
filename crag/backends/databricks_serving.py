"""Databricks model serving through `mlflow.deployments.get_deploy_client("databricks")`.

Chat endpoints take OpenAI chat-completion bodies. A custom (pyfunc) endpoint can also grade a whole
batch of documents in one request, the shape reference flow 1 uses:
    {"inputs": [{"prompt": doc}, ...], "params": {"system_prompt", "json_schema", "temperature",
     "max_tokens", "stop"}}  ->  {"predictions": [{"output": "<json>"}, ...]}
"""

from __future__ import annotations

import json
import math
import os
import threading
from typing import TYPE_CHECKING

from crag.backends.base import Usage
from crag.backends.parsing import content_text
from crag.backends.remote import Endpoint, tasks_started, workspace_credentials
from crag.config import LLMConfig

if TYPE_CHECKING:  # mlflow takes seconds to import: only this backend's clients pay, when they are built
    from mlflow.tracking.request_header.abstract_request_header_provider import RequestHeaderProvider


class DatabricksServing:
    def __init__(
        self, cfg: LLMConfig, secrets: dict[str, str] | None = None, concurrent_tasks: int = 1, connections: int = 0
    ):
        """`connections`: the requests the job may have in flight to the workspace's serving endpoints
        at once (their budgets together), which is more than any one process has."""
        workspace = workspace_credentials(cfg, f"Databricks serving endpoint {cfg.endpoint!r}", secrets)
        # mlflow reads the workspace, token and timeouts from the process environment at each request.
        # They are this client's settings, set before its first request (not before: the driver builds
        # clients to check them, and its own MLflow logging must keep mlflow's retries), and again
        # whenever another client (of another run in the same Spark worker process) has changed them.
        self._environment: dict[str, str] = {}
        if workspace is not None:  # otherwise (on Databricks, not given the driver's) the runtime's own auth
            host, token = workspace
            # With a token at hand mlflow's plain HTTP path is used: through the Databricks SDK, mlflow
            # builds a new WorkspaceClient for every request (a host-metadata request and a new
            # connection each, ~3.5 ms of CPU per call) and retries 429s itself, out of crag's sight.
            self._environment.update(DATABRICKS_HOST=host, DATABRICKS_TOKEN=token, MLFLOW_ENABLE_DB_SDK="false")
        # mlflow's own HTTP retries are switched off (crag's policy retries and counts them); the
        # per-call timeout is crag's.
        timeout = str(max(1, math.ceil(cfg.policy.timeout_s)))
        # mlflow keeps 10 connections to a host (MLFLOW_HTTP_POOL_MAXSIZE, read once per process, when
        # its HTTP session is made); each request in flight beyond them opens a connection of its own
        # (on a workspace, a TLS handshake) and closes it after the reply. A value set by the user stays.
        if "MLFLOW_HTTP_POOL_MAXSIZE" not in os.environ and connections > 10:
            self._environment["MLFLOW_HTTP_POOL_MAXSIZE"] = str(connections)
        self._environment.update(
            MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
            MLFLOW_DEPLOYMENT_PREDICT_TIMEOUT=timeout,
            MLFLOW_DEPLOYMENT_PREDICT_TOTAL_TIMEOUT=timeout,
        )
        from mlflow.deployments import get_deploy_client  # noqa: PLC0415  # MLflow takes seconds to import: only this backend pays

        self._client = get_deploy_client("databricks")
        _resolve_request_context_once_per_task()
        self.endpoint_name = cfg.endpoint
        self.name = f"databricks:{cfg.endpoint}"
        self._endpoint = Endpoint(self.name, cfg.policy, concurrent_tasks)
        self.concurrency = self._endpoint.concurrency

    def _use_environment(self) -> None:
        if any(os.environ.get(k) != v for k, v in self._environment.items()):
            os.environ.update(self._environment)

    def _predict(self, body: dict, usage: Usage) -> dict:
        def predict():
            self._use_environment()
            return self._client.predict(endpoint=self.endpoint_name, inputs=body)

        reply = self._endpoint.call(predict, usage)
        usage.llm_calls += 1
        return dict(reply)

    def context_window(self) -> int | None:
        return None  # a serving endpoint does not say: the role's context_tokens, if set

    def chat(
        self, messages, usage, *, max_tokens, temperature, json_schema=None, regex=None, structured="json_schema"
    ) -> str:
        # `structured`: serving endpoints take json_schema only (the config allows no other mode here)
        body: dict = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature}
        if json_schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": json_schema}
        reply = self._predict(body, usage)
        tokens = reply.get("usage") or {}
        usage.prompt_tokens += int(tokens.get("prompt_tokens") or 0)
        usage.completion_tokens += int(tokens.get("completion_tokens") or 0)
        return message_text(reply)

    def batch(
        self,
        system_prompt: str,
        prompts: list[str],
        usage: Usage,
        *,
        max_tokens: int,
        temperature: float,
        json_schema: dict | None = None,
        stop: list[str] | None = None,
    ) -> list[str]:
        """One request, one output per prompt (in order)."""
        params: dict = {"system_prompt": system_prompt, "temperature": temperature, "max_tokens": max_tokens}
        if json_schema is not None:
            # pyfunc params are scalars: the schema travels as a JSON string
            params["json_schema"] = json.dumps(json_schema["schema"])
        if stop:
            params["stop"] = stop
        reply = self._predict({"inputs": [{"prompt": p} for p in prompts], "params": params}, usage)
        predictions = reply.get("predictions")
        if not isinstance(predictions, list) or len(predictions) != len(prompts):
            got = len(predictions) if isinstance(predictions, list) else type(predictions).__name__
            raise ValueError(
                f"batch endpoint {self.endpoint_name!r} returned {got} predictions for {len(prompts)} inputs"
            )
        return [p.get("output", "") if isinstance(p, dict) else str(p) for p in predictions]


class _OncePerTask:
    """One of mlflow's request header providers, asked once per Spark task (once per process outside
    Spark) instead of at every request. mlflow asks its Databricks provider before each request
    whether it runs in a Databricks notebook, job or cluster; off Databricks (a Spark cluster of your
    own, a laptop) each answer takes nine imports that fail (0.3-1.2 ms of CPU per request on this
    repository's machines, under Python's import lock, which a worker's request threads take in
    turn). The answer describes the process and the task it runs (mlflow reads the task's Spark
    properties), so a worker that runs the next task, of another job perhaps, asks again."""

    def __init__(self, provider: RequestHeaderProvider) -> None:
        self.provider = provider
        self._lock = threading.Lock()
        self._task: int | None = None
        self._answer: tuple[bool, dict] = (False, {})

    def _answered(self) -> tuple[bool, dict]:
        task = tasks_started()
        with self._lock:
            if self._task != task:
                in_context = self.provider.in_context()
                self._answer = (in_context, self.provider.request_headers() if in_context else {})
                self._task = task
            return self._answer

    def in_context(self) -> bool:
        return self._answered()[0]

    def request_headers(self) -> dict:
        return dict(self._answered()[1])


def _resolve_request_context_once_per_task() -> None:
    """Wrap mlflow's Databricks request header provider in `_OncePerTask` (once per process). The
    registry is mlflow's own, not its API: an mlflow without it (a runtime's other version) is left
    to ask at every request, as it would."""
    try:
        from mlflow.tracking.request_header.databricks_request_header_provider import (  # noqa: PLC0415  # as above
            DatabricksRequestHeaderProvider,
        )
        from mlflow.tracking.request_header.registry import _request_header_provider_registry  # noqa: PLC0415

        providers = _request_header_provider_registry._registry
    except (ImportError, AttributeError):
        return
    for i, provider in enumerate(providers):
        if type(provider) is DatabricksRequestHeaderProvider:
            providers[i] = _OncePerTask(provider)


def message_text(reply: dict) -> str:
    """The assistant's text from a chat-completion reply."""
    choices = reply.get("choices") or []
    if not choices:
        raise ValueError("chat completion reply has no choices")
    return content_text((choices[0].get("message") or {}).get("content"))
