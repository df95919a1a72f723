"""The emulators' HTTP server: one loopback server answers every emulated service, routing each request
by its path, and adds the faults (429 with Retry-After, 500, hangs, malformed output), latency and
capacity limit set per service, for reliability tests and throughput benchmarks."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from requests.structures import CaseInsensitiveDict  # header names are case-insensitive

from crag.backends.bm25 import load_index
from crag.backends.extractive import ExtractiveGenerator
from crag.backends.lexical import KeywordRewriter, LexicalScorer
from crag.emulators.serving import description, serving
from crag.emulators.tavily import tavily
from crag.emulators.vector_search import vector_search
from crag.text import TermWeights

SERVICES = ("serving", "vector_search", "tavily")
# malformed: a reply in no requested format; prose: the right reply wrapped in chatter and a code fence;
# blocks: the right chat reply as a list of content blocks, reasoning first (as gpt-oss models give it)
FAULTS = ("429", "500", "hang", "malformed", "prose", "blocks")
# What a workspace's host metadata gives as its id (the SDK fills Config.workspace_id from it).
WORKSPACE_ID = "1234567890123456"


@dataclass
class Recorded:
    service: str
    method: str
    path: str
    headers: CaseInsensitiveDict
    body: Any


@dataclass
class ServiceBehaviour:
    latency_s: float = 0.0
    capacity: int | None = None  # concurrent requests each endpoint serves; beyond it: 429 with Retry-After
    fault_rates: dict[str, float] = field(default_factory=dict)  # e.g. {"429": 0.05, "hang": 0.02}
    scripted: list[str] = field(default_factory=list)  # faults for the next requests, in order ("ok" = none)
    # serving: which OpenAI-compatible server /v1 answers as (crag.emulators.serving.CHAT_SERVERS)
    chat_server: str = "vllm"
    context_tokens: int | None = None  # serving: a prompt and max_tokens over it are refused (HTTP 400)
    slots: int = 1  # serving as llama.cpp: the total_slots its /props gives


class Emulator:
    def __init__(
        self,
        kb_index: str | None = None,
        web_index: str | None = None,
        token: str | None = None,
        seed: int = 0,
        hang_s: float = 5.0,
        retry_after_s: int = 0,  # whole seconds: HTTP's delay-seconds (a client refuses 0.05: urllib3 did)
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        self.kb_index, self.web_index = kb_index, web_index
        self.token = token  # when set, requests must carry "Authorization: Bearer <token>" (Tavily: the same key)
        self.hang_s, self.retry_after_s = hang_s, retry_after_s
        self.behaviour = {s: ServiceBehaviour() for s in SERVICES}
        self.requests: list[Recorded] = []
        self.faults_injected: dict[str, int] = defaultdict(int)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._in_flight: dict[tuple[str, str], int] = defaultdict(int)
        self.peak_in_flight: dict[str, int] = defaultdict(int)  # most requests served at once, per service
        self.connections = 0  # connections clients opened (each carries requests until one side closes it)
        self.spans: list[tuple[str, float, float]] = []  # (endpoint, admitted, released) of each admitted request
        # Vector Search indexes that exist: None = any name (each serves kb_index); a dict = only those
        # created through the API (name -> create request), for index-building tests.
        self.vector_indexes: dict[str, dict] | None = None
        self.syncs: list[str] = []
        self._model = None
        self._replies: dict[tuple[str, str], str] = {}
        self._server = ThreadingHTTPServer((host, port), _handler(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # -------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host.decode() if isinstance(host, bytes) else host}:{port}"

    def start(self) -> Emulator:
        self._thread = threading.Thread(target=self._server.serve_forever, name="crag-emulator", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> Emulator:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def of(self, service: str) -> list[Recorded]:
        return [r for r in self.requests if r.service == service]

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.faults_injected.clear()
            self.peak_in_flight.clear()
            self.spans.clear()
            self.connections = 0
            for b in self.behaviour.values():
                b.scripted.clear()

    # -------------------------------------------------------------- the lexical "model"

    @property
    def model(self):
        if self._model is None:
            weights = TermWeights({}, 1)
            tokenizer = "cjk_ngram"
            for path in (self.kb_index, self.web_index):
                if path:
                    index = load_index(path)
                    weights, tokenizer = weights.merged(index.term_weights), index.tokenizer
            scorer = LexicalScorer(weights, tokenizer)
            self._model = (scorer, KeywordRewriter([]), ExtractiveGenerator(scorer, 2, 0.2))
        return self._model

    def _fault(self, service: str) -> str:
        with self._lock:
            b = self.behaviour[service]
            if b.scripted:
                fault = b.scripted.pop(0)
            else:
                fault, roll = "ok", self._rng.random()
                for name in FAULTS:
                    rate = b.fault_rates.get(name, 0.0)
                    if roll < rate:
                        fault = name
                        break
                    roll -= rate
            if fault != "ok":
                self.faults_injected[fault] += 1
            return fault

    def _admit(self, service: str, endpoint: str) -> float | None:
        """The admission time, or None when the endpoint is at capacity."""
        with self._lock:
            cap = self.behaviour[service].capacity
            if cap is not None and self._in_flight[("endpoint", endpoint)] >= cap:
                self.faults_injected["capacity_429"] += 1
                return None
            # counted per endpoint and per service apart ("tavily" is both an endpoint and a service)
            for key, name in ((("endpoint", endpoint), endpoint), (("service", service), service)):
                self._in_flight[key] += 1
                self.peak_in_flight[name] = max(self.peak_in_flight[name], self._in_flight[key])
            return time.perf_counter()

    def _release(self, service: str, endpoint: str, admitted: float) -> None:
        with self._lock:
            self.spans.append((endpoint, admitted, time.perf_counter()))
            self._in_flight[("endpoint", endpoint)] -= 1
            self._in_flight[("service", service)] -= 1


# ------------------------------------------------------------------ request handling


def _service_of(path: str) -> str | None:
    if path.startswith("/api/2.0/vector-search/"):
        return "vector_search"
    if path.startswith(("/serving-endpoints/", "/v1/chat/completions", "/api/2.0/serving-endpoints/")):
        return "serving"
    if path == "/search":
        return "tavily"
    return None


def endpoint_of(service: str, path: str, body: Any) -> str:
    """The endpoint a request is for (capacity is per endpoint, as on Databricks): a serving endpoint
    or model name, a Vector Search index, or Tavily."""
    if service == "serving":
        if path.startswith("/serving-endpoints/") and path.endswith("/invocations"):
            return f"serving:{path.split('/')[2]}"
        return f"serving:{body.get('model') if isinstance(body, dict) else '?'}"
    if service == "vector_search":
        parts = path.strip("/").split("/")
        return f"vector_search:{parts[4] if len(parts) > 4 else '?'}"
    return "tavily"


def _handler(emulator: Emulator):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def log_message(self, *args):  # quiet: the tests read emulator.requests instead
            pass

        def setup(self) -> None:  # once per connection
            super().setup()
            with emulator._lock:
                emulator.connections += 1

        def _reply(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
            body = json.dumps(payload).encode()
            try:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (its timeout): nothing to answer

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except json.JSONDecodeError:
                body = raw.decode("utf-8", "replace")
            path = self.path.split("?")[0]
            if path == "/.well-known/databricks-config":  # the Databricks SDK's first request to a host
                return self._reply(200, {"oidc_endpoint": f"{emulator.url}/oidc", "workspace_id": WORKSPACE_ID})
            described = description(emulator.behaviour["serving"], self.command, path)
            if described is not None:
                return self._reply(*described)
            service = _service_of(path)
            if service is None:
                return self._reply(404, {"error_code": "ENDPOINT_NOT_FOUND", "message": f"no route {path}"})
            with emulator._lock:
                emulator.requests.append(
                    Recorded(service, self.command, path, CaseInsensitiveDict(self.headers.items()), body)
                )
            if emulator.token is not None:
                auth = self.headers.get("Authorization", "")
                key = body.get("api_key") if isinstance(body, dict) else None
                if auth != f"Bearer {emulator.token}" and key != emulator.token:
                    return self._reply(401, {"error_code": "UNAUTHENTICATED", "message": "invalid token"})
            return self._reply(*_served(emulator, service, self.command, path, body))

        do_GET = do_POST = do_PATCH = _handle

    return Handler


def _served(emulator: Emulator, service: str, command: str, path: str, body) -> tuple[int, Any, dict | None]:
    """A request to a service as the service answers it: within the endpoint's capacity (429 beyond it),
    after its latency, with any fault injected; (status, payload, headers)."""
    endpoint = endpoint_of(service, path, body)
    admitted = emulator._admit(service, endpoint)
    if admitted is None:
        slow_down = {"Retry-After": str(int(emulator.retry_after_s))}
        return 429, {"error_code": "REQUEST_LIMIT_EXCEEDED", "message": "capacity"}, slow_down
    # The slot is released before the reply is written: once the client has its answer it may send the
    # next request at once, and that one must find the slot free.
    try:
        behaviour = emulator.behaviour[service]
        fault = emulator._fault(service)
        if behaviour.latency_s:
            time.sleep(behaviour.latency_s)
        if fault == "429":
            slow_down = {"Retry-After": str(int(emulator.retry_after_s))}
            return 429, {"error_code": "REQUEST_LIMIT_EXCEEDED", "message": "slow down"}, slow_down
        if fault == "500":
            return 500, {"error_code": "INTERNAL_ERROR", "message": "injected failure"}, None
        if fault == "hang":
            time.sleep(emulator.hang_s)
        status, payload = ROUTES[service](emulator, command, path, body, fault=fault)
        return status, payload, None
    finally:
        emulator._release(service, endpoint, admitted)


ROUTES = {"serving": serving, "vector_search": vector_search, "tavily": tavily}
