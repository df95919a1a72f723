"""Answer quality you can measure: metrics of a run against the gold columns of its questions.

Pure functions over the answers, grades and gold tables of one run. Per question:
- exact_match, f1: SQuAD's normalised exact match and token F1, best over the gold answers (by
  character when the answer or the gold answer is Japanese or other CJK text); answer_contained: a
  normalised gold answer occurs inside the returned answer, as whole words. Over answerable questions; a refusal scores 0.
- refused; refusal_correct: refused exactly when the question should be refused (is_impossible, or
  expected_route none); answerable_refused: refusals of answerable questions.
- routing_accuracy: against expected_route: none -> refused; internal / web -> answered with that
  collection among the cited sources. route_exact: the route is exactly the expected one (mixed never
  is). web_search_rate: the question went to the web.
- action_accuracy: the CRAG paper's action against expected_route: a question expected from the
  knowledge base should be `correct`, one expected from the web `incorrect`; `ambiguous` (both
  sources) is right for neither. Unlike routing_accuracy it does not credit an ambiguous question
  that happened to cite the expected collection. action_correct / action_ambiguous /
  action_incorrect: the share of each action; sliced by expected_route they are the confusion
  (expected route x action; `action_confusion` gives it as counts).
- recall_at_k: a gold document is among the internal documents retrieved (questions expected to be
  answered internally); web_recall: among the web results (questions expected from the web).
Per graded document, against gold_doc_ids: grader_precision and grader_recall.
Each metric is computed overall (slice "all") and per slice: route, action, language, expected_route,
answerable.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from crag import schema
from crag.counts import ACTIONS, ROUTES
from crag.errors import InputError
from crag.ids import check_run_id
from crag.questions import EXPECTED_ROUTES, GOLD_COLUMNS

CJK_CHARACTER = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f]")
_ARTICLES = re.compile(r"\b(a|an|the)\b")


# ------------------------------------------------------------------ text metrics


def is_cjk(text: str) -> bool:
    return bool(CJK_CHARACTER.search(text or ""))


def normalize_answer(text: str, cjk: bool | None = None) -> str:
    """SQuAD's normalisation (lower case, no punctuation, no English articles, single spaces); for
    CJK text also NFKC and no spaces at all, since words are not space-separated. `cjk`: which of the
    two (default: CJK when the text has a CJK character). A prediction is normalised as its gold answer
    is: an English answer quoting one Chinese title must keep its spaces to contain an English gold answer."""
    text = unicodedata.normalize("NFKC", text or "").lower()
    if is_cjk(text) if cjk is None else cjk:
        return "".join(
            ch for ch in text if not unicodedata.category(ch).startswith(("P", "Z", "S")) and not ch.isspace()
        )
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    return " ".join(_ARTICLES.sub(" ", text).split())


def answer_units(text: str, cjk: bool) -> list[str]:
    """What answers are compared by: the normalised text's characters (CJK) or words."""
    normalized = normalize_answer(text, cjk)
    return list(normalized) if cjk else normalized.split()


def by_character(prediction: str, gold: str) -> bool:
    """Whether an answer is scored against a gold answer character by character: when either is CJK
    text, which has no spaces between words (a Japanese answer holding a Latin gold answer, a model
    number say, would otherwise be one long word that never matches)."""
    return is_cjk(prediction) or is_cjk(gold)


def exact_match(prediction: str, gold: str) -> float:
    cjk = by_character(prediction, gold)
    return float(normalize_answer(prediction, cjk) == normalize_answer(gold, cjk))


def f1(prediction: str, gold: str) -> float:
    """Token F1 (characters when either answer is CJK)."""
    cjk = by_character(prediction, gold)
    pred, ref = answer_units(prediction, cjk), answer_units(gold, cjk)
    common = sum((Counter(pred) & Counter(ref)).values())
    if not pred or not ref or common == 0:
        return float(pred == ref)
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def _one_word(a: str, b: str) -> bool:
    """Whether two adjacent characters are part of one word: both letters or digits of text written
    with spaces between words. CJK text has none, so a CJK character next to a match ends no word and
    continues none (AQ-7は2.4GHzの holds 2.4GHz, 15年 does not hold 5年)."""
    return a.isalnum() and b.isalnum() and not is_cjk(a) and not is_cjk(b)


def contained(prediction: str, gold: str) -> float:
    """A normalised gold answer occurs in the normalised answer as whole words: "15 years" does not
    hold "5 years", nor 19910 1991."""
    cjk = is_cjk(gold)
    return holds(normalize_answer(prediction, cjk), normalize_answer(gold, cjk))


def holds(p: str, g: str) -> float:
    """`contained` over texts normalised already (a long text checked against many answers is
    normalised once)."""
    start = p.find(g) if g else -1
    while start >= 0:
        end = start + len(g)
        if (start == 0 or not _one_word(p[start - 1], g[0])) and (end == len(p) or not _one_word(g[-1], p[end])):
            return 1.0
        start = p.find(g, start + 1)
    return 0.0


def best(metric, prediction: str | None, golds: Iterable[str]) -> float:
    golds = [g for g in golds if g]
    if prediction is None or not golds:
        return 0.0
    return max(metric(prediction, g) for g in golds)


# ------------------------------------------------------------------ per-question table


def _as_list(value) -> list:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return []
    if isinstance(value, str):
        return [value]
    return [v for v in list(value) if v is not None]


@dataclass(frozen=True)
class Gold:
    """A question's gold as the metrics read it from its gold row, whose fields may each be null."""

    answers: tuple[str, ...]  # the ones that hold text (gold_answers)
    impossible: bool
    expected_route: str | None
    doc_ids: frozenset[str]


def gold_of(row) -> Gold:
    """The Gold of a row with the gold columns (a question without a gold row: all of them null)."""
    return Gold(
        tuple(gold_answers(row.answers)),
        bool(row.is_impossible) if pd.notna(row.is_impossible) else False,
        row.expected_route if isinstance(row.expected_route, str) else None,
        frozenset(_as_list(row.gold_doc_ids)),
    )


def gold_answers(value) -> list[str]:
    """The gold answers that hold text: SQuAD 2.0 writes `answers: [""]` for a question without an
    answer, and a blank gold answer is no answer (best() could match nothing against it)."""
    return [g for g in _as_list(value) if g.strip()]


def question_scores(answers: pd.DataFrame, grades: pd.DataFrame, gold: pd.DataFrame) -> pd.DataFrame:
    """One row per answered question with its slice keys and per-question metric values (NaN where a
    metric does not apply). A question without a gold row (a JSONL line without gold keys) still counts
    in the metrics that need no gold (refused, web_search_rate, the action shares), as it does when
    its gold columns are null (Parquet, CSV)."""
    df = answers.merge(gold.drop(columns=[c for c in ("run_id", "variant") if c in gold]), on="question_id", how="left")
    internal = grades[grades["source"] == "internal"].groupby("question_id")["doc_id"].apply(set)
    web = grades[grades["source"] == "web"].groupby("question_id")["doc_id"].apply(set)
    rows = []
    for r in df.itertuples(index=False):
        gold = gold_of(r)
        golds, impossible, expected = list(gold.answers), gold.impossible, gold.expected_route
        answerable = bool(golds) and not impossible and expected != "none"
        should_refuse = impossible or expected == "none"
        answer = None if r.refused or r.route == "error" else r.answer
        cited = {s["source"] for s in _as_list(r.sources)}
        searched = isinstance(r.web_query, str)
        gold_docs = set(gold.doc_ids)
        row = {
            "question_id": r.question_id,
            "route": r.route,
            "action": r.action if isinstance(r.action, str) else "none",
            "language": "ja" if is_cjk(r.question) else "en",
            "expected_route": expected or "unknown",
            "answerable": "yes" if answerable else "no",
            "exact_match": best(exact_match, answer, golds) if answerable else np.nan,
            "f1": best(f1, answer, golds) if answerable else np.nan,
            "answer_contained": best(contained, answer, golds) if answerable else np.nan,
            "refused": float(bool(r.refused)),
            "refusal_correct": float(bool(r.refused) == should_refuse)
            if (golds or should_refuse or expected)
            else np.nan,
            "answerable_refused": float(bool(r.refused)) if answerable else np.nan,
            "web_search_rate": float(searched),
            "routing_accuracy": np.nan,
            "route_exact": np.nan,
            "action_accuracy": np.nan,
            "recall_at_k": np.nan,
            "web_recall": np.nan,
        }
        if expected in EXPECTED_ROUTES:
            if expected == "none":
                ok = bool(r.refused)
            else:
                ok = not r.refused and r.route != "error" and expected in cited
            row["routing_accuracy"] = float(ok)
            row["route_exact"] = float(r.route == ("refused" if expected == "none" else expected))
        if expected in EXPECTED_ACTION:
            row["action_accuracy"] = float(row["action"] == EXPECTED_ACTION[expected])
        for action in ACTIONS:
            row[f"action_{action}"] = float(row["action"] == action)
        if gold_docs:
            if expected in (None, "internal"):
                row["recall_at_k"] = float(bool(gold_docs & internal.get(r.question_id, set())))
            # Web results are stored (in grades) only when they are graded: with web_search.grade_results
            # off, a question that found some has nothing to look for the gold in, which is no miss.
            if expected == "web" and searched and (r.question_id in web or not r.n_web):
                row["web_recall"] = float(bool(gold_docs & web.get(r.question_id, set())))
        rows.append(row)
    return pd.DataFrame(rows)


# The paper's action that is right for each expected route; `ambiguous` is right for none of them.
EXPECTED_ACTION = {"internal": "correct", "web": "incorrect"}
QUESTION_METRICS = (
    "exact_match",
    "f1",
    "answer_contained",
    "refused",
    "refusal_correct",
    "answerable_refused",
    "routing_accuracy",
    "route_exact",
    "action_accuracy",
    *(f"action_{a}" for a in ACTIONS),
    "web_search_rate",
    "recall_at_k",
    "web_recall",
)
# Every metric, in the order crag eval and crag compare show them.
METRICS = (*QUESTION_METRICS, "grader_precision", "grader_recall")
SLICES = ("route", "action", "language", "expected_route", "answerable")
# The values each slice key can take (see question_scores): `crag eval --slices` checks them before it
# computes anything
SLICE_VALUES = {
    "route": ROUTES,
    "action": (*ACTIONS, "none"),
    "language": ("en", "ja"),
    "expected_route": (*EXPECTED_ROUTES, "unknown"),
    "answerable": ("yes", "no"),
}

# Which way each metric gets better: +1 higher, -1 lower. A web search costs a call and brings outside
# text into the context, so at equal quality fewer is better; refusals of the same questions too
# (whether a refusal was right is refusal_correct's business).
METRIC_DIRECTIONS = {
    "exact_match": +1,
    "f1": +1,
    "answer_contained": +1,
    "refused": -1,
    "refusal_correct": +1,
    "answerable_refused": -1,
    "routing_accuracy": +1,
    "route_exact": +1,
    "web_search_rate": -1,
    "recall_at_k": +1,
    "web_recall": +1,
    "grader_precision": +1,
    "grader_recall": +1,
    "action_accuracy": +1,
    # the share of each action is neither better nor worse by itself (None: shown as changed)
    **{f"action_{a}": None for a in ACTIONS},
}


def action_confusion(scores: pd.DataFrame) -> pd.DataFrame:
    """Questions per expected route (rows: internal, web, and any other present) x action (columns:
    correct, ambiguous, incorrect, and none for questions that ended in an error), from
    `question_scores`."""
    if scores.empty:
        return pd.DataFrame(columns=[*ACTIONS, "none"])
    table = pd.crosstab(scores["expected_route"], scores["action"])
    rows = [*EXPECTED_ACTION, *sorted(set(table.index) - set(EXPECTED_ACTION))]
    return table.reindex(index=rows, columns=[*ACTIONS, "none"], fill_value=0).rename_axis(
        index="expected", columns="action"
    )


def _grader_pr(docs: pd.DataFrame) -> list[tuple[str, float, int]]:
    docs = docs[docs["grade"].notna()]  # a document the grader's call failed on (not_graded) was not graded
    if docs.empty:
        return []
    yes, gold = docs["grade"] == "yes", docs["is_gold"]
    out = []
    if yes.sum():
        out.append(("grader_precision", float((yes & gold).sum() / yes.sum()), int(yes.sum())))
    if gold.sum():
        out.append(("grader_recall", float((yes & gold).sum() / gold.sum()), int(gold.sum())))
    return out


def evaluate(answers: pd.DataFrame, grades: pd.DataFrame, gold: pd.DataFrame) -> pd.DataFrame:
    """metric, slice, value, n (questions or documents behind the value)."""
    scores = question_scores(answers, grades, gold)
    if scores.empty:
        return pd.DataFrame(columns=["metric", "slice", "value", "n"])
    gold_docs = (
        gold.set_index("question_id")["gold_doc_ids"].map(lambda v: set(_as_list(v)))
        if "gold_doc_ids" in gold
        else None
    )
    docs = grades[grades["question_id"].isin(scores["question_id"])].copy()
    if gold_docs is not None and gold_docs.map(bool).any():
        docs["is_gold"] = [d in gold_docs.get(q, set()) for q, d in zip(docs["question_id"], docs["doc_id"])]
        docs = docs[docs["question_id"].map(lambda q: bool(gold_docs.get(q)))]
    else:
        docs = docs.iloc[0:0].assign(is_gold=False)

    out = []
    groups = [("all", scores)] + [
        (f"{key}={value}", part) for key in SLICES for value, part in scores.groupby(key, sort=True)
    ]
    for name, part in groups:
        for metric in QUESTION_METRICS:
            values = part[metric].dropna()
            if len(values):
                out.append((metric, name, float(values.mean()), int(len(values))))
        for metric, value, n in _grader_pr(docs[docs["question_id"].isin(part["question_id"])]):
            out.append((metric, name, value, n))
    return pd.DataFrame(out, columns=["metric", "slice", "value", "n"])


def run_record(warehouse, run_id: str, allow_unfinished: bool, doing: str):
    """The run's `runs` row (status, config). A run that has not succeeded (still running, or failed:
    its tables may hold an earlier attempt's rows) is refused unless `allow_unfinished`."""
    check_run_id(run_id)
    record = warehouse.load_run("runs", run_id).select("status", "config", "config_hash").collect()
    if not record:
        if warehouse.folder is not None and not warehouse.folder.exists():
            raise InputError(f"no warehouse at {warehouse.location}: the folder does not exist")
        raise InputError(f"no run {run_id!r} in {warehouse.location}")
    if record[0]["status"] != "succeeded" and not allow_unfinished:
        raise InputError(
            f"run {run_id!r} has not succeeded (status {record[0]['status']}): {doing} it when it "
            f"has, or pass --allow-unfinished to {doing} the rows it has"
        )
    return record[0]


# What question_scores reads of an answer row.
_ANSWER_COLUMNS = ("question_id", "question", "answer", "action", "route", "refused", "web_query", "n_web", "sources")


def evaluate_run(warehouse, run_id: str) -> pd.DataFrame:
    """`crag eval`: the run's metrics from the rows it shows, computed in Spark (metric_sums), and
    stored for the generation it shows, in place of that generation's earlier ones."""
    tables = {name: warehouse.load_run(name, run_id) for name in ("answers", "grades", "gold")}
    first = tables["answers"].select("variant").limit(1).collect()
    if not first:
        raise InputError(f"run {run_id!r} has no answers in {warehouse.location}")
    if not tables["gold"].limit(1).count():
        raise InputError(
            f"run {run_id!r} has no gold columns (answers, is_impossible, expected_route, gold_doc_ids) to evaluate against"
        )
    generation = warehouse.load_run("runs", run_id).select("shown_generation").first()[0]
    metrics = metrics_of(metric_sums(tables["answers"], tables["gold"], tables["grades"]))
    store_metrics(warehouse, metrics, run_id, generation, first[0]["variant"], replace=True)
    return metrics


def metric_sums(answers, gold, grades=None) -> pd.DataFrame:
    """Each metric's total and n (metric, slice, total, n) over the questions of `answers` (Spark
    DataFrames of answer rows and of their gold rows; `grades` the answers' grade rows, unless the
    answers are result rows, which nest their grades): computed in Spark, each partition of questions
    (with their grades and gold) evaluated by `evaluate`. Every metric is a mean, so the sums of parts
    (batches of a run) add up to the whole's: `metrics_of` makes them the metrics."""
    from pyspark.sql import functions as F  # noqa: PLC0415  # crag ask loads this module (semantic grader, console) without Spark

    if grades is None:  # results: each question's grades nested in its row already
        graded = F.transform(
            "grades",
            lambda g: F.struct(g["source"].alias("source"), g["doc_id"].alias("doc_id"), g["grade"].alias("grade")),
        )
        answered = answers.select(*_ANSWER_COLUMNS, graded.alias("graded"))
    else:
        nested = grades.groupBy("question_id").agg(
            F.collect_list(F.struct("source", "doc_id", "grade")).alias("graded")
        )
        answered = answers.select(*_ANSWER_COLUMNS).join(nested, "question_id", "left")
    # left: questions without a gold row count in the metrics that need none (see question_scores)
    joined = answered.join(gold.select("question_id", *GOLD_COLUMNS), "question_id", "left")

    def per_partition(frames):
        for frame in frames:
            graded = [
                {"question_id": q, **g}
                for q, docs in zip(frame["question_id"], frame["graded"])
                for g in (docs if docs is not None else [])
            ]
            doc_frame = pd.DataFrame(graded, columns=["question_id", "source", "doc_id", "grade"])
            m = evaluate(frame[list(_ANSWER_COLUMNS)], doc_frame, frame[["question_id", *GOLD_COLUMNS]])
            yield pd.DataFrame({"metric": m["metric"], "slice": m["slice"], "total": m["value"] * m["n"], "n": m["n"]})

    sums = (
        joined.mapInPandas(per_partition, "metric string, slice string, total double, n long")
        .groupBy("metric", "slice")
        .agg(F.sum("total").alias("total"), F.sum("n").alias("n"))
        .toPandas()  # metrics x slices: a few hundred rows at most
    )
    sums.attrs.clear()  # Spark Connect leaves its plan metrics there, which Arrow cannot carry
    return sums


def metrics_of(sums: pd.DataFrame) -> pd.DataFrame:
    """The metrics (metric, slice, value, n) from metric_sums' rows, of one part or of several."""
    added = sums.groupby(["metric", "slice"], as_index=False)[["total", "n"]].sum()
    return added.assign(value=added["total"] / added["n"])[["metric", "slice", "value", "n"]]


def store_metrics(warehouse, metrics: pd.DataFrame, run_id: str, generation: str, variant: str, replace: bool):
    """The metrics stored for a run's generation: in place of the generation's earlier ones (`replace`),
    or appended (a generation new to the table)."""
    from pyspark.sql import functions as F  # noqa: PLC0415  # as metric_sums'

    rows = warehouse.frame(
        "metric_values",
        pa.Table.from_pandas(
            metrics.assign(run_id=run_id, generation=generation, variant=variant),
            schema=schema.METRIC_VALUES,
            preserve_index=False,
        ),
    )
    if replace:
        same = (F.col("run_id") == F.lit(run_id)) & (F.col("generation") == F.lit(generation))
        warehouse.replace("metric_values", rows, same)
    else:
        warehouse.append("metric_values", rows)
