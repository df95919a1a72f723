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
    read_run,
    run_record,
)
from crag.ids import check_run_id
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
        get = lambda r, c: None if r is None else r[c]  # noqa: E731
        row = {
            "base_run": base_id,
            "candidate_run": candidate_id,
            "question_id": qid,
            "question": get(x, "question") if x is not None else get(y, "question"),
            "in_base": x is not None,
            "in_candidate": y is not None,
            "question_changed": None,
            "gold_changed": None,
            "answer_base": get(x, "answer"),
            "answer_candidate": get(y, "answer"),
            "answer_changed": None,
            "answer_similarity": None,
            "action_base": get(x, "action"),
            "action_candidate": get(y, "action"),
            "route_base": get(x, "route"),
            "route_candidate": get(y, "route"),
            "action_flip": None,
            "route_flip": None,
            "n_relevant_base": get(x, "n_relevant"),
            "n_relevant_candidate": get(y, "n_relevant"),
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


def paired_metrics(rows: pd.DataFrame, run: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """A run's metrics (crag.evaluation.evaluate) over the paired questions alone."""
    ids = set(rows.loc[paired(rows), "question_id"])
    return evaluate(*(run[name][run[name]["question_id"].isin(ids)] for name in ("answers", "grades", "gold")))


def metric_figures(
    rows: pd.DataFrame, base: dict[str, pd.DataFrame], candidate: dict[str, pd.DataFrame]
) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """The metric deltas over the paired questions (both runs' answers to the same question, against
    the same gold), and, when some question is not paired, each run's own figures over all its
    questions, to be shown apart: a delta between those would credit the variant with a change of
    questions. Metrics need gold in both runs."""
    with_gold = not base["gold"].empty and not candidate["gold"].empty
    none = pd.DataFrame(columns=["metric", "slice", "value", "n"])
    deltas = metric_deltas(*(paired_metrics(rows, run) if with_gold else none for run in (base, candidate)))
    whole = None if paired(rows).all() else metric_deltas(base["metrics"], candidate["metrics"])
    return deltas, whole


def set_apart(rows: pd.DataFrame) -> str:
    """The questions in both runs that are not compared as one question, in words ("" when none)."""
    in_both = rows["in_base"] & rows["in_candidate"]
    asked_otherwise = int((in_both & ~asked_alike(rows)).sum())
    other_gold = int((asked_alike(rows) & rows["gold_changed"].eq(True)).sum())
    parts = [f"{asked_otherwise} asked differently (answers not compared)"] if asked_otherwise else []
    parts += [f"{other_gold} with other gold (no metric deltas)"] if other_gold else []
    return ", ".join(parts)


def summary_lines(
    rows: pd.DataFrame, deltas: pd.DataFrame, whole: pd.DataFrame | None = None, config: ConfigDifference | None = None
) -> list[str]:
    """The CLI's summary. `whole` (from metric_figures): each run's figures over all its questions,
    listed apart when not every question is paired. `config`: what the two runs' stored configs
    differ in, the first few keys with their values."""
    both = rows[asked_alike(rows)]
    lines = [
        f"compare {rows['base_run'].iloc[0]} (base) -> {rows['candidate_run'].iloc[0]} (candidate): "
        f"{int((rows['in_base'] & rows['in_candidate']).sum())} questions in both, "
        f"{int((~rows['in_candidate']).sum())} only in base, {int((~rows['in_base']).sum())} only in candidate",
    ]
    if config is not None:
        lines.append(f"  config            {config_line(config)}")
    if set_apart(rows):
        lines.append(f"  set apart         {set_apart(rows)}")
    lines += [
        f"  answers changed   {int(both['answer_changed'].sum())}"
        + (
            f" (mean similarity {both['answer_similarity'].mean():.3f})"
            if len(both)
            else " (no question asked alike in both)"
        ),
        f"  route flips       {int(both['route_flip'].sum())}"
        + "".join(
            f", {a}->{b} {n}"
            for (a, b), n in sorted(
                Counter(
                    zip(both.loc[both["route_flip"], "route_base"], both.loc[both["route_flip"], "route_candidate"])
                ).items()
            )
        ),
        f"  action flips      {int(both['action_flip'].sum())}",
        f"  grade flips       {int(both['grade_flips'].map(len).sum())} documents in {int((both['grade_flips'].map(len) > 0).sum())} questions",
    ]
    if whole is not None and not deltas.empty:
        lines.append(
            f"  metrics over the {int(paired(rows).sum())} paired questions (in both, asked alike, same gold):"
        )
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

_CHANGED_SHOWN = 20  # most changed answers in the report; the comparisons table has them all
_FLIPS_SHOWN = 50  # grade flips in the report


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


def _histogram(values: np.ndarray, bins: np.ndarray) -> dict[str, int]:
    counts, _ = np.histogram(values, bins=bins)
    return {f"{lo:.1f}-{hi:.1f}": int(c) for lo, hi, c in zip(bins[:-1], bins[1:], counts)}


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
    rows: pd.DataFrame,
    deltas: pd.DataFrame,
    base: dict[str, pd.DataFrame],
    candidate: dict[str, pd.DataFrame],
    most_changed: int = _CHANGED_SHOWN,
    question_scores: tuple[pd.DataFrame, pd.DataFrame] | None = None,
    whole: pd.DataFrame | None = None,
    config: ConfigDifference | None = None,
) -> str:
    """The self-contained HTML report (crag/templates/compare_report.html.j2). `question_scores`
    (each run's crag.evaluation.question_scores, when gold exists) gives each changed answer its gold
    verdict. `deltas` and `whole` as metric_figures gives them; `config` what the runs' configs differ
    in (None: not known, and not shown)."""
    base_id, cand_id = rows["base_run"].iloc[0], rows["candidate_run"].iloc[0]
    both = rows[asked_alike(rows)]
    scores = [
        s.set_index("question_id") if s is not None and not s.empty else None for s in (question_scores or (None, None))
    ]

    def score_of(i: int, qid: str):
        frame = scores[i]
        return None if frame is None or qid not in frame.index else frame.loc[qid]

    changed_all = both[both["answer_changed"].astype(bool)].sort_values(["answer_similarity", "question_id"])
    changed = []
    for r in changed_all.itertuples(index=False):
        vb, vc = gold_verdict(score_of(0, r.question_id)), gold_verdict(score_of(1, r.question_id))
        # against other gold, a verdict's change is not the variant's doing
        change, change_css = (
            ("gold differs", "same")
            if r.gold_changed
            else _VERDICT_CHANGES.get((vb["verdict"], vc["verdict"]), ("", ""))
        )
        changed.append(
            {
                "question": r.question,
                "similarity": r.answer_similarity,
                "verdict_base": vb,
                "verdict_candidate": vc,
                "change": change,
                "change_css": change_css,
                "route_base": r.route_base,
                "route_candidate": r.route_candidate,
                "f1_delta": _nullable(r.f1_delta),
                "f1_verdict": change_verdict("f1", r.f1_delta),
                "diff": diff_segments(r.answer_base, r.answer_candidate),
            }
        )
    verdict_counts = Counter(c["change"] for c in changed if c["change"])
    summary = {
        "both": int((rows["in_base"] & rows["in_candidate"]).sum()),
        "set_apart": set_apart(rows),
        "paired": int(paired(rows).sum()),
        "only_base": int((~rows["in_candidate"]).sum()),
        "only_candidate": int((~rows["in_base"]).sum()),
        "changed": len(changed_all),
        "similarity": float(both["answer_similarity"].mean()) if len(both) else 1.0,
        "verdicts": [
            (label, verdict_counts[label], css) for label, css in _VERDICT_CHANGES.values() if verdict_counts[label]
        ],
        "route_flips": int(both["route_flip"].sum()),
        "route_flip_kinds": [
            (f"{a}→{b}", n)
            for (a, b), n in sorted(
                Counter(
                    zip(
                        both.loc[both["route_flip"].astype(bool), "route_base"],
                        both.loc[both["route_flip"].astype(bool), "route_candidate"],
                    )
                ).items()
            )
        ],
        "action_flips": int(both["action_flip"].sum()),
        "grade_flips": int(both["grade_flips"].map(len).sum()),
        "grade_flip_questions": int((both["grade_flips"].map(len) > 0).sum()),
    }
    whole_runs = [] if whole is None else list(whole.itertuples(index=False))
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

    questions = dict(zip(rows["question_id"], rows["question"]))
    flips = grade_flip_rows(base["grades"], candidate["grades"])
    flips = flips[flips["question_id"].isin(both["question_id"])]  # another question's documents graded otherwise
    flip_rows = [
        {
            "question": questions.get(f.question_id, f.question_id),
            "source": f.source,
            "title": f.title,
            "parent_id": f.parent_id,
            "grade_base": f.grade_base,
            "grade_candidate": f.grade_candidate,
            "relevance_base": _nullable(f.relevance_base),
            "relevance_candidate": _nullable(f.relevance_candidate),
        }
        for f in flips.head(_FLIPS_SHOWN).itertuples(index=False)
    ]

    routes = sorted(set(base["answers"]["route"]) | set(candidate["answers"]["route"]))
    actions = sorted(set(base["answers"]["action"].dropna()) | set(candidate["answers"]["action"].dropna()))
    count = lambda frame, col, keys: {k: int((frame[col] == k).sum()) for k in keys}  # noqa: E731
    bins = np.linspace(0, 1, 11)
    relevance = lambda run: run["grades"]["relevance"].dropna().to_numpy()  # noqa: E731
    runs = (("base", base_id, base), ("candidate", cand_id, candidate))
    return (
        _environment()
        .get_template("compare_report.html.j2")
        .render(
            base_id=base_id,
            candidate_id=cand_id,
            summary=summary,
            config=None
            if config is None
            else {
                "headline": config_headline(config),
                "rows": [(key, *config_values(a, b, width=240)) for key, a, b in config.changes],
            },
            metrics=metrics,
            whole_runs=whole_runs,
            route_charts=[
                _chart(f"route — {rid}", count(run["answers"], "route", routes), kind) for kind, rid, run in runs
            ],
            action_charts=[
                _chart(f"action — {rid}", count(run["answers"], "action", actions), kind) for kind, rid, run in runs
            ],
            relevance_charts=[
                _chart(f"relevance — {rid}", _histogram(relevance(run), bins), kind) for kind, rid, run in runs
            ],
            changed=changed[:most_changed],
            more_changed=max(len(changed) - most_changed, 0),
            flips=flip_rows,
            more_flips=max(len(flips) - _FLIPS_SHOWN, 0),
        )
    )


def compare(
    warehouse,
    base_id: str,
    candidate_id: str,
    report: str | None,
    attach_report: bool = True,
    allow_unfinished: bool = False,
) -> tuple[pd.DataFrame, list[str], str]:
    """Read both runs from the Warehouse, write their comparison rows (replacing an earlier comparison
    of the same pair) and the HTML report; return the rows, the summary lines and the report's path.
    A run that has not succeeded (still running, or failed) is refused unless `allow_unfinished`.
    With `attach_report`, the report is also attached to the candidate's MLflow run, found with the
    tracking settings that run was logged with (its stored config), not with this command's."""

    for run_id in (base_id, candidate_id):
        check_run_id(run_id)  # before a path is made from them
    path = Path(report or f"compare_{base_id}_vs_{candidate_id}.html")
    _check_report_path(path, base_id, candidate_id)  # before both runs are read
    runs, records = {}, {}
    for run_id in (base_id, candidate_id):
        records[run_id] = run_record(warehouse, run_id, allow_unfinished, "compare")
        runs[run_id] = read_run(warehouse, run_id, ("answers", "grades", "gold", "metrics"))
    base, candidate = runs[base_id], runs[candidate_id]
    scores = None
    if not base["gold"].empty and not candidate["gold"].empty:
        scores = tuple(question_scores(r["answers"], r["grades"], r["gold"]) for r in (base, candidate))
    rows = compare_runs(base, candidate, base_id, candidate_id, scores)
    deltas, whole = metric_figures(rows, base, candidate)
    # question_changed and gold_changed are not columns of the table: there, a question asked
    # differently in the two runs shows as a row in both whose comparison columns are null
    stored = rows.assign(created_at=pd.Timestamp(datetime.now(UTC)))
    pair = (F.col("base_run") == F.lit(base_id)) & (F.col("candidate_run") == F.lit(candidate_id))
    warehouse.replace(
        "comparisons",
        warehouse.frame("comparisons", pa.Table.from_pandas(stored, schema=schema.COMPARISONS, preserve_index=False)),
        pair,
    )
    changes = config_difference(records[base_id], records[candidate_id])
    html = render_report(rows, deltas, base, candidate, question_scores=scores, whole=whole, config=changes)
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
    return rows, summary_lines(rows, deltas, whole, changes), str(path)


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
