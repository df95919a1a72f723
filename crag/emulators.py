"""Loopback emulators of the production services, speaking their REST protocols exactly, so that the
real client libraries (mlflow deployments, openai, databricks-vectorsearch, tavily-python) can be
pointed at them: by the tests, by the benchmarks, and by `crag emulate` for trying a production config
on a laptop.

One server answers all of them:
    GET  /.well-known/databricks-config                     404 (the Databricks SDK asks first)
    POST /serving-endpoints/{name}/invocations              chat completions, or the batch shape
                                                            {"inputs": [{"prompt"}], "params"} -> {"predictions"}
    POST /serving-endpoints/chat/completions, /v1/chat/completions   OpenAI-compatible chat
    GET  /api/2.0/vector-search/endpoints/{ep}/indexes/{idx}          describe an index
    GET|POST /api/2.0/vector-search/indexes/{idx}/query               similarity search
    GET  /api/2.0/serving-endpoints/{name}                  describe a serving endpoint
    POST /api/2.0/vector-search/endpoints/{ep}/indexes, .../sync      create / sync (recorded)
    POST /search                                            Tavily

The emulated model is not a language model: it reads the question and documents from between the
delimiters of crag's prompts and answers with the lexical grader and the extractive answerer, so its
outputs are deterministic and grounded. Faults (429 with Retry-After, 500, hangs, malformed output),
latency and a capacity limit per service can be set, for reliability tests and throughput benchmarks.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from requests.structures import CaseInsensitiveDict  # header names are case-insensitive

SERVICES = ("serving", "vector_search", "tavily")
# malformed: a reply in no requested format; prose: the right reply wrapped in chatter and a code fence
FAULTS = ("429", "500", "hang", "malformed", "prose")


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


class Emulator:
    def __init__(
        self,
        kb_index: str | None = None,
        web_index: str | None = None,
        token: str | None = None,
        seed: int = 0,
        hang_s: float = 5.0,
        retry_after_s: float = 0.05,
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
        return f"http://{host}:{port}"

    def start(self) -> "Emulator":
        self._thread = threading.Thread(target=self._server.serve_forever, name="crag-emulator", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "Emulator":
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
            for b in self.behaviour.values():
                b.scripted.clear()

    # -------------------------------------------------------------- the lexical "model"

    @property
    def model(self):
        if self._model is None:
            from crag.backends.bm25 import load_index
            from crag.backends.extractive import ExtractiveGenerator
            from crag.backends.lexical import KeywordRewriter, LexicalScorer
            from crag.text import TermWeights

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
            if path == "/.well-known/databricks-config":
                return self._reply(404, {"error_code": "NOT_FOUND", "message": "no such config"})
            service = _service_of(path)
            if service is None:
                return self._reply(404, {"error_code": "ENDPOINT_NOT_FOUND", "message": f"no route {path}"})
            with emulator._lock:
                emulator.requests.append(Recorded(service, self.command, path, CaseInsensitiveDict(self.headers.items()), body))
            if emulator.token is not None:
                auth = self.headers.get("Authorization", "")
                key = body.get("api_key") if isinstance(body, dict) else None
                if auth != f"Bearer {emulator.token}" and key != emulator.token:
                    return self._reply(401, {"error_code": "UNAUTHENTICATED", "message": "invalid token"})
            endpoint = endpoint_of(service, path, body)
            admitted = emulator._admit(service, endpoint)
            if admitted is None:
                return self._reply(429, {"error_code": "REQUEST_LIMIT_EXCEEDED", "message": "capacity"},
                                   {"Retry-After": f"{emulator.retry_after_s:g}"})
            # The slot is released before the reply is written: once the client has its answer it may
            # send the next request at once, and that one must find the slot free.
            try:
                behaviour = emulator.behaviour[service]
                fault = emulator._fault(service)
                if behaviour.latency_s:
                    time.sleep(behaviour.latency_s)
                if fault == "429":
                    reply = (429, {"error_code": "REQUEST_LIMIT_EXCEEDED", "message": "slow down"},
                             {"Retry-After": f"{emulator.retry_after_s:g}"})
                elif fault == "500":
                    reply = (500, {"error_code": "INTERNAL_ERROR", "message": "injected failure"}, None)
                else:
                    if fault == "hang":
                        time.sleep(emulator.hang_s)
                    status, payload = ROUTES[service](emulator, self.command, path, body, fault=fault)
                    reply = (status, payload, None)
            finally:
                emulator._release(service, endpoint, admitted)
            return self._reply(*reply)

        do_GET = do_POST = do_PATCH = _handle

    return Handler


# ------------------------------------------------------------------ model serving


# A block opens with its tag alone on a line (as in crag's prompts); "the <document> tags" in the
# instructions is prose, not a block.
_TAG = {name: re.compile(rf"<{name}[^>]*>\n(.*?)\n</{name}>", re.S) for name in ("question", "document", "web_result")}


def _tag(name: str, text: str) -> str:
    match = _TAG[name].search(text)
    return match.group(1).strip() if match else ""


def _tokens(text: str) -> int:
    return max(1, len(text.split()))


def _model_reply(emulator: Emulator, system: str, user: str, fault: str) -> str:
    if fault == "malformed":
        return "I am not sure how to answer in the requested format."
    # The same prompt always gets the same reply: remembered, so that the emulator's own computing
    # does not compete for CPU with the client it serves in a benchmark.
    with emulator._lock:
        reply = emulator._replies.get((system, user))
    if reply is None:
        reply = _lexical_reply(emulator, system, user)
        with emulator._lock:
            if len(emulator._replies) < 50_000:
                emulator._replies[(system, user)] = reply
    return f"Sure! Here is my answer:\n```json\n{reply}\n```\nLet me know if you need more." if fault == "prose" else reply


def _lexical_reply(emulator: Emulator, system: str, user: str) -> str:
    """What the lexical model says to one prompt, read from crag's delimiters."""
    scorer, rewriter, generator = emulator.model
    prompt = f"{system}\n{user}"
    question = _tag("question", prompt)
    if "<web_result" in prompt:  # reference flow 3's source check: YES/NO
        relevance, _ = scorer.score(scorer.terms(question), _tag("web_result", prompt))
        return "YES" if relevance >= 0.5 else "NO"
    if "<document" in prompt and "<context" not in prompt:  # relevance grading
        relevance, matched = scorer.score(scorer.terms(question), _tag("document", prompt))
        if "Score:" in system:
            return f"Score: {round(relevance * 5)}\nReason: {len(matched)} of the question's terms appear in the document."
        return json.dumps({"grade": "yes" if relevance >= 0.5 else "no"})
    if "<context" in prompt:  # answer generation
        from crag.backends.base import Usage

        docs = [{"text": t} for t in _TAG["document"].findall(prompt)]
        answer = generator.generate(question, docs, Usage())
        if answer.text is None:
            refusal = re.search(r'exactly: "([^"]+)"', system)
            return refusal.group(1) if refusal else "I don't know."
        return answer.text + "".join(f" [{i + 1}]" for i in answer.cited)
    return rewriter.rewrite(question or user, None)  # web-query rewriting


def _messages_text(messages: list[dict]) -> tuple[str, str]:
    def content(m):
        c = m.get("content")
        return c if isinstance(c, str) else " ".join(b.get("text", "") for b in c or [] if isinstance(b, dict))

    system = "\n".join(content(m) for m in messages if m.get("role") == "system")
    user = "\n".join(content(m) for m in messages if m.get("role") != "system")
    return system, user


def _chat_completion(emulator: Emulator, body: dict, fault: str) -> dict:
    system, user = _messages_text(body.get("messages") or [])
    text = _model_reply(emulator, system, user, fault)
    return {
        "id": f"chatcmpl-{len(emulator.requests)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", "emulated"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": _tokens(system + user), "completion_tokens": _tokens(text),
                  "total_tokens": _tokens(system + user) + _tokens(text)},
    }


def _serving(emulator: Emulator, method: str, path: str, body: Any, fault: str):
    if path.startswith("/api/2.0/serving-endpoints/") and method == "GET":  # describe (the Vector Search client asks)
        name = path.rsplit("/", 1)[-1]
        return 200, {"id": f"ep-{name}", "name": name, "route_optimized": False, "state": {"ready": "READY"}}
    if not isinstance(body, dict):
        return 400, {"error_code": "BAD_REQUEST", "message": "expected a JSON object"}
    if "messages" in body:
        return 200, _chat_completion(emulator, body, fault)
    if "inputs" in body:  # the custom batch-grading endpoint of reference flow 1
        params = body.get("params") or {}
        system = params.get("system_prompt", "")
        outputs = [_model_reply(emulator, system, item.get("prompt", ""), fault) for item in body["inputs"]]
        return 200, {"predictions": [{"output": o} for o in outputs]}
    return 400, {"error_code": "BAD_REQUEST", "message": "expected messages or inputs"}


# ------------------------------------------------------------------ Vector Search


def _vector_search(emulator: Emulator, method: str, path: str, body: Any, fault: str):
    parts = path.strip("/").split("/")  # api 2.0 vector-search ...
    known = emulator.vector_indexes
    if parts[3] == "endpoints" and len(parts) == 7 and method == "GET":
        ep, idx = parts[4], parts[6]
        if known is not None and idx not in known:
            return 404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": f"Index {idx} does not exist"}
        return 200, {"name": idx, "endpoint_name": ep, "index_type": "DELTA_SYNC", "primary_key": "chunk_id",
                     "status": {"ready": True, "detailed_state": "ONLINE_NO_PENDING_UPDATE", "indexed_row_count": 0}}
    if parts[3] == "endpoints" and parts[-1] == "indexes" and method == "POST":  # create a Delta Sync index
        name = body.get("name")
        if known is not None:
            if name in known:
                return 409, {"error_code": "RESOURCE_ALREADY_EXISTS", "message": f"Index {name} already exists"}
            known[name] = body
        return 200, {**body, "endpoint_name": parts[4], "status": {"ready": False, "detailed_state": "PROVISIONING"}}
    if parts[3] == "indexes" and parts[-1] == "sync":
        if known is not None and parts[4] not in known:
            return 404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": f"Index {parts[4]} does not exist"}
        emulator.syncs.append(parts[4])
        return 200, {}
    if parts[3] == "indexes" and parts[-1] == "query":
        if not emulator.kb_index:
            return 404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no index loaded"}
        from crag.backends.bm25 import load_index

        columns = body.get("columns") or []
        index = load_index(emulator.kb_index)
        rows = index.search_chunks(body.get("query_text") or "", int(body.get("num_results") or 5))
        data = [[row.get(c) for c in columns] + [score] for row, score in rows]
        return 200, {
            "manifest": {"column_count": len(columns) + 1, "columns": [{"name": c} for c in columns] + [{"name": "score"}]},
            "result": {"row_count": len(data), "data_array": data},
        }
    return 404, {"error_code": "ENDPOINT_NOT_FOUND", "message": path}


# ------------------------------------------------------------------ Tavily


def _tavily(emulator: Emulator, method: str, path: str, body: Any, fault: str):
    if not emulator.web_index:
        return 200, {"query": body.get("query"), "answer": None, "images": [], "results": [], "response_time": 0.0}
    from crag.backends.bm25 import load_index

    k = int(body.get("max_results") or 5)
    docs = load_index(emulator.web_index).search([body.get("query") or ""], k * 4, source="web", max_parents=k)[0]
    include, exclude = body.get("include_domains") or [], body.get("exclude_domains") or []
    docs = [d for d in docs if (not include or any(dom in (d["url"] or "") for dom in include))
            and not any(dom in (d["url"] or "") for dom in exclude)]
    top = max((d["retrieval_score"] for d in docs), default=1.0) or 1.0
    return 200, {
        "query": body.get("query"),
        "answer": None,
        "images": [],
        "results": [
            {"title": d["title"], "url": d["url"], "content": d["text"], "score": round(d["retrieval_score"] / top, 4),
             "raw_content": None}
            for d in docs
        ],
        "response_time": 0.01,
        "request_id": f"req-{len(emulator.requests)}",
    }


ROUTES = {"serving": _serving, "vector_search": _vector_search, "tavily": _tavily}
