"""The small protocols every backend implements, and the records they exchange.

Every role has `concurrency`: how many calls this process may make at once (1 for the embedded,
in-process backends; a share of the endpoint's budget for remote ones).

A document travels through the stages as a `Document`: a dict at run time (so it crosses pandas and
Arrow unchanged), its keys typed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NotRequired, Protocol, TypedDict, runtime_checkable


class Document(TypedDict):
    """One retrieved document or web result; the keys from `relevance` on are set once it is graded."""

    source: str  # "internal" | "web"
    doc_id: str
    parent_id: str
    title: str | None
    url: str | None
    text: str
    retrieval_score: float | None
    rank: int
    relevance: NotRequired[float]  # 0..1 (None in the grades table for a document not graded)
    # Grade.answer_weight (not in the grades table: the rationale holds its inputs)
    answer_weight: NotRequired[float | None]
    grade: NotRequired[str]  # "yes" | "no" (None there too)
    # "ok" | "repaired" | "failed"; NOT_GRADED: the grader's call failed (its error in `rationale`)
    parse_status: NotRequired[str]
    rationale: NotRequired[str | None]
    raw_output: NotRequired[str | None]
    grader: NotRequired[str]  # the grader's name
    prompt_hash: NotRequired[str | None]


NOT_GRADED = "not_graded"


@dataclass(frozen=True)
class Grade:
    relevance: float  # 0..1
    grade: str  # "yes" | "no"
    parse_status: str = "ok"  # "ok" | "repaired" | "failed"
    rationale: str | None = None
    raw_output: str | None = None  # what the model said, kept for audit (None for non-model graders)
    # The relevance in lexical-relevance units (not bounded to 0..1), which the extractive answerer weighs
    # a document's sentences by (its document_weight was fitted there); None: the answerer reads
    # `relevance` (the lexical grader's is in those units already; an LLM grader's is its own).
    answer_weight: float | None = None


@dataclass(frozen=True)
class Answer:
    text: str | None  # None: the generator declined (nothing in the context answers the question)
    cited: list[int] = field(default_factory=list)  # positions in the context list


# Upper bounds in milliseconds of the buckets of Usage.call_ms_hist; one more bucket holds the slower
# calls. Buckets, not each call's time: a histogram adds up across questions and batches as the other
# counts do, and a run's latency percentiles are read from the sum (latency_percentile_ms).
LATENCY_BOUNDS_MS = (250, 500, 1000, 2000, 4000, 8000, 16000, 32000, 64000, 128000)


def _no_calls() -> list[int]:
    return [0] * (len(LATENCY_BOUNDS_MS) + 1)


@dataclass
class Usage:
    """Calls and tokens backend calls cost: a fresh tally the caller hands to each call, which the
    backend adds to; the stages sum the tallies into each question's counts (the answers table)."""

    llm_calls: int = 0
    search_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    retries: int = 0
    cache_hits: int = 0  # backend calls answered from the stage cache instead
    # Remote calls (each attempt) that found every in-flight slot of their endpoint taken and waited
    # on the client, and the milliseconds they waited: not counted against a call's timeout.
    queued_calls: int = 0
    queue_ms: int = 0
    # Remote calls (each attempt) by how long the service took to answer (a call given up on its
    # timeout: how long it was waited for): counts per LATENCY_BOUNDS_MS bucket, the last for slower calls.
    call_ms_hist: list[int] = field(default_factory=_no_calls)

    def add_call(self, latency_ms: float) -> None:
        self.call_ms_hist[latency_bucket(latency_ms)] += 1


# The run's totals of each Usage.call_ms_hist bucket, by name (crag.job's counts)
LATENCY_COUNT_NAMES = (
    *(f"calls_ms_le_{bound}" for bound in LATENCY_BOUNDS_MS),
    f"calls_ms_over_{LATENCY_BOUNDS_MS[-1]}",
)
# Past these, the summary says that the services were the bottleneck, and what to look at.
SLOW_P95_MS = 8000
QUEUED_SHARE = 0.5


def remote_calls_line(counts: dict[str, int]) -> str | None:
    """The run summary's line on its remote calls: the 95th-percentile latency, how many calls waited
    on the client for a free slot, and a hint when the services were slow (None: no remote call)."""
    hist = [int(counts.get(name, 0)) for name in LATENCY_COUNT_NAMES]
    calls = sum(hist)
    if not calls:
        return None
    p95 = latency_percentile_ms(hist, 95)
    queued, waited = int(counts.get("queued_calls", 0)), int(counts.get("queue_ms", 0)) / 1000
    line = (
        f"p95 {'over ' + str(LATENCY_BOUNDS_MS[-1] // 1000) if p95 is None else '<= ' + f'{p95 / 1000:g}'} s over "
        f"{calls} calls; {queued} waited on the client for a free slot ({waited:.1f} s in all)"
    )
    if p95 is None or p95 > SLOW_P95_MS:
        line += (
            "; slow answers: keep policy.max_concurrency within what the server runs at once, and timeout_s above "
            "this p95"
        )
    elif queued > QUEUED_SHARE * calls:
        line += "; most calls waited for a slot: the endpoint's policy.max_concurrency (or the server's slots) limits the run"
    return line


def latency_bucket(latency_ms: float) -> int:
    return next((i for i, bound in enumerate(LATENCY_BOUNDS_MS) if latency_ms <= bound), len(LATENCY_BOUNDS_MS))


def latency_percentile_ms(hist: list[int], percentile: float) -> int | None:
    """The upper bound of the bucket that holds the `percentile`th call of a Usage.call_ms_hist (None:
    no calls, or the slowest bucket, which has no bound)."""
    total = sum(hist)
    if not total:
        return None
    rank, seen = percentile / 100 * total, 0
    for bound, count in zip((*LATENCY_BOUNDS_MS, None), hist):
        seen += count
        if seen >= rank:
            return bound
    return None


@runtime_checkable
class ChatModel(Protocol):
    """A chat-completion endpoint. `chat` adds its calls, tokens and retries to `usage`; `json_schema`
    (a {"name", "schema", "strict"} wrapper) is asked for in the structured-output mode `structured`
    (crag.config.StructuredOutput)."""

    name: str
    concurrency: int  # requests this process may have in flight

    def chat(
        self,
        messages: list[dict],
        usage: Usage,
        *,
        max_tokens: int,
        temperature: float,
        json_schema: dict | None = None,
        regex: str | None = None,
        structured: str = "json_schema",
    ) -> str: ...

    def context_window(self) -> int | None:
        """The server's context window in tokens, when it says."""


@runtime_checkable
class Retriever(Protocol):
    """`concurrency` 1 means the retriever serves a whole batch of queries in one call (BM25); above 1,
    the retrieve stage sends one query per question from a thread pool of that size."""

    name: str
    concurrency: int

    def search(self, queries: list[str], k: int, usages: list[Usage] | None = None) -> list[list[Document]]:
        """Top documents for each query, parents de-duplicated, best first (one search call each)."""


@runtime_checkable
class Grader(Protocol):
    name: str
    prompt_hash: str | None
    concurrency: int

    def grade(self, question: str, documents: list[Document], usage: Usage) -> list[Grade]:
        """One grade per document, in order; model calls and tokens are added to `usage`."""


@runtime_checkable
class Rewriter(Protocol):
    name: str
    concurrency: int
    policy_keywords: list[str]

    def rewrite(self, question: str, usage: Usage) -> str:
        """A web-search query for the question."""


@runtime_checkable
class WebSearch(Protocol):
    name: str
    concurrency: int

    def search(self, query: str, k: int, usage: Usage | None = None, *, question: str | None = None) -> list[Document]:
        """Up to k results, each its own document (source "web"). `question`: the question the query
        was made for, which a search ignores and the stage cache files the result under."""


@runtime_checkable
class Generator(Protocol):
    name: str
    concurrency: int
    # Whether an answer depends on the context documents' relevance (and answer weight) as well as on
    # their text (the stage cache's key must then hold them: a grader variant changes relevances, not documents)
    reads_relevance: bool

    def generate(self, question: str, context: list[Document], usage: Usage) -> Answer:
        """An answer grounded in the context, citing the documents it used."""


@runtime_checkable
class SourceCheck(Protocol):
    """Reference flow 3's check of each web result as a source (web_search.verify)."""

    name: str
    concurrency: int

    def verify(self, question: str, results: list[Document], usage: Usage) -> list[bool]:
        """Whether to keep each result, in order."""


@dataclass
class Backends:
    """One object per role, as `build_backends` makes them from the config."""

    retriever: Retriever
    grader: Grader
    rewriter: Rewriter
    web_search: WebSearch | None  # None: web search switched off (web_search.backend = none)
    generator: Generator
    source_check: SourceCheck | None = None  # set when web_search.verify is
