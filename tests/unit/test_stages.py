"""Stage contracts with small in-test backends that implement the protocols, so each stage's
behaviour can be pinned down exactly (the real embedded backends are exercised at the end and in the
Spark end-to-end test)."""

import multiprocessing
import threading
import time

import pandas as pd
import pyarrow as pa
import pytest

from crag import schema, stages
from crag.backends import Backends
from crag.backends.base import Answer, Grade, Usage
from crag.cache import StageCache, question_key, with_cache
from crag.config import CragConfig, RefinementConfig, load_config
from crag.spark import to_stage_output
from tests.support import SAMPLE

WAIT_S = 30  # generous: the machine may be busy


def doc(i, text, source="internal"):
    return {
        "source": source,
        "doc_id": f"{source}-{i}",
        "parent_id": f"{source}-{i}#p0",
        "title": f"T{i}",
        "url": None,
        "text": text,
        "retrieval_score": 1.0 / (i + 1),
        "rank": i + 1,
    }


class Retriever:
    name = "fake-retriever"
    concurrency = 1

    def __init__(self, corpus, fail_on=None):
        self.corpus, self.fail_on, self.calls = corpus, fail_on, []

    def search(self, queries, k, usages=None):
        self.calls.append(list(queries))
        for usage in usages or []:
            usage.search_calls += 1
        if self.fail_on and any(self.fail_on in q for q in queries):
            raise RuntimeError("index unavailable")
        return [[doc(i, t) for i, t in enumerate(self.corpus.get(q, []))][:k] for q in queries]


class Grader:
    """Relevant when the document contains the word 'yes'; relevance 0.9 or 0.1, answer weight 0.7 or 0.3."""

    name, prompt_hash, concurrency = "fake-grader", "abc123", 1

    def __init__(self, wrong_count_for=None):
        self.wrong_count_for, self.calls = wrong_count_for, []

    def grade(self, question, documents, usage):
        self.calls.append((question, len(documents)))
        usage.llm_calls += 1
        grades = [
            Grade(0.9, "yes", answer_weight=0.7) if "yes" in d["text"] else Grade(0.1, "no", answer_weight=0.3)
            for d in documents
        ]
        return grades[:-1] if question == self.wrong_count_for else grades


class Rewriter:
    name, concurrency, policy_keywords = "fake-rewriter", 1, []

    def __init__(self):
        self.calls = []

    def rewrite(self, question, usage):
        self.calls.append(question)
        return f"web: {question}"


class Web:
    name, concurrency = "fake-web", 1

    def __init__(self, results):
        self.results, self.calls = results, []

    def search(self, query, k, usage=None, *, question=None):
        self.calls.append(query)
        usage.search_calls += 1
        return [doc(i, t, "web") for i, t in enumerate(self.results)][:k]


class Generator:
    name, concurrency, reads_relevance = "fake-generator", 1, False

    def __init__(self, decline=False):
        self.decline, self.calls = decline, []

    def generate(self, question, context, usage):
        self.calls.append((question, [d["doc_id"] for d in context]))
        return Answer(None) if self.decline else Answer(f"answer to {question}", cited=[0])


def make_backends(corpus=None, web=("web yes result", "web no result"), **kw):
    return Backends(
        retriever=Retriever(corpus or {}, kw.get("fail_on")),
        grader=Grader(kw.get("wrong_count_for")),
        rewriter=Rewriter(),
        web_search=None if web is None else Web(list(web)),
        generator=Generator(kw.get("decline", False)),
    )


def questions(*texts):
    return pd.DataFrame({"question_id": [f"q{i}" for i in range(len(texts))], "question": list(texts)})


CORPUS = {
    "all relevant?": ["yes a", "yes b"],
    "some relevant?": ["yes a", "no b", "no c"],
    "none relevant?": ["no a", "no b"],
}


def run(texts, cfg=None, **kw):
    backends = make_backends(CORPUS, **kw)
    return stages.run_pipeline(questions(*texts), backends, cfg or CragConfig()), backends


def test_stages_declare_their_inputs_and_refuse_to_run_out_of_order():
    with pytest.raises(ValueError, match="stage 'grade' needs column"):
        stages.grade(stages.start(questions("x?")), make_backends())


def stage_steps(backends, cfg):
    return {
        stage.__name__: lambda d, stage=stage, section=section: stage(d, backends, section(cfg))
        for stage, section in stages.PIPELINE
    }


@pytest.mark.parametrize("fallback", ["single", "two_stage"])
def test_each_stage_writes_exactly_its_declared_columns(fallback):
    """Checked from outside the stage runner: a stage adds its outputs, and every column it does not
    declare as an update comes out as it went in."""
    backends = make_backends(CORPUS, web=("web no result",))  # short context: the two-stage fallback searches again
    cfg = load_config(None, [f"web_search.fallback={fallback}"])
    before = stages.start(questions("some relevant?", "none relevant?", "all relevant?"))
    assert list(before.columns) == ["question_id", "question", *stages.START.outputs]
    for name, step in stage_steps(backends, cfg).items():
        declared = stages.STAGES[name]
        assert f"ms_{name}" in declared.outputs
        after = step(before)
        assert set(after.columns) == set(before.columns) | set(declared.outputs)
        assert not set(declared.outputs) & set(before.columns)
        for column in set(before.columns) - set(declared.updates):
            assert list(after[column]) == list(before[column]), f"{name} changed undeclared column {column}"
        before = after
    assert backends.web_search.calls == (
        ["web: some relevant?", "web: none relevant?"]
        if fallback == "single"
        else ["some relevant?", "web: some relevant?", "none relevant?", "web: none relevant?"]
    )
    assert list(after["web_query"][:2]) == ["web: some relevant?", "web: none relevant?"]


def test_stage_names_and_timings_agree_with_the_output_schema():
    assert tuple(stages.STAGES) == schema.STAGES
    timings = [c for s in stages.STAGES.values() for c in s.outputs if c.startswith("ms_")]
    assert timings == [f"ms_{s}" for s in schema.STAGES]


def checked(outputs=("a",), updates=stages.BOOKKEEPING):
    return stages.Stage("probe", ("question",), outputs, updates)


def kept(df):
    """The bookkeeping columns as they came in, which a probe stage must write back."""
    return {column: df[column] for column in stages.BOOKKEEPING}


def test_a_stage_that_writes_an_undeclared_column_fails():
    probe = stages.runs(checked())(lambda df: {"a": 1, "b": 2, **kept(df)})
    with pytest.raises(
        ValueError,
        match=r"stage 'probe' broke its contract: declared column\(s\) \[\] not written, "
        r"undeclared column\(s\) \['b'\] written",
    ):
        probe(stages.start(questions("x?")))


def test_a_stage_that_rewrites_a_column_it_does_not_declare_fails():
    probe = stages.runs(checked())(lambda df: {"a": 1, "question": "other", **kept(df)})
    with pytest.raises(ValueError, match=r"undeclared column\(s\) \['question'\] written"):
        probe(stages.start(questions("x?")))


def test_a_stage_that_misses_a_declared_column_fails():
    probe = stages.runs(checked(outputs=("a", "ms_probe")))(lambda df: {"a": 1, "error": df["error"]})
    with pytest.raises(
        ValueError,
        match=r"declared column\(s\) \['ms_probe', 'usage', 'decisions'\] not written, "
        r"undeclared column\(s\) \[\] written",
    ):
        probe(stages.start(questions("x?")))


def test_a_stage_cannot_add_a_column_that_is_already_there():
    probe = stages.runs(checked(outputs=("question",), updates=()))(lambda df: {"question": "other"})
    with pytest.raises(ValueError, match=r"would overwrite column\(s\) \['question'\], which it does not declare"):
        probe(stages.start(questions("x?")))


def test_a_stage_that_keeps_its_contract_changes_only_its_columns():
    probe = stages.runs(checked())(lambda df: {**kept(df), "a": [7], "error": ["failed"]})
    out = probe(stages.start(questions("x?")))
    assert list(out.columns) == ["question_id", "question", "error", "usage", "decisions", "a"]
    assert (out.loc[0, "a"], out.loc[0, "error"], out.loc[0, "question"]) == (7, "failed", "x?")


def test_any_irrelevant_flow_mixes_relevant_internal_and_web():
    out, b = run(["some relevant?", "all relevant?", "none relevant?"])
    by_q = out.set_index("question")
    assert by_q.loc["some relevant?", "action"] == "ambiguous" and by_q.loc["some relevant?", "route"] == "mixed"
    assert by_q.loc["all relevant?", "route"] == "internal" and by_q.loc["all relevant?", "web_query"] is None
    assert by_q.loc["none relevant?", "route"] == "web"
    # only questions that need the web are rewritten and searched
    assert b.rewriter.calls == ["some relevant?", "none relevant?"]
    assert b.web_search.calls == ["web: some relevant?", "web: none relevant?"]


def test_the_generator_reads_each_documents_relevance_and_answer_weight_from_its_grade():
    backends = make_backends(CORPUS)
    contexts = []
    answer = backends.generator.generate
    backends.generator.generate = lambda q, context, usage: contexts.append(context) or answer(q, context, usage)
    stages.run_pipeline(questions("some relevant?"), backends, CragConfig())
    (context,) = contexts
    assert [(d["doc_id"], d["relevance"], d["answer_weight"]) for d in context if d["source"] == "internal"] == [
        ("internal-0", 0.9, 0.7)
    ]


def test_generation_uses_the_original_question_not_the_rewritten_one():
    _, b = run(["none relevant?"])
    assert b.generator.calls == [("none relevant?", ["web-0"])]


def test_irrelevant_web_results_are_dropped_when_graded_and_kept_when_not():
    out, _ = run(["none relevant?"])
    assert [d["doc_id"] for d in out.loc[0, "context"]] == ["web-0"]
    out, _ = run(["none relevant?"], cfg=load_config(None, ["web_search.grade_results=false"]))
    assert [d["doc_id"] for d in out.loc[0, "context"]] == ["web-0", "web-1"]


def test_no_context_means_refusal_without_a_generator_call():
    out, b = run(["none relevant?"], web=("web no",))
    assert out.loc[0, "refused"] and out.loc[0, "route"] == "refused"
    assert out.loc[0, "answer"] == CragConfig().generator.refusal_message
    assert b.generator.calls == []
    assert out.loc[0, "decisions"][-1]["reason"] == "no relevant context survived; generator not called"


def test_the_last_resort_answers_when_nothing_else_survives_and_only_then():
    """Fake grades: 0.1 for every document without "yes". At routing.last_resort 0.1 the best internal
    document becomes the context when the web brings nothing usable; above 0.1, or null, it is a refusal;
    a usable web result is preferred to it."""
    cfg = load_config(None, ["routing.policy=thresholds", "routing.last_resort=0.1"])
    out, b = run(["none relevant?"], cfg=cfg, web=("web no",))
    assert out.loc[0, "action"] == "incorrect"  # the policy's action stands
    assert [d["doc_id"] for d in out.loc[0, "context"]] == ["internal-0"] and out.loc[0, "route"] == "internal"
    assert b.generator.calls == [("none relevant?", ["internal-0"])]
    step = [d for d in out.loc[0, "decisions"] if d["step"] == "last_resort"]
    assert step and step[0]["decision"] == "internal-0" and "relevance 0.10" in step[0]["reason"]
    out, _ = run(["none relevant?"], cfg=cfg)  # a usable web result: the last resort is not read
    assert [d["doc_id"] for d in out.loc[0, "context"]] == ["web-0"]
    for setting in ("routing.last_resort=0.2", "routing.last_resort=null"):
        out, b = run(["none relevant?"], cfg=load_config(None, ["routing.policy=thresholds", setting]), web=("web no",))
        assert out.loc[0, "refused"] and b.generator.calls == []


def test_generator_declining_is_a_refusal_too():
    out, b = run(["all relevant?"], decline=True)
    assert out.loc[0, "refused"] and len(b.generator.calls) == 1


def test_web_search_off():
    out, b = run(["none relevant?"], web=None)
    assert out.loc[0, "route"] == "refused" and out.loc[0, "web_query"] is None
    assert any(d["decision"] == "skipped" for d in out.loc[0, "decisions"])


def test_thresholds_incorrect_ignores_internal_documents():
    cfg = load_config(None, ["routing.policy=thresholds"])
    out, _ = run(["some relevant?", "none relevant?"], cfg=cfg)
    assert list(out["action"]) == ["correct", "incorrect"]
    assert list(out["route"]) == ["internal", "web"]


def test_a_failing_batch_is_retried_question_by_question():
    out, b = run(["all relevant?", "boom?", "none relevant?"], fail_on="boom")
    assert out.loc[1, "route"] == "error" and "retrieve: RuntimeError: index unavailable" in out.loc[1, "error"]
    assert list(out.loc[[0, 2], "route"]) == ["internal", "web"]
    assert len(b.retriever.calls) == 4  # the batch, then each question alone


def test_a_grader_miscount_fails_only_that_question():
    out, _ = run(["some relevant?", "all relevant?"], wrong_count_for="some relevant?")
    assert out.loc[0, "route"] == "error" and "grader returned 2 grades for 3 documents" in out.loc[0, "error"]
    assert out.loc[1, "route"] == "internal" and out.loc[1, "error"] is None


def test_documents_whose_grading_failed_are_stored_as_not_graded_with_the_error():
    """Every grading call failing left grades rows with a NULL grade and parse_status, as if graded."""
    out, _ = run(["some relevant?", "all relevant?"], wrong_count_for="some relevant?")
    failed, graded = out.loc[0, "graded"], out.loc[1, "graded"]
    assert [d["doc_id"] for d in failed] == ["internal-0", "internal-1", "internal-2"]  # every one retrieved is kept
    assert {d["parse_status"] for d in failed} == {"not_graded"}
    assert all(d.get("grade") is None and d.get("relevance") is None for d in failed)
    assert all("grader returned 2 grades for 3 documents" in d["rationale"] for d in failed)
    assert {d["parse_status"] for d in graded} == {"ok"} and {d["grade"] for d in graded} == {"yes"}
    rows = to_stage_output(out).column("grades").to_pylist()[0]  # as Spark stores them
    assert {r["parse_status"] for r in rows} == {"not_graded"} and {r["grader"] for r in rows} == {"fake-grader"}


def _rows_of(n: int) -> pd.DataFrame:
    """n questions q0, q1, ... without an error, as a stage's input has them (no call counted yet)."""
    questions = [f"q{i}" for i in range(n)]
    usage = [{"llm_calls": 0}] * n
    return pd.DataFrame({"question_id": questions, "question": questions, "error": [None] * n, "usage": usage})


def test_a_stage_calls_a_backend_on_as_many_threads_as_its_concurrency_and_keeps_them_between_calls():
    """Rows run `workers` at a time; a later call reuses the threads instead of starting new ones
    (thread start-ups, under a lock every thread pool of a process shares, had serialised the
    pipelines of a Spark task)."""
    lock = threading.Lock()
    in_flight, peak, used = [0], [0], set()

    def call(row, tally):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
            used.add(threading.current_thread())  # the Thread itself: it stays alive, unlike its id
        time.sleep(0.03)
        with lock:
            in_flight[0] -= 1
        return row.question.upper()

    df = _rows_of(12)
    first = stages._per_row(df, "generate", call, workers=3)
    assert first.results == [q.upper() for q in df["question"]] and first.errors == [None] * 12
    assert first.usage == [{"llm_calls": 0}] * 12
    assert peak[0] == 3
    _wait_for_idle_row_threads(2)
    alive_before, used_first = set(threading.enumerate()), set(used)
    used.clear()
    stages._per_row(df, "generate", call, workers=3)
    assert len(used) == 3 and used <= alive_before, "the second call started threads of its own"
    assert len(used_first) == 3


def _wait_for_idle_row_threads(n: int) -> None:
    """A row thread counts itself idle just after its last row's result is set: wait for it."""
    deadline = time.monotonic() + 10
    while stages._row_pool._idle_semaphore._value < n and time.monotonic() < deadline:
        time.sleep(0.01)


def _rows_in_a_forked_child(results) -> None:
    threads = set()

    def call(row, tally):
        threads.add(threading.current_thread())
        time.sleep(0.05)
        return row.question

    results.put((stages._per_row(_rows_of(6), "generate", call, workers=3).results, len(threads)))


def test_a_forked_child_gets_row_threads_of_its_own():
    """PySpark forks its Python workers. A child of a process whose row threads were started has none
    of them, though the parent's pool counts them as idle: the child's rows must get threads that run."""
    assert stages._per_row(_rows_of(6), "generate", lambda row, tally: row.question, workers=3).results
    _wait_for_idle_row_threads(2)  # the parent's pool has idle threads when it forks
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_rows_in_a_forked_child, args=(results,))
    child.start()
    child.join(timeout=30)
    hung = child.is_alive()
    if hung:
        child.kill()
    assert not hung, "the forked child waited for row threads that do not exist in it"
    answered, threads = results.get(timeout=5)
    assert answered == [f"q{i}" for i in range(6)]
    assert threads == 3, "the child's rows ran one at a time: its helpers went to the parent's threads"


def test_the_calling_thread_does_every_row_when_no_row_thread_is_free(monkeypatch):
    """At the pool's cap, helpers queue behind busy threads: the call does its rows itself and does not
    wait for them."""
    from concurrent.futures import ThreadPoolExecutor

    busy, release, done = ThreadPoolExecutor(max_workers=1), threading.Event(), threading.Event()
    busy.submit(release.wait, 60)  # the pool's only thread, taken
    monkeypatch.setattr(stages, "_row_pool", busy)
    out = []

    def call_rows():
        out.append(stages._per_row(_rows_of(4), "generate", lambda row, tally: row.question, workers=3))
        done.set()

    caller = threading.Thread(target=call_rows)
    caller.start()
    try:
        assert done.wait(30), "the call waited for a row thread although its rows were done"
    finally:
        release.set()
        caller.join()
        busy.shutdown()
    assert out[0].results == [f"q{i}" for i in range(4)]


def test_refinement_keeps_best_strips_in_original_order():
    context = [doc(0, "no intro. yes first. no filler."), doc(1, "yes second. no tail.")]
    refined = stages.refine_context("q?", context, Grader(), RefinementConfig(enabled=True, keep=2), usage=Usage())
    assert [d["text"] for d in refined] == ["yes first.", "yes second."]


def test_refinement_drops_documents_without_kept_strips():
    context = [doc(0, "no a. no b."), doc(1, "yes c.")]
    refined = stages.refine_context("q?", context, Grader(), RefinementConfig(enabled=True, keep=3), usage=Usage())
    assert [d["doc_id"] for d in refined] == ["internal-1"]


def test_usage_and_counts_reach_the_stage_output():
    out, _ = run(["some relevant?", "all relevant?"])
    table = to_stage_output(out)
    assert table.schema == schema.STAGE_OUTPUT
    rows = table.to_pylist()
    assert rows[0]["search_calls"] == 2 and rows[1]["search_calls"] == 1  # retrieval (+ web)
    assert rows[0]["llm_calls"] == 2 and rows[1]["llm_calls"] == 1  # the fake grader counts itself
    assert (rows[0]["n_retrieved"], rows[0]["n_relevant"], rows[0]["n_web"]) == (3, 1, 2)
    grades = rows[0]["grades"]
    assert [(g["source"], g["rank"], g["grade"]) for g in grades] == [
        ("internal", 1, "yes"),
        ("internal", 2, "no"),
        ("internal", 3, "no"),
        ("web", 1, "yes"),
        ("web", 2, "no"),
    ]
    assert grades[0]["prompt_hash"] == "abc123" and grades[0]["grader"] == "fake-grader"
    assert [d["step"] for d in rows[0]["decisions"]] == [
        "retrieve",
        "grade",
        "route",
        "rewrite",
        "web_search",
        "grade_web",
        "generate",
    ]
    assert rows[0]["sources"] == [{"source": "internal", "doc_id": "internal-0", "title": "T0", "url": None}]


def test_embedded_backends_on_the_sample(sample_backends, sample_config):
    out = stages.run_pipeline(
        questions(
            "How often should the HEPA-13 main filter be replaced?",
            "How high is Mount Fuji?",
            "Who painted the ceiling of the Sistine Chapel?",
        ),
        sample_backends,
        sample_config,
    )
    # the first question also reads the web page titled "HEPA filter", which it names (the title signal);
    # its answer still comes from the knowledge base
    assert list(out["route"]) == ["mixed", "web", "refused"]
    assert "every 12 months" in out.loc[0, "answer"]
    assert "3,776 metres" in out.loc[1, "answer"]
    assert out.loc[0, "sources"][0]["doc_id"] == "aq7-filters"


@pytest.mark.parametrize("threads,per_pipeline", [(3, 2), (4, 1), (2, None)])
def test_streamed_pipelines_give_the_same_rows(sample_backends, sample_config, threads, per_pipeline):
    """Questions taken a few at a time by several pipeline threads (spark.questions_per_pipeline)
    come out exactly as one pipeline over the whole partition makes them, each once, part by part as
    the parts end."""
    from crag.spark import _run_subpipelines

    questions = pd.read_json(f"{SAMPLE}/questions.jsonl", lines=True)
    questions = questions[questions["question"].str.strip().astype(bool)].drop_duplicates("question_id").head(11)
    frame = questions[["question_id", "question"]].reset_index(drop=True)
    reported: list[int] = []
    one = pa.concat_tables(_run_subpipelines(frame, sample_backends, sample_config, reported.append)).to_pandas()
    cfg = sample_config.model_copy(
        update={
            "spark": sample_config.spark.model_copy(
                update={"pipelines_per_task": threads, "questions_per_pipeline": per_pipeline}
            )
        }
    )
    reported.clear()
    parts = list(_run_subpipelines(frame, sample_backends, cfg, reported.append))
    assert sorted(len(part) for part in parts) == sorted(reported)  # each part's rows come out once it is done
    streamed = pa.concat_tables(parts).to_pandas().set_index("question_id").loc[frame["question_id"]].reset_index()
    assert list(one["question_id"]) == list(frame["question_id"])
    assert sum(reported) == len(frame) and (per_pipeline is None or max(reported) <= per_pipeline)
    compared = ["question_id", "answer", "action", "route", "n_retrieved", "n_relevant", "n_web"]
    pd.testing.assert_frame_equal(streamed[compared], one[compared])


def test_a_part_leaves_the_task_as_soon_as_it_is_done(sample_backends, sample_config, monkeypatch):
    """The parts are yielded in the order they end, not in the input's: a slow first part does not
    hold back the rows of the parts after it (Spark takes them in while it is answered)."""
    import crag.spark
    from crag.spark import _run_subpipelines

    first_done, real = threading.Event(), crag.spark.run_pipeline

    def run_pipeline(part, backends, cfg):
        if "q-first" in set(part["question_id"]):
            assert first_done.wait(WAIT_S)  # ends only once a later part has been yielded
        return real(part, backends, cfg)

    monkeypatch.setattr(crag.spark, "run_pipeline", run_pipeline)
    frame = pd.DataFrame(
        {"question_id": ["q-first", "q-second", "q-third"], "question": ["How loud is it?", "Who?", "What?"]}
    )
    cfg = sample_config.model_copy(
        update={"spark": sample_config.spark.model_copy(update={"pipelines_per_task": 3, "questions_per_pipeline": 1})}
    )
    order = []
    for part in _run_subpipelines(frame, sample_backends, cfg, lambda n: None):
        order.extend(part["question_id"].to_pylist())
        first_done.set()
    # q-first may end before or after the third part, but never before the part that let it end
    assert order[0] != "q-first" and sorted(order) == sorted(frame["question_id"])


def test_a_tasks_new_cache_entries_go_out_once_with_the_first_part_that_holds_their_question():
    """Parts leave a task as they end, while other parts still add cache entries: each entry goes out
    once, with the first part done after it was added that holds its question (none is lost, none
    doubled)."""
    from crag.spark import _NewEntries

    cache = StageCache({})
    new = _NewEntries(cache)
    cache.put("k1", "grader", "same question?", "1")
    cache.put("k2", "grader", "later question?", "2")
    first = new.of(["same question?", "same question?", "other question?"])
    assert [[e["key"] for e in entries] for entries in first] == [["k1"], [], []]
    cache.put("k3", "generator", "same question?", "3")  # added by a part still running
    second = new.of(["later question?", "same question?"])
    assert [[e["key"] for e in entries] for entries in second] == [["k2"], ["k3"]]
    assert new.of(["same question?"]) == [[]]
    assert _NewEntries(None).of(["a?", "b?"]) == [[], []]


def test_the_stage_cache_files_every_call_under_its_question_and_counts_its_hits():
    """The web search's input is the rewritten query, yet its stored result is filed under the question
    it served (the driver loads a batch's entries by question); a run from those entries calls no
    backend and its usage counts the hits instead of the calls."""
    texts = ("some relevant?", "none relevant?")
    slices = {role: role for role in ("retriever", "grader", "rewriter", "web_search", "source_check", "generator")}
    first = StageCache({})
    out = stages.run_pipeline(questions(*texts), with_cache(make_backends(CORPUS), first, slices), CragConfig())
    filed = {(e["role"], e["question_key"]) for e in first.new}
    assert {role for role, _ in filed} == {"retriever", "grader", "rewriter", "web_search", "generator"}
    assert {key for _, key in filed} == {question_key(t) for t in texts}
    assert [u["search_calls"] for u in out["usage"]] == [2, 2] and [u["cache_hits"] for u in out["usage"]] == [0, 0]

    backends = make_backends(CORPUS)
    again = stages.run_pipeline(
        questions(*texts),
        with_cache(backends, StageCache({e["key"]: e["value"] for e in first.new}), slices),
        CragConfig(),
    )
    assert backends.retriever.calls == [] and backends.web_search.calls == [] and backends.grader.calls == []
    assert [u["search_calls"] for u in again["usage"]] == [0, 0]
    # each question's retrieve, grade, rewrite, web search, web grades and answer
    assert [u["cache_hits"] for u in again["usage"]] == [6, 6]
    assert list(again["answer"]) == list(out["answer"])


def test_a_worker_process_keeps_a_bounded_number_of_backend_sets(monkeypatch):
    """A run with new credentials builds new backends in a worker process; the oldest set goes."""
    import crag.backends

    built: list[dict] = []
    monkeypatch.setattr(crag.backends, "_CACHE", {})
    monkeypatch.setattr(
        crag.backends, "build_backends", lambda cfg, secrets, tasks, opened_before: built.append(secrets) or object()
    )
    cfg = CragConfig()
    sets = [crag.backends.cached_backends(cfg, {"DATABRICKS_TOKEN": f"dapi-run-{i}"}) for i in range(7)]
    assert len(built) == 7 and len(crag.backends._CACHE) == crag.backends.KEPT_BACKENDS
    assert crag.backends.cached_backends(cfg, {"DATABRICKS_TOKEN": "dapi-run-6"}) is sets[6]  # kept: not built again
    assert len(built) == 7


def test_the_two_stage_fallback_ranks_every_result_once_when_the_source_check_drops_some():
    """The second search's results rank after all the first may have found: the source check leaving
    out some of the first's must not hand their ranks out again."""

    class PerQuery(Web):
        def search(self, query, k, usage=None, *, question=None):
            self.calls.append(query)
            tag = "b" if query.startswith("web:") else "a"
            return [
                {**doc(i, f"no {tag}{i}", "web"), "doc_id": f"{tag}{i}", "parent_id": f"{tag}{i}"} for i in range(3)
            ]

    class KeepLastOfFirst:
        name, concurrency = "fake-check", 1

        def verify(self, question, results, usage):
            return [d["doc_id"] != "a0" and d["doc_id"] != "a1" for d in results]

    backends = make_backends(CORPUS)
    backends = Backends(
        retriever=backends.retriever,
        grader=backends.grader,
        rewriter=backends.rewriter,
        web_search=PerQuery([]),
        generator=backends.generator,
        source_check=KeepLastOfFirst(),
    )
    cfg = load_config(None, ["web_search.fallback=two_stage", "web_search.k=3"])
    out = stages.run_pipeline(questions("none relevant?"), backends, cfg)
    ranks = [(d["doc_id"], d["rank"]) for d in out.loc[0, "web_results"]]
    assert [doc_id for doc_id, _ in ranks] == ["a2", "b0", "b1", "b2"]
    assert len({rank for _, rank in ranks}) == len(ranks) and [r for _, r in ranks] == sorted(r for _, r in ranks)


def test_two_cited_sections_of_one_document_name_it_once_in_the_sources():
    class CitesAll(Generator):
        def generate(self, question, context, usage):
            return Answer("from both sections", cited=list(range(len(context))))

    sections = [{**doc(0, "yes one"), "parent_id": "manual#p0"}, {**doc(0, "yes two"), "parent_id": "manual#p3"}]

    class TwoSections(Retriever):
        def search(self, queries, k, usages=None):
            return [list(sections) for _ in queries]

    backends = make_backends(CORPUS)
    backends = Backends(
        retriever=TwoSections({}),
        grader=backends.grader,
        rewriter=backends.rewriter,
        web_search=backends.web_search,
        generator=CitesAll(),
    )
    out = stages.run_pipeline(questions("all relevant?"), backends, CragConfig())
    assert [s["doc_id"] for s in out.loc[0, "sources"]] == ["internal-0"]
