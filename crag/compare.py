"""`crag compare`: two runs (prompt variants, models, thresholds) side by side, question by question.

`compare_runs` is a pure function over the two runs' answers, grades and metrics: one row per
question in either run (schema.COMPARISONS) and the figures of the summary. `render_report` makes a
self-contained HTML page (inline CSS and SVG, no scripts or external files) from the jinja2 template
crag/templates/compare_report.html.j2.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
from jinja2 import Environment, PackageLoader, StrictUndefined
from pyspark.sql import functions as F

from crag import schema
from crag.config import ABSENT, ConfigDifference, TrackingConfig, shown_key
from crag.errors import InputError, describe
from crag.evaluation import (
    METRIC_DIRECTIONS,
    METRICS,
    Gold,
    answer_units,
    evaluate,
    gold_of,
    is_cjk,
    normalize_answer,
    question_scores,
    run_record,
)
from crag.ids import check_run_id
from crag.questions import GOLD_COLUMNS
from crag.tracking import log_report

log = logging.getLogger("crag")


def answer_similarity(a: str | None, b: str | None) -> float:
    """Word-level similarity of two answers, 0..1 (difflib's ratio on their normalised words;
    characters for CJK text, which has no spaces)."""
    cjk = is_cjk(a or "") or is_cjk(b or "")
    wa, wb = answer_units(a or "", cjk), answer_units(b or "", cjk)
    if not wa and not wb:
        return 1.0
    return difflib.SequenceMatcher(a=wa, b=wb, autojunk=False).ratio()


def grade_flip_rows(base: pd.DataFrame, candidate: pd.DataFrame) -> pd.DataFrame:
    """The documents (source, parent) graded in both runs whose grade differs, with both grades and
    relevances, in question order."""
    key = ["question_id", "source", "parent_id"]
    base, candidate = (run[run["grade"].notna()] for run in (base, candidate))  # not_graded: no grade to flip
    merged = base[key + ["title", "grade", "relevance"]].merge(
        candidate[key + ["grade", "relevance"]], on=key, suffixes=("_base", "_candidate")
    )
    return merged[merged["grade_base"] != merged["grade_candidate"]].sort_values(key).reset_index(drop=True)


def _grade_flips(base: pd.DataFrame, candidate: pd.DataFrame) -> dict[str, list[str]]:
    """Per question, the documents (source:parent) graded in both runs whose grade differs."""
    out: dict[str, list[str]] = {}
    for r in grade_flip_rows(base, candidate).itertuples(index=False):
        out.setdefault(r.question_id, []).append(f"{r.source}:{r.parent_id} {r.grade_base}->{r.grade_candidate}")
    return out


def question_key(text: str | None) -> str:
    """A question's text as compared between runs: NFKC, case and spacing set aside."""
    return " ".join(unicodedata.normalize("NFKC", text or "").casefold().split())


def gold_keys(gold: pd.DataFrame | None) -> dict[str, tuple]:
    """Per question id, its gold as crag.evaluation scores it: the normalised gold answers, whether it
    should be refused, the expected route and the gold documents. A question without a gold row has
    none of them, as one whose gold columns are null."""
    if gold is None or gold.empty:
        return {}
    return {r.question_id: _gold_key(gold_of(r)) for r in gold.itertuples(index=False)}


def _gold_key(gold: Gold) -> tuple:
    return frozenset(normalize_answer(g) for g in gold.answers), gold.impossible, gold.expected_route, gold.doc_ids


_NO_GOLD = _gold_key(Gold((), False, None, frozenset()))  # gold_keys of a question without gold


def _answer_changes(x: pd.Series, y: pd.Series) -> dict:
    """What changed between two runs' answers to the same question."""
    return {
        "answer_changed": normalize_answer(x["answer"] or "") != normalize_answer(y["answer"] or ""),
        "answer_similarity": answer_similarity(x["answer"], y["answer"]),
        "action_flip": x["action"] != y["action"],
        "route_flip": x["route"] != y["route"],
        "n_relevant_delta": int(y["n_relevant"]) - int(x["n_relevant"]),
    }


def _score_deltas(qid: str, scores: list) -> dict:
    """The per-question metric deltas, where both runs have a value."""
    sa, sb = scores
    if sa is None or sb is None or qid not in sa.index or qid not in sb.index:
        return {}
    out = {}
    for metric in ("f1", "answer_contained", "routing_accuracy"):
        va, vb = sa.loc[qid, metric], sb.loc[qid, metric]
        out[f"{metric}_delta"] = None if pd.isna(va) or pd.isna(vb) else float(vb - va)
    return out


def _field(row, column: str):
    """A column of a question's row in one run (None: the run has no such question)."""
    return None if row is None else row[column]


def compare_runs(
    base: dict[str, pd.DataFrame],
    candidate: dict[str, pd.DataFrame],
    base_id: str,
    candidate_id: str,
    question_scores: tuple[pd.DataFrame, pd.DataFrame] | None = None,
) -> pd.DataFrame:
    """One row per question in either run. `question_scores` (per-question metric values of each run,
    from crag.evaluation.question_scores) adds the metric deltas when gold exists.

    A question id in both runs is one question only if it was asked alike: `question_changed` (its
    text differs) leaves the row's comparison columns null, since the answers are to different
    questions; `gold_changed` (its gold differs) keeps the answers compared but gives no metric
    deltas, since each run was scored against other gold. Neither is credited to the variant. Both
    are null for a question in one run only."""
    a, b = base["answers"].set_index("question_id"), candidate["answers"].set_index("question_id")
    flips = _grade_flips(base["grades"], candidate["grades"])
    gold_a, gold_b = gold_keys(base.get("gold")), gold_keys(candidate.get("gold"))
    scores = [
        s.set_index("question_id") if s is not None and not s.empty else None for s in (question_scores or (None, None))
    ]
    rows = []
    for qid in sorted(set(a.index) | set(b.index)):
        x = a.loc[qid] if qid in a.index else None
        y = b.loc[qid] if qid in b.index else None
        row = {
            "base_run": base_id,
            "candidate_run": candidate_id,
            "question_id": qid,
            "question": _field(x, "question") if x is not None else _field(y, "question"),
            "in_base": x is not None,
            "in_candidate": y is not None,
            "question_changed": None,
            "gold_changed": None,
            "answer_base": _field(x, "answer"),
            "answer_candidate": _field(y, "answer"),
            "answer_changed": None,
            "answer_similarity": None,
            "action_base": _field(x, "action"),
            "action_candidate": _field(y, "action"),
            "route_base": _field(x, "route"),
            "route_candidate": _field(y, "route"),
            "action_flip": None,
            "route_flip": None,
            "n_relevant_base": _field(x, "n_relevant"),
            "n_relevant_candidate": _field(y, "n_relevant"),
            "n_relevant_delta": None,
            "grade_flips": [],
            "f1_delta": None,
            "answer_contained_delta": None,
            "routing_accuracy_delta": None,
        }
        if x is not None and y is not None:
            row["question_changed"] = question_key(x["question"]) != question_key(y["question"])
            row["gold_changed"] = gold_a.get(qid, _NO_GOLD) != gold_b.get(qid, _NO_GOLD)
            if not row["question_changed"]:
                row.update(_answer_changes(x, y), grade_flips=flips.get(qid, []))
                if not row["gold_changed"]:
                    row.update(_score_deltas(qid, scores))
        rows.append(row)
    return pd.DataFrame(rows)


def asked_alike(rows: pd.DataFrame) -> pd.Series:
    """The comparison rows of questions both runs answered, asked in the same words."""
    return rows["question_changed"].eq(False)


def paired(rows: pd.DataFrame) -> pd.Series:
    """The comparison rows whose metrics can be compared: asked alike, with the same gold."""
    return asked_alike(rows) & rows["gold_changed"].eq(False)


def metric_deltas(base_metrics: pd.DataFrame, candidate_metrics: pd.DataFrame, slice_: str = "all") -> pd.DataFrame:
    """metric, base, candidate, delta, n_base, n_candidate for one slice, metrics in crag eval's order
    (not the order the metrics tables happen to store them in)."""
    if base_metrics.empty or candidate_metrics.empty:
        return pd.DataFrame(columns=["metric", "base", "candidate", "delta", "n_base", "n_candidate"])
    x = base_metrics[base_metrics["slice"] == slice_].set_index("metric")
    y = candidate_metrics[candidate_metrics["slice"] == slice_].set_index("metric")
    metrics = [m for m in METRICS if m in x.index and m in y.index]
    return pd.DataFrame(
        {
            "metric": metrics,
            "base": [x.loc[m, "value"] for m in metrics],
            "candidate": [y.loc[m, "value"] for m in metrics],
            # a mean of the same values summed in another order differs in its last bits: no change
            "delta": [_delta(x.loc[m, "value"], y.loc[m, "value"]) for m in metrics],
            "n_base": [int(x.loc[m, "n"]) for m in metrics],
            "n_candidate": [int(y.loc[m, "n"]) for m in metrics],
        }
    )


def _delta(base: float, candidate: float) -> float:
    delta = float(candidate - base)
    return 0.0 if abs(delta) < 1e-9 else delta


_CHANGED_SHOWN = 20  # most changed answers in the report; the comparisons table has them all
_FLIPS_SHOWN = 50  # grade flips in the report
_RELEVANCE_BINS = np.linspace(0, 1, 11)


@dataclass
class Figures:
    """What the summary and the report say of a comparison: counts over its rows, and the few rows
    they show. Made over a part of the questions (a Spark partition: `figures_of`) and added up
    (`combined`): every figure is a count, a sum, or the first rows in an order, so the driver receives
    these and no run's rows."""

    base_id: str = ""
    candidate_id: str = ""
    rows: int = 0
    both: int = 0
    only_base: int = 0
    only_candidate: int = 0
    asked_otherwise: int = 0  # in both, asked in other words: answers not compared
    other_gold: int = 0  # asked alike, against other gold: no metric deltas
    paired: int = 0
    alike: int = 0
    changed: int = 0
    similarity_sum: float = 0.0  # over the questions asked alike
    route_flips: list = field(default_factory=list)  # [base route, candidate route, n]
    action_flips: int = 0
    grade_flips: int = 0
    grade_flip_questions: int = 0
    verdict_changes: dict = field(default_factory=dict)  # fixed / broken / ...: n, over every changed answer
    routes: list = field(default_factory=lambda: [{}, {}])  # per run: route -> questions
    actions: list = field(default_factory=lambda: [{}, {}])
    relevance: list = field(default_factory=lambda: [[0] * 10, [0] * 10])  # per run: grades per tenth
    most_changed: list = field(default_factory=list)  # the most changed answers, lowest similarity first
    first_flips: list = field(default_factory=list)  # grade flips by question, source, parent
    metric_totals: list = field(default_factory=lambda: [[], []])  # per run: [metric, slice, value x n, n]

    @classmethod
    def combined(cls, parts: list[Figures]) -> Figures:
        total = cls()
        for part in parts:
            total.base_id, total.candidate_id = part.base_id, part.candidate_id
            for name in ("rows", "both", "only_base", "only_candidate", "asked_otherwise", "other_gold", "paired"):
                setattr(total, name, getattr(total, name) + getattr(part, name))
            for name in ("alike", "changed", "similarity_sum", "action_flips", "grade_flips", "grade_flip_questions"):
                setattr(total, name, getattr(total, name) + getattr(part, name))
            total.route_flips = _counted([*total.route_flips, *part.route_flips])
            total.verdict_changes = dict(Counter(total.verdict_changes) + Counter(part.verdict_changes))
            for i in (0, 1):
                total.routes[i] = dict(Counter(total.routes[i]) + Counter(part.routes[i]))
                total.actions[i] = dict(Counter(total.actions[i]) + Counter(part.actions[i]))
                total.relevance[i] = [a + b for a, b in zip(total.relevance[i], part.relevance[i])]
                total.metric_totals[i] = _counted([*total.metric_totals[i], *part.metric_totals[i]])
            total.most_changed = sorted(
                [*total.most_changed, *part.most_changed], key=lambda c: (c["similarity"], c["question_id"])
            )[:_CHANGED_SHOWN]
            total.first_flips = sorted(
                [*total.first_flips, *part.first_flips], key=lambda f: (f["question_id"], f["source"], f["parent_id"])
            )[:_FLIPS_SHOWN]
        return total

    def metrics(self, run: int) -> pd.DataFrame:
        """One run's metrics over the paired questions (crag.evaluation.evaluate's frame)."""
        rows = [(m, s, total / n, int(n)) for m, s, total, n in self.metric_totals[run] if n]
        return pd.DataFrame(rows, columns=["metric", "slice", "value", "n"])


def _counted(rows: list) -> list:
    """[*key, number, ...] rows added up by key: the last item, or (metric totals) the last two."""
    width = 2 if rows and len(rows[0]) == 4 else 1
    sums: dict[tuple, list] = {}
    for row in rows:
        key, values = tuple(row[:-width]), row[-width:]
        sums[key] = [a + b for a, b in zip(sums.get(key, [0] * width), values)]
    return [[*key, *values] for key, values in sorted(sums.items())]


def figures_of(
    rows: pd.DataFrame,
    base: dict[str, pd.DataFrame],
    candidate: dict[str, pd.DataFrame],
    scores: tuple[pd.DataFrame, pd.DataFrame] | None = None,
) -> Figures:
    """The Figures of comparison `rows` (compare_runs) of the two runs' frames; `scores`: their
    question_scores, when both have gold (the changed answers' verdicts, and the metrics over the paired
    questions)."""
    both = rows["in_base"] & rows["in_candidate"]
    alike, pairs = asked_alike(rows), paired(rows)
    same = rows[alike]
    changed = same[same["answer_changed"].astype(bool)].sort_values(["answer_similarity", "question_id"])
    verdicts = [_verdicts(r, scores) for r in changed.itertuples(index=False)]
    flips = grade_flip_rows(base["grades"], candidate["grades"])
    flips = flips[flips["question_id"].isin(same["question_id"])]  # another question's documents graded otherwise
    questions = dict(zip(rows["question_id"], rows["question"]))
    kinds = Counter(
        zip(
            same.loc[same["route_flip"].astype(bool), "route_base"],
            same.loc[same["route_flip"].astype(bool), "route_candidate"],
        )
    )
    ids = set(rows.loc[pairs, "question_id"])
    return Figures(
        base_id=rows["base_run"].iloc[0] if len(rows) else "",
        candidate_id=rows["candidate_run"].iloc[0] if len(rows) else "",
        rows=len(rows),
        both=int(both.sum()),
        only_base=int((~rows["in_candidate"]).sum()),
        only_candidate=int((~rows["in_base"]).sum()),
        asked_otherwise=int((both & ~alike).sum()),
        other_gold=int((alike & rows["gold_changed"].eq(True)).sum()),
        paired=int(pairs.sum()),
        alike=len(same),
        changed=len(changed),
        similarity_sum=float(same["answer_similarity"].sum()),
        route_flips=[[a, b, n] for (a, b), n in sorted(kinds.items())],
        action_flips=int(same["action_flip"].astype(bool).sum()),
        grade_flips=len(flips),
        grade_flip_questions=flips["question_id"].nunique(),
        verdict_changes=dict(Counter(v["change"] for v in verdicts if v["change"])),
        routes=[dict(Counter(run["answers"]["route"])) for run in (base, candidate)],
        actions=[dict(Counter(run["answers"]["action"].dropna())) for run in (base, candidate)],
        relevance=[
            np.histogram(run["grades"]["relevance"].dropna(), bins=_RELEVANCE_BINS)[0].tolist()
            for run in (base, candidate)
        ],
        most_changed=[
            _changed_entry(r, v) for r, v in zip(changed.head(_CHANGED_SHOWN).itertuples(index=False), verdicts)
        ],
        first_flips=[
            {**_flip_entry(f), "question": questions.get(f.question_id, f.question_id)}
            for f in flips.head(_FLIPS_SHOWN).itertuples(index=False)
        ],
        metric_totals=[_metric_totals(run, ids) if scores is not None else [] for run in (base, candidate)],
    )


def _metric_totals(run: dict[str, pd.DataFrame], ids: set) -> list:
    """A run's metrics over the questions `ids` as [metric, slice, value x n, n]: sums that add up."""
    metrics = evaluate(*(run[name][run[name]["question_id"].isin(ids)] for name in ("answers", "grades", "gold")))
    return [[m, s, float(v) * int(n), int(n)] for m, s, v, n in metrics.itertuples(index=False)]


def _verdicts(row, scores) -> dict:
    """A changed answer's verdict against gold in each run, and what the change of verdict is."""
    score_frames = [None if s is None or s.empty else s.set_index("question_id") for s in (scores or (None, None))]
    base, candidate = (
        gold_verdict(None if frame is None or row.question_id not in frame.index else frame.loc[row.question_id])
        for frame in score_frames
    )
    # against other gold, a verdict's change is not the variant's doing
    change, css = (
        ("gold differs", "same")
        if row.gold_changed
        else _VERDICT_CHANGES.get((base["verdict"], candidate["verdict"]), ("", ""))
    )
    return {"verdict_base": base, "verdict_candidate": candidate, "change": change, "change_css": css}


def _changed_entry(row, verdicts: dict) -> dict:
    return {
        "question_id": row.question_id,
        "question": row.question,
        "similarity": float(row.answer_similarity),
        "answer_base": row.answer_base,
        "answer_candidate": row.answer_candidate,
        "route_base": row.route_base,
        "route_candidate": row.route_candidate,
        "f1_delta": _nullable(row.f1_delta),
        **verdicts,
    }


def _flip_entry(flip) -> dict:
    return {
        "question_id": flip.question_id,
        "source": flip.source,
        "parent_id": flip.parent_id,
        "title": flip.title,
        "grade_base": flip.grade_base,
        "grade_candidate": flip.grade_candidate,
        "relevance_base": _nullable(flip.relevance_base),
        "relevance_candidate": _nullable(flip.relevance_candidate),
    }


def compared(
    base: dict[str, pd.DataFrame],
    candidate: dict[str, pd.DataFrame],
    base_id: str,
    candidate_id: str,
    with_gold: bool | None = None,
) -> tuple[pd.DataFrame, Figures]:
    """The comparison rows of two runs' frames (all their questions, or a part of them: see
    `compare`), and their Figures. `with_gold`: whether both runs have gold (None: whether both frames
    have some)."""
    if with_gold is None:
        with_gold = not base["gold"].empty and not candidate["gold"].empty
    scores = (
        tuple(question_scores(r["answers"], r["grades"], r["gold"]) for r in (base, candidate)) if with_gold else None
    )
    rows = compare_runs(base, candidate, base_id, candidate_id, scores)
    return rows, figures_of(rows, base, candidate, scores)


def metric_figures(
    figures: Figures, base_metrics: pd.DataFrame, candidate_metrics: pd.DataFrame
) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """The metric deltas over the paired questions (both runs' answers to the same question, against
    the same gold), and, when some question is not paired, each run's own figures over all its
    questions (their metrics tables), to be shown apart: a delta between those would credit the
    variant with a change of questions. Metrics need gold in both runs."""
    deltas = metric_deltas(figures.metrics(0), figures.metrics(1))
    whole = None if figures.paired == figures.rows else metric_deltas(base_metrics, candidate_metrics)
    return deltas, whole


def set_apart(figures: Figures) -> str:
    """The questions in both runs that are not compared as one question, in words ("" when none)."""
    parts = [f"{figures.asked_otherwise} asked differently (answers not compared)"] if figures.asked_otherwise else []
    parts += [f"{figures.other_gold} with other gold (no metric deltas)"] if figures.other_gold else []
    return ", ".join(parts)


def summary_lines(
    figures: Figures, deltas: pd.DataFrame, whole: pd.DataFrame | None = None, config: ConfigDifference | None = None
) -> list[str]:
    """The CLI's summary. `whole` (from metric_figures): each run's figures over all its questions,
    listed apart when not every question is paired. `config`: what the two runs' stored configs
    differ in, the first few keys with their values."""
    f = figures
    lines = [
        f"compare {f.base_id} (base) -> {f.candidate_id} (candidate): {f.both} questions in both, "
        f"{f.only_base} only in base, {f.only_candidate} only in candidate"
    ]
    if config is not None:
        lines.append(f"  config            {config_line(config)}")
    if set_apart(f):
        lines.append(f"  set apart         {set_apart(f)}")
    lines += [
        f"  answers changed   {f.changed}"
        + (f" (mean similarity {f.similarity_sum / f.alike:.3f})" if f.alike else " (no question asked alike in both)"),
        f"  route flips       {sum(n for _, _, n in f.route_flips)}"
        + "".join(f", {a}->{b} {n}" for a, b, n in f.route_flips),
        f"  action flips      {f.action_flips}",
        f"  grade flips       {f.grade_flips} documents in {f.grade_flip_questions} questions",
    ]
    if whole is not None and not deltas.empty:
        lines.append(f"  metrics over the {f.paired} paired questions (in both, asked alike, same gold):")
    for r in deltas.itertuples(index=False):
        lines.append(
            f"  {r.metric:18s}{r.base:8.3f} -> {r.candidate:8.3f}  ({r.delta:+.3f}; n {r.n_base} / {r.n_candidate})"
        )
    if whole is not None and not whole.empty:
        lines.append("  each run over all its questions (different questions: no delta):")
        for r in whole.itertuples(index=False):
            lines.append(f"  {r.metric:18s}{r.base:8.3f}    {r.candidate:8.3f}  (n {r.n_base} / {r.n_candidate})")
    return lines


_CONFIG_SHOWN = 4  # changed config keys on the summary's line; the report lists them all


def config_difference(base_record, candidate_record) -> ConfigDifference:
    """What two runs' `runs` rows say their configs differ in."""
    return ConfigDifference.between(
        json.loads(base_record["config"]),
        base_record["config_hash"],
        json.loads(candidate_record["config"]),
        candidate_record["config_hash"],
    )


def config_headline(difference: ConfigDifference) -> str:
    if not difference.changes:
        return (
            "differ in a value stored masked (the config hashes differ)"
            if difference.masked
            else "the same in both runs"
        )
    n = len(difference.changes)
    return f"{n} {'key differs' if n == 1 else 'keys differ'}"


def config_line(difference: ConfigDifference) -> str:
    """The summary's line: the headline, and the first few keys with both values."""
    if not difference.changes:
        return config_headline(difference)
    shown = "; ".join(
        f"{shown_key(key)} {' -> '.join(config_values(a, b))}" for key, a, b in difference.changes[:_CONFIG_SHOWN]
    )
    more = len(difference.changes) - _CONFIG_SHOWN
    return f"{config_headline(difference)}: {shown}" + (f"; and {more} more (in the report)" if more > 0 else "")


def config_values(a, b, width: int = 60) -> tuple[str, str]:
    """Two stored config values, each on one line of at most `width` characters: JSON, cut where
    they start to differ when their beginnings are alike (two prompt texts under one header)."""
    texts = ["(absent)" if v is ABSENT else json.dumps(v, ensure_ascii=False) for v in (a, b)]
    if all(len(t) <= width for t in texts):
        return texts[0], texts[1]
    common = len(os.path.commonprefix(texts))
    start = max(0, common - 10) if common > width - 20 else 0
    shown = []
    for text in texts:
        part = ("…" if start else "") + text[start:]
        shown.append(part if len(part) <= width else part[: width - 1] + "…")
    return shown[0], shown[1]


# ------------------------------------------------------------------ HTML report


def _environment():
    """The report templates (crag/templates, shipped in the wheel), autoescaped: every value from the
    runs is text, escaped by the template, never pre-formatted HTML."""
    return Environment(loader=PackageLoader("crag", "templates"), autoescape=True, undefined=StrictUndefined)


def change_verdict(metric: str, delta: float | None) -> str:
    """better | worse | same for a change of `metric` by `delta` (its direction in
    crag.evaluation.METRIC_DIRECTIONS); changed for a metric without a direction."""
    if delta is None or pd.isna(delta) or abs(delta) < 1e-12:
        return "same"
    direction = METRIC_DIRECTIONS.get(metric)
    if direction is None:
        return "changed"
    return "better" if delta * direction > 0 else "worse"


def gold_verdict(score: pd.Series | None) -> dict[str, str]:
    """One run's answer to one question against its gold (a row of crag.evaluation.question_scores):
    verdict correct | wrong | no gold, and why."""
    if score is None:
        return {"verdict": "no gold", "why": "no gold columns for this question"}
    refused = bool(score["refused"])
    if score["answerable"] == "yes":
        if score["answer_contained"] == 1:
            return {"verdict": "correct", "why": "a gold answer is in the answer"}
        if refused:
            return {"verdict": "wrong", "why": "refused a question that has a gold answer"}
        return {"verdict": "wrong", "why": "no gold answer is in the answer"}
    if pd.isna(score["refusal_correct"]):
        return {"verdict": "no gold", "why": "no gold answer or expected route"}
    should_refuse = refused if score["refusal_correct"] == 1 else not refused
    if should_refuse:
        return (
            {"verdict": "correct", "why": "refused, as the gold says it should"}
            if refused
            else {"verdict": "wrong", "why": "answered a question the gold says has no answer"}
        )
    if refused:
        return {"verdict": "wrong", "why": "refused a question the gold expects answered"}
    return {"verdict": "no gold", "why": "answered; the gold has no answer text to check it against"}


_VERDICT_CHANGES = {
    ("wrong", "correct"): ("fixed", "better"),
    ("correct", "wrong"): ("broken", "worse"),
    ("wrong", "wrong"): ("still wrong", "worse"),
    ("correct", "correct"): ("still correct", "same"),
}


def diff_segments(a: str | None, b: str | None) -> list[tuple[str, str]]:
    """Word-level diff of two answers as (op, text) pieces, op equal | delete | insert. Japanese and
    other CJK text has no spaces between words, so it is compared character by character."""
    cjk = is_cjk(a or "") or is_cjk(b or "")
    sep = "" if cjk else " "
    wa, wb = (list(a or "") if cjk else (a or "").split()), (list(b or "") if cjk else (b or "").split())
    out: list[tuple[str, str]] = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=wa, b=wb, autojunk=False).get_opcodes():
        pieces = [("equal", wa[i1:i2])] if op == "equal" else []
        if op in ("delete", "replace"):
            pieces.append(("delete", wa[i1:i2]))
        if op in ("insert", "replace"):
            pieces.append(("insert", wb[j1:j2]))
        for kind, words in pieces:
            if out and sep:
                out.append(("equal", sep))
            out.append((kind, sep.join(words)))
    return out


def _chart(title: str, counts: dict[str, int], run: str, width: int = 380, label_width: int = 110) -> dict:
    """A horizontal bar chart's geometry; crag/templates draws it as inline SVG. The longest bar
    leaves room for its count label."""
    total, top = max(sum(counts.values()), 1), max(counts.values(), default=0) or 1
    return {
        "title": title,
        "run": run,
        "width": width,
        "label_width": label_width,
        "bars": [
            {"label": str(label), "n": n, "share": n / total, "width": int((width - label_width - 90) * n / top)}
            for label, n in counts.items()
        ],
    }


def _nullable(value) -> float | None:
    return None if value is None or pd.isna(value) else float(value)


def render_report(
    figures: Figures,
    deltas: pd.DataFrame,
    whole: pd.DataFrame | None = None,
    config: ConfigDifference | None = None,
) -> str:
    """The self-contained HTML report (crag/templates/compare_report.html.j2) of a comparison's
    Figures. `deltas` and `whole` as metric_figures gives them; `config` what the runs' configs differ
    in (None: not known, and not shown)."""
    f = figures
    summary = {
        "both": f.both,
        "set_apart": set_apart(f),
        "paired": f.paired,
        "only_base": f.only_base,
        "only_candidate": f.only_candidate,
        "changed": f.changed,
        "similarity": f.similarity_sum / f.alike if f.alike else 1.0,
        "verdicts": [
            (label, f.verdict_changes[label], css)
            for label, css in _VERDICT_CHANGES.values()
            if f.verdict_changes.get(label)
        ],
        "route_flips": sum(n for _, _, n in f.route_flips),
        "route_flip_kinds": [(f"{a}→{b}", n) for a, b, n in f.route_flips],
        "action_flips": f.action_flips,
        "grade_flips": f.grade_flips,
        "grade_flip_questions": f.grade_flip_questions,
    }
    metrics = [
        {
            "metric": r.metric,
            "base": r.base,
            "candidate": r.candidate,
            "delta": float(r.delta),
            "verdict": change_verdict(r.metric, r.delta),
            "n_base": r.n_base,
            "n_candidate": r.n_candidate,
            "better_when": {1: "higher", -1: "lower"}.get(METRIC_DIRECTIONS.get(r.metric) or 0, "–"),
        }
        for r in deltas.itertuples(index=False)
    ]
    changed = [
        {
            **c,
            "f1_verdict": change_verdict("f1", c["f1_delta"]),
            "diff": diff_segments(c["answer_base"], c["answer_candidate"]),
        }
        for c in f.most_changed
    ]
    return (
        _environment()
        .get_template("compare_report.html.j2")
        .render(
            base_id=f.base_id,
            candidate_id=f.candidate_id,
            summary=summary,
            config=None
            if config is None
            else {
                "headline": config_headline(config),
                "rows": [(key, *config_values(a, b, width=240)) for key, a, b in config.changes],
            },
            metrics=metrics,
            whole_runs=[] if whole is None else list(whole.itertuples(index=False)),
            **_charts(f),
            changed=changed,
            more_changed=max(f.changed - len(changed), 0),
            flips=f.first_flips,
            more_flips=max(f.grade_flips - len(f.first_flips), 0),
        )
    )


def _charts(f: Figures) -> dict[str, list[dict]]:
    """The report's bar charts: routes, actions and relevance, of each run."""
    routes = sorted(set(f.routes[0]) | set(f.routes[1]))
    actions = sorted(set(f.actions[0]) | set(f.actions[1]))
    bins = [f"{lo:.1f}-{hi:.1f}" for lo, hi in zip(_RELEVANCE_BINS[:-1], _RELEVANCE_BINS[1:])]
    runs = (("base", f.base_id, 0), ("candidate", f.candidate_id, 1))
    return {
        "route_charts": [
            _chart(f"route — {rid}", {r: f.routes[i].get(r, 0) for r in routes}, kind) for kind, rid, i in runs
        ],
        "action_charts": [
            _chart(f"action — {rid}", {a: f.actions[i].get(a, 0) for a in actions}, kind) for kind, rid, i in runs
        ],
        "relevance_charts": [
            _chart(f"relevance — {rid}", dict(zip(bins, f.relevance[i])), kind) for kind, rid, i in runs
        ],
    }


def compare(
    warehouse,
    base_id: str,
    candidate_id: str,
    report: str | None,
    attach_report: bool = True,
    allow_unfinished: bool = False,
) -> tuple[Figures, list[str], str]:
    """Compare two runs of the Warehouse in Spark, write their comparison rows (replacing an earlier
    comparison of the same pair) and the HTML report; return the Figures, the summary lines and the
    report's path. A run that has not succeeded (still running, or failed) is refused unless
    `allow_unfinished`. With `attach_report`, the report is also attached to the candidate's MLflow
    run, found with the tracking settings that run was logged with (its stored config), not with this
    command's."""

    for run_id in (base_id, candidate_id):
        check_run_id(run_id)  # before a path is made from them
    path = Path(report or f"compare_{base_id}_vs_{candidate_id}.html")
    _check_report_path(path, base_id, candidate_id)  # before both runs are read
    records = {run_id: run_record(warehouse, run_id, allow_unfinished, "compare") for run_id in (base_id, candidate_id)}
    figures = _compare_in_spark(warehouse, base_id, candidate_id)
    metrics = [warehouse.load_run("metrics", run_id).toPandas() for run_id in (base_id, candidate_id)]  # aggregates
    deltas, whole = metric_figures(figures, *metrics)
    changes = config_difference(records[base_id], records[candidate_id])
    html = render_report(figures, deltas, whole=whole, config=changes)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(html, encoding="utf-8")
    except OSError as exc:  # what the check before could not foresee (a full disk, a special file system)
        raise InputError(
            f"the comparison is in the comparisons table, but the report could not be written to {path}: "
            f"{exc.strerror or exc}"
        ) from None
    if attach_report:
        tracking = json.loads(records[candidate_id]["config"]).get("mlflow", {})
        _attach_report(tracking, warehouse.location, candidate_id, path)
    return figures, summary_lines(figures, deltas, whole, changes), str(path)


# What a comparison reads of each run's rows: their answers, gold and grades, joined per question
_ANSWER_FIELDS = ("question", "answer", "action", "route", "refused", "web_query", "n_web", "n_relevant", "sources")
_GRADE_FIELDS = ("source", "doc_id", "parent_id", "title", "grade", "relevance")
_SIDES = ("base", "candidate")
_FIGURES = "figures"  # the column of the partition's Figures (JSON) beside its comparison rows


def _compare_in_spark(warehouse, base_id: str, candidate_id: str) -> Figures:
    """The two runs joined per question in Spark, and each partition of questions compared by
    `compared`: its comparison rows are written to the comparisons table, and its Figures (counts and
    a few rows) come to the driver, added up. No run's rows reach the driver."""
    tables = {
        side: {name: warehouse.load_run(name, run_id) for name in ("answers", "gold", "grades")}
        for side, run_id in zip(_SIDES, (base_id, candidate_id))
    }
    for side, run_id in zip(_SIDES, (base_id, candidate_id)):
        if not tables[side]["answers"].limit(1).count():
            raise InputError(f"run {run_id!r} has no answers in {warehouse.location}")
    with_gold = all(tables[side]["gold"].limit(1).count() for side in _SIDES)
    joined = _side(tables["base"], "base").join(_side(tables["candidate"], "candidate"), "question_id", "full_outer")
    out = pa.schema([*(f for f in schema.COMPARISONS if f.name != "created_at"), pa.field(_FIGURES, pa.string())])
    from pyspark.sql.pandas.types import from_arrow_schema  # noqa: PLC0415

    from crag.spark import kept  # noqa: PLC0415

    compared = joined.mapInArrow(_partition_task(base_id, candidate_id, with_gold, out), from_arrow_schema(out))
    with kept(compared) as parts:  # read twice: the rows, then the figures
        pair = (F.col("base_run") == F.lit(base_id)) & (F.col("candidate_run") == F.lit(candidate_id))
        rows = parts.where(F.col(_FIGURES).isNull()).withColumn("created_at", F.lit(datetime.now(UTC)))
        # question_changed and gold_changed are not columns of the table: there, a question asked
        # differently in the two runs shows as a row in both whose comparison columns are null
        warehouse.replace("comparisons", rows, pair)
        found = parts.where(F.col(_FIGURES).isNotNull()).select(_FIGURES).collect()
    return Figures.combined([Figures(**json.loads(r[_FIGURES])) for r in found])


def _side(tables: dict, side: str):
    """One run's rows per question: its answer, gold and grades, each in a column named for its side."""
    answers = tables["answers"].select("question_id", F.struct(*_ANSWER_FIELDS).alias(side))
    gold = tables["gold"].select("question_id", F.struct(*GOLD_COLUMNS).alias(f"{side}_gold"))
    grades = (
        tables["grades"].groupBy("question_id").agg(F.collect_list(F.struct(*_GRADE_FIELDS)).alias(f"{side}_grades"))
    )
    return answers.join(gold, "question_id", "left").join(grades, "question_id", "left")


def _partition_task(base_id: str, candidate_id: str, with_gold: bool, out: pa.Schema):
    def compare_part(batches):
        for batch in batches:
            records = batch.to_pylist()
            if not records:
                continue
            rows, figures = compared(*(_run_frames(records, side) for side in _SIDES), base_id, candidate_id, with_gold)
            table = pa.Table.from_pandas(rows, schema=out.remove(out.get_field_index(_FIGURES)), preserve_index=False)
            yield from table.append_column(_FIGURES, pa.nulls(len(rows), pa.string())).to_batches()
            summary = {
                name: [json.dumps(asdict(figures), default=float)] if name == _FIGURES else [None] for name in out.names
            }
            yield pa.RecordBatch.from_pydict(summary, schema=out)

    return compare_part


def _run_frames(records: list[dict], side: str) -> dict[str, pd.DataFrame]:
    """One run's answers, gold and grades frames, as crag.evaluation reads them, of joined records."""
    present = [r for r in records if r[side] is not None]
    return {
        "answers": pd.DataFrame(
            [{"question_id": r["question_id"], **r[side]} for r in present], columns=["question_id", *_ANSWER_FIELDS]
        ),
        "gold": pd.DataFrame(
            [{"question_id": r["question_id"], **r[f"{side}_gold"]} for r in present if r[f"{side}_gold"] is not None],
            columns=["question_id", *GOLD_COLUMNS],
        ),
        "grades": pd.DataFrame(
            [{"question_id": r["question_id"], **g} for r in present for g in r[f"{side}_grades"] or []],
            columns=["question_id", *_GRADE_FIELDS],
        ),
    }


def _check_report_path(path: Path, base_id: str, candidate_id: str) -> None:
    """InputError when no file can be written at `path`: a folder there, a file in the way of its
    folders, or no permission. Nothing is created: the report's folders are made when it is written."""
    if path.is_dir():
        raise InputError(
            f"--report {path} is a folder: give the path of the HTML file to write, "
            f"e.g. {path / f'compare_{base_id}_vs_{candidate_id}.html'}"
        )
    if path.exists():  # replacing the file: its own permission counts
        if not os.access(path, os.W_OK):
            raise InputError(f"cannot write the report {path}: permission denied")
        return
    existing = next(p for p in path.absolute().parents if p.exists())  # the root exists
    if not existing.is_dir():
        raise InputError(f"cannot write the report {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"cannot write the report {path}: permission denied in {existing}")


def _attach_report(stored_tracking: dict, location: str, candidate_id: str, path: Path) -> None:
    """Attach the report to the candidate's MLflow run. The comparison rows and the report are written
    by then, so a tracking store that cannot be reached (or a tracking URI stored redacted because it
    held credentials) costs a warning line, not the command."""
    try:
        log_report(TrackingConfig.model_validate(stored_tracking), location, candidate_id, str(path))
    except Exception as exc:
        log.warning("the report was not attached to run %s's MLflow run: %s", candidate_id, describe(exc))
