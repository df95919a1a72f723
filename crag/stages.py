"""The CRAG stages: pure functions over a pandas DataFrame with one row per question.

Every stage has one shape, `stage(df, backends, section) -> DataFrame`: the frame, the backends, and its
own config section (`PIPELINE` says which). It reads the columns it names as inputs and returns a new
DataFrame with its output columns added; it knows nothing of Spark, files or YAML. `run_pipeline` chains
them, and is what both a Spark partition (`crag run`) and `crag ask` execute.

A stage is pure: what its backend calls cost comes back in the frame's `usage` column (each call gets a
fresh tally that the stage adds up into new per-row counts), and nothing in the frame is mutated.

A backend failure is confined to its question: the row gets `error` set and later stages pass it by, so
the rest of the batch goes on and the question still ends in exactly one answer row (route "error").
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque, namedtuple
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from functools import lru_cache, wraps
from typing import Any, NamedTuple

import pandas as pd

from crag.backends.base import NOT_GRADED, Backends, Document, Grade, Grader, Usage
from crag.config import (
    CragConfig,
    GeneratorConfig,
    RefinementConfig,
    RetrieverConfig,
    RoutingConfig,
    WebSearchConfig,
    WebStageConfig,
)
from crag.secrets import scrub
from crag.text import split_sentences, word_windows

# The bookkeeping every stage reads and rewrites: a row's error (set when this stage fails it), its usage
# (the calls, tokens, retries and cache hits of its backend calls so far, as counts) and its decision log
# (grown by this stage's entries).
BOOKKEEPING = ("error", "usage", "decisions")


@dataclass(frozen=True)
class Stage:
    """What one stage reads and writes, checked where it runs (`runs`), as Kedro's Node checks its
    outputs: before, every column in `inputs` and `updates` is in the frame and none in `outputs`;
    after, exactly `outputs` have been added and `updates` rewritten, and every other column is the
    frame's own, untouched."""

    name: str
    inputs: tuple[str, ...]  # read only
    outputs: tuple[str, ...]  # added
    updates: tuple[str, ...] = BOOKKEEPING  # read and rewritten


# Adds the bookkeeping columns; `usage` starts at zero counts.
START = Stage("start", ("question_id", "question"), ("error", "usage", "decisions"), updates=())

STAGES = {
    s.name: s
    for s in (
        Stage("retrieve", ("question",), ("retrieved", "n_retrieved", "ms_retrieve")),
        Stage("grade", ("question", "retrieved"), ("graded", "n_relevant", "ms_grade")),
        # Routing cannot fail a question and calls no backend: it reads the error column and passes
        # failed rows by.
        Stage(
            "decide",
            ("graded", "error"),
            ("action", "needs_web", "use_internal", "relevant", "last_resort", "ms_decide"),
            updates=("decisions",),
        ),
        Stage("rewrite", ("question", "needs_web"), ("web_query", "ms_rewrite")),
        # With the two-stage fallback the second search's query replaces the first in web_query: the
        # query that found the results.
        Stage(
            "web_search",
            ("question", "relevant", "use_internal"),
            ("web_results", "n_web", "ms_web_search"),
            updates=(*BOOKKEEPING, "web_query"),
        ),
        Stage(
            "refine", ("question", "relevant", "use_internal", "last_resort", "web_results"), ("context", "ms_refine")
        ),
        Stage("generate", ("question", "context"), ("answer", "refused", "sources", "route", "ms_generate")),
    )
}


def _check_inputs(df: pd.DataFrame, stage: Stage) -> None:
    missing = [c for c in (*stage.inputs, *stage.updates) if c not in df.columns]
    if missing:
        raise ValueError(f"stage {stage.name!r} needs column(s) {missing}; run the stages before it first")
    present = [c for c in stage.outputs if c in df.columns]
    if present:
        raise ValueError(
            f"stage {stage.name!r} would overwrite column(s) {present}, which it does not declare as updates"
        )


def _check_outputs(stage: Stage, written: dict) -> None:
    declared = {*stage.outputs, *stage.updates}
    missing = [c for c in (*stage.outputs, *stage.updates) if c not in written]
    undeclared = [c for c in written if c not in declared]
    if missing or undeclared:
        raise ValueError(
            f"stage {stage.name!r} broke its contract: declared column(s) {missing} not written, "
            f"undeclared column(s) {undeclared} written"
        )


def runs(stage: Stage):
    """Make `compute(df, ...) -> {column: values}` a stage that returns df with those columns, its
    contract checked before and after: the stage can change no column but those it declares."""

    def wrap(compute: Callable[..., dict]) -> Callable[..., pd.DataFrame]:
        @wraps(compute)
        def run(df: pd.DataFrame, *args, **kwargs) -> pd.DataFrame:
            _check_inputs(df, stage)
            columns = compute(df, *args, **kwargs)
            _check_outputs(stage, columns)
            return _with(df, **columns)

        return run

    return wrap


def start(questions: pd.DataFrame) -> pd.DataFrame:
    """Add the bookkeeping columns every stage shares: error, usage and the decision log."""
    return _start(questions.reset_index(drop=True))


@runs(START)
def _start(df: pd.DataFrame) -> dict:
    return {
        "error": pd.Series([None] * len(df), dtype=object, index=df.index),
        "usage": [asdict(Usage()) for _ in range(len(df))],
        "decisions": [[] for _ in range(len(df))],
    }


def _log(df: pd.DataFrame, entries: list) -> list[list[dict]]:
    """The decision log with (step, decision, reason) entries appended per row: one tuple, a list of
    them, or None for nothing."""
    out = []
    for log, e in zip(df["decisions"], entries):
        items = [] if e is None else e if isinstance(e, list) else [e]
        out.append(log + [dict(zip(("step", "decision", "reason"), item)) for item in items])
    return out


@lru_cache(maxsize=64)
def _row_type(columns: tuple[str, ...]) -> Any:
    return namedtuple("Row", columns)


def frame_rows(df: pd.DataFrame) -> list:
    """The rows as named tuples. Cheaper than df.itertuples(), which builds its tuple type and reads
    every column through .iloc on each call: on the few-row frames of streamed pipelines
    (spark.questions_per_pipeline) that cost more CPU than the backend calls."""
    row = _row_type(tuple(df.columns))
    return [row._make(values) for values in df.to_numpy(dtype=object).tolist()]


def _with(df: pd.DataFrame, **columns) -> pd.DataFrame:
    """A new frame: df with these columns replaced or added (one construction, not a copy and an
    insert per column)."""
    data = {c: columns.pop(c) if c in columns else df[c] for c in df.columns}
    return pd.DataFrame({**data, **columns}, index=df.index)


def _added_usage(df: pd.DataFrame, tallies: list[Usage | None]) -> list[dict[str, int]]:
    """The usage column with each row's tally of this stage's calls added: new dicts, the frame's own
    left as they are."""
    return [totals if tally is None else _sum_usage(totals, tally) for totals, tally in zip(df["usage"], tallies)]


def _sum_usage(totals: dict, tally: Usage) -> dict:
    """A row's usage counts with a tally added: counts, and histograms bucket by bucket."""
    summed = {}
    for name, count in totals.items():
        added = getattr(tally, name)
        summed[name] = [a + b for a, b in zip(count, added)] if isinstance(count, list) else count + added
    return summed


class _RowResults(NamedTuple):
    results: list  # fn's result per row; None where it was not called or failed
    millis: list[float]
    errors: list[str | None]  # the error column, with this stage's failures set
    usage: list[dict[str, int]]  # the usage column, with this stage's calls added


def _per_row(
    df: pd.DataFrame, stage: str, fn: Callable[[Any, Usage], object], when=None, workers: int = 1
) -> _RowResults:
    """Call fn(row, tally) on every row without an error (and where `when(row)` holds), `workers` rows
    at a time (the calling thread and threads of the shared row pool), each call with a fresh Usage
    tally for its backend calls. An exception fails that row only; what its calls cost until then
    still counts."""
    rows = frame_rows(df)
    errors = list(df["error"])
    todo = [i for i, row in enumerate(rows) if errors[i] is None and (when is None or when(row))]
    results: list = [None] * len(rows)
    millis = [0.0] * len(rows)
    tallies: list[Usage | None] = [None] * len(rows)

    def one(i: int) -> None:
        t0 = time.perf_counter()
        tallies[i] = tally = Usage()
        try:
            results[i] = fn(rows[i], tally)
        except Exception as exc:  # a backend failure is data for this question, not the end of the batch
            # Client libraries put whole URLs, credentials included, into their messages.
            errors[i] = scrub(f"{stage}: {type(exc).__name__}: {exc}")
        millis[i] = (time.perf_counter() - t0) * 1000

    pending = deque(todo)

    def take_rows() -> None:
        while pending:
            try:
                i = pending.popleft()  # thread-safe: each row is taken once
            except IndexError:
                return
            one(i)

    helpers: list[Future] = []
    try:
        for _ in range(min(workers, len(todo)) - 1):
            helpers.append(_row_threads().submit(take_rows))
        take_rows()  # the calling thread takes rows too
    except BaseException:
        pending.clear()  # the helpers start no further row
        raise
    finally:
        # A helper still queued behind busy threads has nothing left to take: cancelled, not waited for
        wait([helper for helper in helpers if not helper.cancel()])
    for helper in helpers:
        if not helper.cancelled():
            helper.result()  # a helper's BaseException (each row's Exception is caught in `one`)
    return _RowResults(results, millis, errors, _added_usage(df, tallies))


# The threads that call a stage's backends row by row, shared by every stage call of the process and
# kept between calls. Pipelines on threads (crag.spark) call the stages thousands of times a batch; a
# pool per call started new threads every time, and every ThreadPoolExecutor of a process starts its
# threads under one lock that they share (concurrent.futures' _global_shutdown_lock), so the
# pipelines queued behind each other's thread start-ups. Threads are started only when none is idle:
# the pool grows to the most rows called at once (a task's pipelines x the rows each takes). Beyond
# the cap, rows wait for a free thread; the calling thread always takes rows, and does them all if no
# helper gets a thread, so a call never waits for one.
_ROW_THREADS_MAX = 4096
_row_pool: ThreadPoolExecutor | None = None
_row_pool_lock = threading.Lock()


def _row_threads() -> ThreadPoolExecutor:
    global _row_pool
    with _row_pool_lock:
        if _row_pool is None:
            _row_pool = ThreadPoolExecutor(max_workers=_ROW_THREADS_MAX, thread_name_prefix="crag-row")
        return _row_pool


def _forget_row_pool() -> None:
    """In a forked child the parent's pool threads do not exist, while the pool still counts them as
    idle (work submitted to it would never run): the child makes a pool of its own."""
    global _row_pool, _row_pool_lock
    _row_pool, _row_pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_row_pool)


# ---------------------------------------------------------------- retrieve


@runs(STAGES["retrieve"])
def retrieve(df: pd.DataFrame, backends: Backends, cfg: RetrieverConfig) -> dict:
    """Top-k child chunks per question, expanded to parent documents and de-duplicated by parent.
    An in-process retriever serves the partition in one batched call (if that fails, each question is
    tried alone so one bad question cannot fail its neighbours); a remote one gets one call per
    question from a thread pool."""
    retriever, k = backends.retriever, cfg.k

    def one_by_one(row, tally: Usage) -> list[Document]:
        return retriever.search([row.question], k, [tally])[0]

    if retriever.concurrency > 1:
        found, millis, errors, usage = _per_row(df, "retrieve", one_by_one, workers=retriever.concurrency)
    else:
        t0 = time.perf_counter()
        tallies = [Usage() for _ in range(len(df))]
        try:
            found = retriever.search(list(df["question"]), k, tallies)
            errors, usage = list(df["error"]), _added_usage(df, list(tallies))
            millis = [(time.perf_counter() - t0) * 1000 / max(len(df), 1)] * len(df)
        except Exception:
            # What the failed batch call counted stays counted, as each question is tried alone.
            found, millis, errors, usage = _per_row(
                _with(df, usage=_added_usage(df, list(tallies))), "retrieve", one_by_one
            )
    retrieved = [docs or [] for docs in found]
    return dict(
        retrieved=retrieved,
        n_retrieved=[len(d) for d in retrieved],
        error=errors,
        usage=usage,
        ms_retrieve=millis,
        decisions=_log(
            df,
            [
                None
                if e
                else (
                    "retrieve",
                    f"{len(d)} documents",
                    f"{retriever.name}: top {k} child chunks -> {len(d)} parent documents",
                )
                for d, e in zip(retrieved, errors)
            ],
        ),
    )


# ---------------------------------------------------------------- grade


def _apply_grades(docs: list[Document], grades: list[Grade], grader: Grader) -> list[Document]:
    if len(grades) != len(docs):
        raise ValueError(f"grader returned {len(grades)} grades for {len(docs)} documents")
    return [
        {
            **doc,
            "relevance": g.relevance,
            "answer_weight": g.answer_weight,
            "grade": g.grade,
            "parse_status": g.parse_status,
            "rationale": g.rationale,
            "raw_output": g.raw_output,
            "grader": grader.name,
            "prompt_hash": grader.prompt_hash,
        }
        for doc, g in zip(docs, grades)
    ]


def _not_graded(docs: list[Document], grader: Grader, error: str) -> list[Document]:
    return [
        {
            **doc,  # no relevance, no grade: stored as null
            "parse_status": NOT_GRADED,
            "rationale": error,
            "raw_output": None,
            "grader": grader.name,
            "prompt_hash": grader.prompt_hash,
        }
        for doc in docs
    ]


@runs(STAGES["grade"])
def grade(df: pd.DataFrame, backends: Backends, _: None = None) -> dict:
    """A relevance score and yes/no for every retrieved document (web results are graded in the web
    search stage). Everything the grader's config says is in the grader backend built from it: the
    stage gets no config of its own."""
    grader = backends.grader

    def grade_row(row, tally: Usage) -> list[Document]:
        return _apply_grades(row.retrieved, grader.grade(row.question, row.retrieved, tally), grader)

    graded, millis, errors, usage = _per_row(
        df, "grade", grade_row, when=lambda r: bool(r.retrieved), workers=grader.concurrency
    )
    # A question whose grading failed keeps its documents, each said to be not graded (and why): the
    # grades table records what was retrieved and what was graded, and no grade that was never given
    all_graded = [
        g if g is not None else _not_graded(d, grader, error) if error is not None and before is None else list(d)
        for g, d, error, before in zip(graded, df["retrieved"], errors, df["error"])
    ]
    return dict(
        graded=all_graded,
        n_relevant=[sum(d.get("grade") == "yes" for d in docs) for docs in all_graded],
        error=errors,
        usage=usage,
        ms_grade=millis,
        decisions=_log(
            df,
            [
                ("grade", f"{sum(d['grade'] == 'yes' for d in g)} of {len(g)} relevant", f"grader {grader.name}")
                if g
                else None
                for g in graded
            ],
        ),
    )


# ---------------------------------------------------------------- decide


class Route(NamedTuple):
    """The routing decision for one question."""

    action: str | None  # "correct" | "ambiguous" | "incorrect"; None for a failed question
    needs_web: bool
    use_internal: bool  # whether the relevant internal documents join the context
    relevant: list[Document]  # the relevant internal documents, in rank order
    reason: str | None  # for the decision log
    # the context when neither the relevant internal documents nor the web leave any (routing.last_resort)
    last_resort: list[Document] = []


def route_question(graded: list[Document], routing: RoutingConfig) -> Route:
    """The action for one question from the grades of its documents, under routing.policy, and its last
    resort: the best internal document at or above `routing.last_resort` when the route reads no
    relevant internal document. The action stays what the policy says; the last resort is read only if
    the web brings nothing usable either (the refine stage)."""
    route = _route_by_policy(graded, routing)
    if routing.last_resort is None or (route.use_internal and route.relevant):
        return route
    best = max(graded, key=lambda d: d.get("relevance", 0.0), default=None)
    if best is None or best.get("relevance", 0.0) < routing.last_resort:
        return route
    return route._replace(last_resort=[best])


def _route_by_policy(graded: list[Document], routing: RoutingConfig) -> Route:
    relevant = [d for d in graded if d.get("grade") == "yes"][: routing.max_relevant_docs]
    n, n_rel = len(graded), sum(d.get("grade") == "yes" for d in graded)
    counted = f"{n_rel} of {n} documents relevant"
    policy = routing.policy
    if n == 0:
        return Route("incorrect", True, False, [], f"nothing retrieved; policy {policy}: web search")
    if policy == "thresholds":
        scores = [d.get("relevance", 0.0) for d in graded]
        best = max(scores, default=0.0)
        # A document at or above `upper` is what makes the action correct: it is relevant by the
        # policy's own measure even when the grader's yes/no threshold sits higher.
        relevant = [d for d in graded if d.get("grade") == "yes" or d.get("relevance", 0.0) >= routing.upper][
            : routing.max_relevant_docs
        ]
        if best >= routing.upper:
            return Route(
                "correct",
                False,
                True,
                relevant,
                f"best relevance {best:.2f} >= upper {routing.upper}; policy thresholds -> internal documents",
            )
        if best < routing.lower:
            return Route(
                "incorrect",
                True,
                False,
                [],
                f"best relevance {best:.2f} < lower {routing.lower}; policy thresholds -> web search only",
            )
        return Route(
            "ambiguous",
            True,
            True,
            relevant,
            f"best relevance {best:.2f} between {routing.lower} and {routing.upper}; policy thresholds -> internal documents and web search",
        )
    action = "correct" if n_rel == n else "incorrect" if n_rel == 0 else "ambiguous"
    if policy == "any_irrelevant":
        needs_web = action != "correct"
        why = "all relevant -> answer from them" if not needs_web else f"{n - n_rel} irrelevant -> web search"
    elif policy == "all_irrelevant":
        needs_web = n_rel == 0
        action = "incorrect" if needs_web else "correct"
        why = "none relevant -> web search" if needs_web else "some relevant -> answer from them"
    else:  # min_context_chars
        chars = sum(len(d["text"]) for d in relevant)
        needs_web = n_rel == 0 or chars < routing.min_context_chars  # none relevant: the web, whatever the length
        action = "correct" if not needs_web else "incorrect" if n_rel == 0 else "ambiguous"
        why = (
            "none relevant -> web search"
            if n_rel == 0
            else f"relevant context {chars} chars {'<' if needs_web else '>='} {routing.min_context_chars} -> {'web search' if needs_web else 'answer from it'}"
        )
    return Route(action, needs_web, True, relevant, f"{counted}; policy {policy}: {why}")


@runs(STAGES["decide"])
def decide(df: pd.DataFrame, backends: Backends, routing: RoutingConfig) -> dict:
    """The routing decision per question (`route_question`); no backend is called."""
    t0 = time.perf_counter()
    routed = [
        route_question(g, routing) if e is None else Route(None, False, False, [], None)
        for g, e in zip(df["graded"], df["error"])
    ]
    return dict(
        action=[r.action for r in routed],
        needs_web=[r.needs_web for r in routed],
        use_internal=[r.use_internal for r in routed],
        relevant=[r.relevant for r in routed],
        last_resort=[r.last_resort for r in routed],
        ms_decide=(time.perf_counter() - t0) * 1000 / max(len(df), 1),
        decisions=_log(df, [("route", r.action, r.reason) if r.action else None for r in routed]),
    )


# ---------------------------------------------------------------- rewrite + web search


def _direct_query(question: str, policy_keywords: list[str]) -> str:
    extra = [k for k in policy_keywords if k.lower() not in question.lower()]
    return " ".join([question.strip(), *extra])


@runs(STAGES["rewrite"])
def rewrite(df: pd.DataFrame, backends: Backends, cfg: WebSearchConfig) -> dict:
    """A web query for each question that needs the web; the original question is kept for
    generation. With the two-stage fallback (reference flow 3) the first query is the question itself
    (plus policy keywords) and the rewriter is called only if that search leaves the context short."""
    enabled = backends.web_search is not None
    rewriter = backends.rewriter
    two_stage = cfg.fallback == "two_stage"

    def make(row, tally: Usage) -> str:
        return (
            _direct_query(row.question, rewriter.policy_keywords)
            if two_stage
            else rewriter.rewrite(row.question, tally)
        )

    queries, millis, errors, usage = _per_row(
        df, "rewrite", make, when=lambda r: r.needs_web and enabled, workers=rewriter.concurrency
    )
    why = "two-stage fallback: the question itself first" if two_stage else f"rewriter {rewriter.name}"
    return dict(
        web_query=queries,
        error=errors,
        usage=usage,
        ms_rewrite=millis,
        decisions=_log(
            df,
            [
                ("rewrite", q, why)
                if q is not None
                else ("rewrite", "skipped", "web search is switched off (web_search.backend: none)")
                if nw and not enabled and e is None
                else None
                for q, nw, e in zip(queries, df["needs_web"], errors)
            ],
        ),
    )


def _usable_web(results: list[Document]) -> list[Document]:
    """Graded web results count only when relevant; ungraded ones (grading off) are all used."""
    return [d for d in results if d.get("grade", "yes") == "yes"]


@runs(STAGES["web_search"])
def web_search(df: pd.DataFrame, backends: Backends, cfg: WebStageConfig) -> dict:
    """Search the web for each question with a web query; optionally check each result as a source
    (reference flow 3), grade the results, and with the two-stage fallback search again with a
    rewritten query when the usable context is still shorter than routing.min_context_chars."""
    ws, grader, check = backends.web_search, backends.grader, backends.source_check
    w = cfg.search

    def search_once(row, query: str, first_rank: int, log: list, tally: Usage) -> list[Document]:
        assert ws is not None  # rows get a web query only when web search is on
        found = ws.search(query, w.k, tally, question=row.question)
        results: list[Document] = [{**d, "rank": first_rank + i} for i, d in enumerate(found)]
        log.append(("web_search", f"{len(results)} results", f"{ws.name}, query {query!r}"))
        if check is not None and results:
            keep = check.verify(row.question, results, tally)
            log.append(("verify_web", f"{sum(keep)} of {len(results)} kept", f"source check {check.name}"))
            results = [d for d, ok in zip(results, keep) if ok]
        if w.grade_results and results:
            results = _apply_grades(results, grader.grade(row.question, results, tally), grader)
            log.append(
                (
                    "grade_web",
                    f"{sum(d['grade'] == 'yes' for d in results)} of {len(results)} relevant",
                    f"grader {grader.name}",
                )
            )
        return results

    def search_row(row, tally: Usage):
        log: list = []
        query = row.web_query
        results = search_once(row, query, 1, log, tally)
        if w.fallback == "two_stage":
            internal = row.relevant if row.use_internal else []
            chars = sum(len(d["text"]) for d in internal + _usable_web(results))
            if chars < cfg.min_context_chars:
                query = backends.rewriter.rewrite(row.question, tally)
                log.append(
                    (
                        "rewrite",
                        query,
                        f"context {chars} chars < {cfg.min_context_chars}: second search with rewriter {backends.rewriter.name}",
                    )
                )
                seen = {d["parent_id"] for d in results}
                # ranked after every result the first search may have found (k), kept or not: no rank twice
                more = [d for d in search_once(row, query, w.k + 1, log, tally) if d["parent_id"] not in seen]
                results = results + more
        return query, results, log

    concurrency = max(ws.concurrency if ws else 1, grader.concurrency, check.concurrency if check else 1)
    found, millis, errors, usage = _per_row(
        df, "web_search", search_row, when=lambda r: r.web_query is not None, workers=concurrency
    )
    results = [f[1] if f else [] for f in found]
    return dict(
        web_query=[f[0] if f else q for f, q in zip(found, df["web_query"])],
        web_results=results,
        n_web=[len(r) for r in results],
        error=errors,
        usage=usage,
        ms_web_search=millis,
        decisions=_log(df, [f[2] if f else None for f in found]),
    )


# ---------------------------------------------------------------- context (+ optional refinement)


def _strips(text: str, cfg: RefinementConfig) -> list[str]:
    return split_sentences(text) if cfg.strip == "sentence" else word_windows(text, cfg.window_words)


def refine_context(
    question: str, context: list[Document], grader: Grader, cfg: RefinementConfig, usage: Usage
) -> list[Document]:
    """The CRAG paper's knowledge refinement: split each document into strips, grade every strip, keep
    the best `keep`, and recompose them in their original order (a document with no kept strip drops out)."""
    strips = [(d, s, text) for d, doc in enumerate(context) for s, text in enumerate(_strips(doc["text"], cfg))]
    if not strips:
        return []
    grades = grader.grade(question, [{**context[d], "text": text} for d, _, text in strips], usage)
    ranked = sorted(range(len(strips)), key=lambda i: (-grades[i].relevance, i))
    keep = sorted(i for i in ranked[: cfg.keep] if grades[i].grade == "yes")
    refined: list[Document] = []
    for d, doc in enumerate(context):
        kept = [strips[i][2] for i in keep if strips[i][0] == d]
        if kept:
            refined.append({**doc, "text": " ".join(kept)})
    return refined


@runs(STAGES["refine"])
def refine(df: pd.DataFrame, backends: Backends, cfg: RefinementConfig) -> dict:
    """The context the generator will read: relevant internal documents (unless the action says web
    only) plus usable web results, or else the question's last resort (`route_question`); refined into
    strips when refinement is on."""

    def compose(row, tally: Usage) -> tuple[list[Document], list]:
        log: list = []
        context = (row.relevant if row.use_internal else []) + _usable_web(row.web_results)
        if not context and row.last_resort:
            context = list(row.last_resort)
            best = context[0]
            log.append(
                (
                    "last_resort",
                    best["doc_id"],
                    f"no relevant context survived: the knowledge base's best document, relevance {best.get('relevance', 0.0):.2f}",
                )
            )
        if cfg.enabled and context:
            context = refine_context(row.question, context, backends.grader, cfg, tally)
            log.append(("refine", f"{len(context)} documents", "knowledge refinement: best strips kept"))
        return context, log

    composed, millis, errors, usage = _per_row(
        df, "refine", compose, workers=backends.grader.concurrency if cfg.enabled else 1
    )
    return dict(
        context=[c[0] if c else [] for c in composed],
        error=errors,
        usage=usage,
        ms_refine=millis,
        decisions=_log(df, [c[1] if c else None for c in composed]),
    )


# ---------------------------------------------------------------- generate


def _route(context: list[Document]) -> str:
    kinds = {d["source"] for d in context}
    return "mixed" if len(kinds) > 1 else "web" if kinds == {"web"} else "internal"


@runs(STAGES["generate"])
def generate(df: pd.DataFrame, backends: Backends, cfg: GeneratorConfig) -> dict:
    """Answer the ORIGINAL question from the context. No context: the refusal message, and no call."""
    generator, refusal_message = backends.generator, cfg.refusal_message
    answers, millis, errors, usage = _per_row(
        df,
        "generate",
        lambda row, tally: generator.generate(row.question, row.context, tally),
        when=lambda r: bool(r.context),
        workers=generator.concurrency,
    )
    texts: list[str | None] = []
    refused: list[bool] = []
    sources: list[list[dict]] = []
    routes: list[str] = []
    log: list = []
    for answer, context, error in zip(answers, df["context"], errors):
        if error is not None:
            texts.append(None)
            refused.append(False)
            sources.append([])
            routes.append("error")
            log.append(("generate", "error", error))
        elif answer is None or answer.text is None:
            texts.append(refusal_message)
            refused.append(True)
            sources.append([])
            routes.append("refused")
            why = (
                "no relevant context survived; generator not called"
                if answer is None
                else f"generator {backends.generator.name} found no answer in the context"
            )
            log.append(("generate", "refused", why))
        else:
            cited = [context[i] for i in answer.cited if 0 <= i < len(context)]
            texts.append(answer.text)
            refused.append(False)
            routes.append(_route(context))
            # a source is a document: two cited sections (parents) of one document name it once
            named = [{k: d.get(k) for k in ("source", "doc_id", "title", "url")} for d in cited]
            sources.append([n for i, n in enumerate(named) if n not in named[:i]])
            log.append(
                (
                    "generate",
                    "answered",
                    f"generator {backends.generator.name} from {len(context)} documents ({_route(context)}), {len(cited)} cited",
                )
            )
    return dict(
        answer=texts,
        refused=refused,
        sources=sources,
        route=routes,
        error=errors,
        usage=usage,
        ms_generate=millis,
        decisions=_log(df, log),
    )


# ---------------------------------------------------------------- the whole flow


# The stages in order, each with the config section it receives.
PIPELINE: tuple[tuple[Callable[..., pd.DataFrame], Callable[[CragConfig], Any]], ...] = (
    (retrieve, lambda cfg: cfg.retriever),
    (grade, lambda cfg: None),
    (decide, lambda cfg: cfg.routing),
    (rewrite, lambda cfg: cfg.web_search),
    (web_search, lambda cfg: WebStageConfig(search=cfg.web_search, min_context_chars=cfg.routing.min_context_chars)),
    (refine, lambda cfg: cfg.refinement),
    (generate, lambda cfg: cfg.generator),
)


def run_pipeline(
    questions: pd.DataFrame,
    backends: Backends,
    cfg: CragConfig,
    on_stage: Callable[[str, pd.DataFrame], None] | None = None,
) -> pd.DataFrame:
    """All stages in order over a batch of validated questions (`question_id`, `question`)."""
    df = start(questions)
    for stage, section in PIPELINE:
        df = stage(df, backends, section(cfg))
        if on_stage is not None:
            on_stage(stage.__name__, df)
    return df
