"""Any OpenAI-compatible chat server through the `openai` client: vLLM, SGLang, Ollama, llama.cpp's
server, llama-cpp-python's, OpenAI, or Databricks' /serving-endpoints.

A role's reply is kept to its JSON schema in the structured-output mode the config names
(crag.backends.structured), or in the first one the server accepts when it says `auto`: probed once
per client, with a one-token question. What the server says about itself is read once too (GET
requests, not chat calls): its context window, for the roles' token budget, and how many requests it
runs at once, which caps the requests crag keeps in flight (llama.cpp's /props; vLLM's /v1/models;
llama-cpp-python's server, named by its OpenAPI title, runs one).

A request the server refuses as invalid or unsupported fails at once with the server's reason on one
line (RefusedRequest), never retried; a prompt over the server's context is a ContextOverflow, its
question's error.
"""

from __future__ import annotations

import threading
from urllib.parse import urlsplit, urlunsplit

from crag.backends.base import Usage
from crag.backends.parsing import content_text
from crag.backends.remote import Endpoint, RefusedRequest, error_message, http_status, refused_as_invalid, secret
from crag.backends.structured import PROBED_MODES, PROBED_MODES_GBNF, object_schema, request_fields
from crag.config import LLMConfig

PROBE_SCHEMA = object_schema("probe", ok={"type": "string", "enum": ["yes"]})
PROBE_MESSAGES = [{"role": "user", "content": 'Reply with {"ok": "yes"}.'}]
# What a server's description is read with: a short wait, since a server that does not describe
# itself leaves the defaults in place
_DESCRIBE_TIMEOUT_S = 5.0


class ContextOverflow(ValueError):
    """A prompt the server refused as longer than its context window."""


class OpenAICompatible:
    def __init__(
        self,
        cfg: LLMConfig,
        secrets: dict[str, str] | None = None,
        concurrent_tasks: int = 1,
        regex_key: str = "guided_regex",
    ):
        from openai import OpenAI  # noqa: PLC0415  # a heavy client: only this backend pays

        where = cfg.base_url or "api.openai.com"
        key = secret(
            cfg.api_key_env, cfg.api_key_secret, f"OpenAI-compatible model {cfg.endpoint!r} at {where}", secrets
        )
        # max_retries=0: crag's policy retries (and counts) instead of the client.
        self._client = OpenAI(api_key=key, base_url=cfg.base_url, max_retries=0, timeout=cfg.policy.timeout_s)
        self.model = cfg.endpoint
        self.regex_key = regex_key
        self.name = f"openai:{cfg.endpoint}"
        self._endpoint = Endpoint(self.name, cfg.policy, concurrent_tasks)
        self.concurrency = self._endpoint.concurrency
        self._described = cfg.base_url is None  # api.openai.com describes none of this
        self._context: int | None = None
        self._takes_gbnf = False  # a llama.cpp server, which takes GBNF grammars
        self._auto: str | None = None  # the mode `auto` resolved to
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ what the server says

    def context_window(self) -> int | None:
        """The server's context window in tokens, if it says."""
        self._describe()
        return self._context

    def _describe(self) -> None:
        """Read what the server says once; the first calls wait for it (the slot limit applies to them)."""
        with self._lock:
            if self._described:
                return
            facts = server_facts(self._client, self.model)
            self._context = facts.get("context")
            self._takes_gbnf = bool(facts.get("gbnf"))
            if facts.get("slots"):
                self._endpoint.limit_to_server(facts["slots"])
                self.concurrency = self._endpoint.concurrency
            self._described = True

    # ------------------------------------------------------------------ chat

    def chat(
        self,
        messages,
        usage: Usage,
        *,
        max_tokens,
        temperature,
        json_schema=None,
        regex=None,
        structured: str = "json_schema",
    ) -> str:
        self._describe()
        extra: dict = {}
        if json_schema is not None:
            extra = request_fields(self._mode(structured, usage), json_schema)
        if regex is not None:
            extra[self.regex_key] = regex
        return self._complete(messages, usage, max_tokens, temperature, extra)

    def _mode(self, structured: str, usage: Usage) -> str:
        if structured != "auto":
            return structured
        with self._lock:  # one probe, which the other first calls wait for
            if self._auto is None:
                self._auto = self._probe(usage)
            return self._auto

    def _probe(self, usage: Usage) -> str:
        """The first structured-output mode the server accepts; its calls count in `usage`."""
        refused = []
        for mode in PROBED_MODES_GBNF if self._takes_gbnf else PROBED_MODES:
            try:
                self._complete(PROBE_MESSAGES, usage, 8, 0.0, request_fields(mode, PROBE_SCHEMA))
                return mode
            except RefusedRequest as exc:
                refused.append(f"{mode}: {exc.reason}")
        raise RefusedRequest(
            f"{self.name} takes none of crag's structured-output modes ({'; '.join(refused)}): set the role's "
            "structured_output to guided_json (vLLM) or none"
        )

    def _complete(self, messages, usage: Usage, max_tokens: int, temperature: float, extra: dict) -> str:
        def create():
            return self._client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=max_tokens, temperature=temperature, extra_body=extra
            )

        try:
            reply = self._endpoint.call(create, usage)
        except Exception as exc:
            refusal = _refusal(exc, self.name, extra)
            if refusal is None:
                raise
            raise refusal from None
        usage.llm_calls += 1
        if reply.usage is not None:
            usage.prompt_tokens += reply.usage.prompt_tokens or 0
            usage.completion_tokens += reply.usage.completion_tokens or 0
        if not reply.choices:
            raise ValueError("chat completion reply has no choices")
        return content_text(reply.choices[0].message.content)


def _refusal(exc: Exception, name: str, extra: dict) -> Exception | None:
    """The one-line error for a request the server refused (None: another failure). A refused call
    still counted nothing: the server answered no completion."""
    if not refused_as_invalid(exc):
        return None
    said = error_message(exc)[:300]
    reason = f"HTTP {http_status(exc)}: {said}"
    if getattr(exc, "code", None) == "context_length_exceeded" or ("context" in said.lower() and "token" in said):
        return ContextOverflow(
            f"{name}: the prompt does not fit the server's context window ({reason}); "
            "set the role's context_tokens to the server's context, so crag cuts documents to fit, or lower "
            "max_doc_chars"
        )
    asked = ", ".join(sorted(extra)) or "a plain chat completion"
    return RefusedRequest(f"{name} refused the request ({asked}) with {reason}", reason)


def server_facts(client, model: str) -> dict[str, int]:
    """What an OpenAI-compatible server says about itself: `context` (its context window in tokens),
    `slots` (requests it runs at once) and `gbnf` (1: it takes GBNF grammars), each when it says. Read
    with GET requests that fail quietly: a server that does not answer them is described by the
    config alone."""
    facts: dict[str, int] = {}
    base = str(client.base_url).rstrip("/")
    parts = urlsplit(base)
    root = urlunsplit((parts.scheme, parts.netloc, parts.path.removesuffix("/v1"), "", ""))
    props = _get_json(client, f"{root}/props")  # llama.cpp's server
    settings = props.get("default_generation_settings") if isinstance(props, dict) else None
    context = (settings or {}).get("n_ctx") if isinstance(settings, dict) else None
    if isinstance(props, dict) and isinstance(props.get("total_slots"), int):
        facts["slots"], facts["gbnf"] = props["total_slots"], 1
    models = _get_json(client, f"{base}/models")  # vLLM: max_model_len of each model
    for entry in models.get("data", []) if isinstance(models, dict) else []:
        if isinstance(entry, dict) and entry.get("id") == model and isinstance(entry.get("max_model_len"), int):
            context = context or entry["max_model_len"]
    if isinstance(context, int) and context > 0:
        facts["context"] = context
    if "slots" not in facts:
        described = _get_json(client, f"{root}/openapi.json")
        title = ((described or {}).get("info") or {}).get("title", "") if isinstance(described, dict) else ""
        if "llama.cpp Python" in str(title):  # llama-cpp-python's server runs one request at a time
            facts["slots"], facts["gbnf"] = 1, 1
    return facts


def _get_json(client, url: str):
    # through the OpenAI client's own connection pool (its way to reach undocumented endpoints), with
    # its headers: a client of another HTTP library would cost an import and a TLS context (20 ms)
    try:
        return client.get(url, cast_to=object, options={"timeout": _DESCRIBE_TIMEOUT_S})
    except Exception:  # a server that does not describe itself: the config's settings hold
        return None
