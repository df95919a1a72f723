"""`crag compare`: two runs (prompt variants, models, thresholds) side by side, question by question.

`compare_runs` is a pure function over the two runs' answers, grades and metrics: one row per
question in either run (schema.COMPARISONS) and the figures of the summary. `render_report` makes a
self-contained HTML page (inline CSS and SVG, no scripts or external files).
"""

from __future__ import annotations

import difflib
import html
from collections import Counter

import numpy as np
import pandas as pd

from crag.evaluation import is_cjk, normalize_answer


def answer_similarity(a: str | None, b: str | None) -> float:
    """Word-level similarity of two answers, 0..1 (difflib's ratio on their normalised words;
    characters for CJK text, which has no spaces)."""
    cjk = is_cjk(a or "") or is_cjk(b or "")
    wa, wb = ((list(normalize_answer(x or "")) if cjk else normalize_answer(x or "").split()) for x in (a, b))
    if not wa and not wb:
        return 1.0
    return difflib.SequenceMatcher(a=wa, b=wb, autojunk=False).ratio()


def _grade_flips(base: pd.DataFrame, candidate: pd.DataFrame) -> dict[str, list[str]]:
    """Per question, the documents (source:parent) graded in both runs whose grade differs."""
    key = ["question_id", "source", "parent_id"]
    merged = base[key + ["grade"]].merge(candidate[key + ["grade"]], on=key, suffixes=("_base", "_candidate"))
    flipped = merged[merged["grade_base"] != merged["grade_candidate"]]
    out: dict[str, list[str]] = {}
    for r in flipped.itertuples(index=False):
        out.setdefault(r.question_id, []).append(f"{r.source}:{r.parent_id} {r.grade_base}->{r.grade_candidate}")
    return out


def compare_runs(base: dict[str, pd.DataFrame], candidate: dict[str, pd.DataFrame], base_id: str, candidate_id: str,
                 question_scores: tuple[pd.DataFrame, pd.DataFrame] | None = None) -> pd.DataFrame:
    """One row per question in either run. `question_scores` (per-question metric values of each run,
    from crag.evaluation.question_scores) adds the metric deltas when gold exists."""
    a, b = base["answers"].set_index("question_id"), candidate["answers"].set_index("question_id")
    flips = _grade_flips(base["grades"], candidate["grades"])
    scores = [s.set_index("question_id") if s is not None and not s.empty else None for s in (question_scores or (None, None))]
    rows = []
    for qid in sorted(set(a.index) | set(b.index)):
        x = a.loc[qid] if qid in a.index else None
        y = b.loc[qid] if qid in b.index else None
        get = lambda r, c: (None if r is None else r[c])  # noqa: E731
        row = {
            "base_run": base_id, "candidate_run": candidate_id, "question_id": qid,
            "question": get(x, "question") if x is not None else get(y, "question"),
            "in_base": x is not None, "in_candidate": y is not None,
            "answer_base": get(x, "answer"), "answer_candidate": get(y, "answer"),
            "answer_changed": None, "answer_similarity": None,
            "action_base": get(x, "action"), "action_candidate": get(y, "action"),
            "route_base": get(x, "route"), "route_candidate": get(y, "route"),
            "action_flip": None, "route_flip": None,
            "n_relevant_base": get(x, "n_relevant"), "n_relevant_candidate": get(y, "n_relevant"), "n_relevant_delta": None,
            "grade_flips": flips.get(qid, []),
            "f1_delta": None, "answer_contained_delta": None, "routing_accuracy_delta": None,
        }
        if x is not None and y is not None:
            row["answer_changed"] = normalize_answer(x["answer"] or "") != normalize_answer(y["answer"] or "")
            row["answer_similarity"] = answer_similarity(x["answer"], y["answer"])
            row["action_flip"] = x["action"] != y["action"]
            row["route_flip"] = x["route"] != y["route"]
            row["n_relevant_delta"] = int(y["n_relevant"]) - int(x["n_relevant"])
            sa, sb = scores
            if sa is not None and sb is not None and qid in sa.index and qid in sb.index:
                for metric in ("f1", "answer_contained", "routing_accuracy"):
                    va, vb = sa.loc[qid, metric], sb.loc[qid, metric]
                    row[f"{metric}_delta"] = None if pd.isna(va) or pd.isna(vb) else float(vb - va)
        rows.append(row)
    return pd.DataFrame(rows)


def metric_deltas(base_metrics: pd.DataFrame, candidate_metrics: pd.DataFrame, slice_: str = "all") -> pd.DataFrame:
    """metric, base, candidate, delta, n_base, n_candidate for one slice."""
    if base_metrics.empty or candidate_metrics.empty:
        return pd.DataFrame(columns=["metric", "base", "candidate", "delta", "n_base", "n_candidate"])
    x = base_metrics[base_metrics["slice"] == slice_].set_index("metric")
    y = candidate_metrics[candidate_metrics["slice"] == slice_].set_index("metric")
    metrics = [m for m in x.index if m in y.index]
    return pd.DataFrame({
        "metric": metrics,
        "base": [x.loc[m, "value"] for m in metrics], "candidate": [y.loc[m, "value"] for m in metrics],
        "delta": [y.loc[m, "value"] - x.loc[m, "value"] for m in metrics],
        "n_base": [int(x.loc[m, "n"]) for m in metrics], "n_candidate": [int(y.loc[m, "n"]) for m in metrics],
    })


def summary_lines(rows: pd.DataFrame, deltas: pd.DataFrame) -> list[str]:
    both = rows[rows["in_base"] & rows["in_candidate"]]
    lines = [
        f"compare {rows['base_run'].iloc[0]} (base) -> {rows['candidate_run'].iloc[0]} (candidate): "
        f"{len(both)} questions in both, {int((~rows['in_candidate']).sum())} only in base, "
        f"{int((~rows['in_base']).sum())} only in candidate",
        f"  answers changed   {int(both['answer_changed'].sum())} (mean similarity {both['answer_similarity'].mean():.3f})",
        f"  route flips       {int(both['route_flip'].sum())}" + "".join(
            f", {a}->{b} {n}" for (a, b), n in sorted(Counter(zip(both.loc[both['route_flip'], 'route_base'],
                                                               both.loc[both['route_flip'], 'route_candidate'])).items())),
        f"  action flips      {int(both['action_flip'].sum())}",
        f"  grade flips       {int(both['grade_flips'].map(len).sum())} documents in {int((both['grade_flips'].map(len) > 0).sum())} questions",
    ]
    for r in deltas.itertuples(index=False):
        lines.append(f"  {r.metric:18s}{r.base:8.3f} -> {r.candidate:8.3f}  ({r.delta:+.3f}; n {r.n_base} / {r.n_candidate})")
    return lines


# ------------------------------------------------------------------ HTML report

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:1100px;color:#1f2328;padding:0 1rem}
h1{font-size:1.5rem}h2{font-size:1.15rem;margin-top:2rem;border-bottom:1px solid #d0d7de;padding-bottom:.3rem}
table{border-collapse:collapse;margin:.5rem 0}td,th{border:1px solid #d0d7de;padding:.3rem .6rem;text-align:left;vertical-align:top}
th{background:#f6f8fa}td.num{text-align:right;font-variant-numeric:tabular-nums}.pos{color:#1a7f37}.neg{color:#cf222e}
.bars{display:flex;gap:2rem;flex-wrap:wrap}del{background:#ffebe9;color:#82071e}ins{background:#dafbe1;color:#116329;text-decoration:none}
.muted{color:#656d76}.diff{max-width:700px}
"""


def _table(headers: list[str], rows: list[list], numeric: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(r)) + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _bar_chart(title: str, counts: dict[str, int], color: str, width: int = 380) -> str:
    """Horizontal bars as inline SVG."""
    total = max(sum(counts.values()), 1)
    top = max(counts.values(), default=1) or 1
    height = 22 * len(counts) + 28
    bars = []
    for i, (label, n) in enumerate(counts.items()):
        y = 24 + 22 * i
        w = int((width - 200) * n / top)
        bars.append(f'<text x="0" y="{y + 13}" font-size="12">{html.escape(str(label))}</text>'
                    f'<rect x="110" y="{y}" width="{w}" height="16" fill="{color}"/>'
                    f'<text x="{114 + w}" y="{y + 13}" font-size="12">{n} ({n / total:.0%})</text>')
    return (f'<svg width="{width}" height="{height}" role="img" aria-label="{html.escape(title)}">'
            f'<text x="0" y="14" font-size="13" font-weight="600">{html.escape(title)}</text>{"".join(bars)}</svg>')


def word_diff(a: str | None, b: str | None) -> str:
    """Word-level diff of two answers as HTML: removed words in <del>, added ones in <ins>. Japanese
    and other CJK text has no spaces between words, so it is compared character by character."""
    cjk = is_cjk(a or "") or is_cjk(b or "")
    sep = "" if cjk else " "
    wa, wb = (list(a or "") if cjk else (a or "").split()), (list(b or "") if cjk else (b or "").split())
    out = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=wa, b=wb, autojunk=False).get_opcodes():
        if op == "equal":
            out.append(html.escape(sep.join(wa[i1:i2])))
        if op in ("delete", "replace"):
            out.append(f"<del>{html.escape(sep.join(wa[i1:i2]))}</del>")
        if op in ("insert", "replace"):
            out.append(f"<ins>{html.escape(sep.join(wb[j1:j2]))}</ins>")
    return sep.join(out)


def _histogram(values: np.ndarray, bins: np.ndarray) -> dict[str, int]:
    counts, _ = np.histogram(values, bins=bins)
    return {f"{lo:.1f}-{hi:.1f}": int(c) for lo, hi, c in zip(bins[:-1], bins[1:], counts)}


def render_report(rows: pd.DataFrame, deltas: pd.DataFrame, base: dict[str, pd.DataFrame],
                  candidate: dict[str, pd.DataFrame], most_changed: int = 20) -> str:
    base_id, cand_id = rows["base_run"].iloc[0], rows["candidate_run"].iloc[0]
    both = rows[rows["in_base"] & rows["in_candidate"]]
    routes = sorted(set(base["answers"]["route"]) | set(candidate["answers"]["route"]))
    actions = sorted(set(base["answers"]["action"].dropna()) | set(candidate["answers"]["action"].dropna()))
    count = lambda frame, col, keys: {k: int((frame[col] == k).sum()) for k in keys}  # noqa: E731
    bins = np.linspace(0, 1, 11)
    relevance = lambda run: run["grades"]["relevance"].dropna().to_numpy()  # noqa: E731
    sections = [
        f"<h1>crag compare: {html.escape(base_id)} → {html.escape(cand_id)}</h1>",
        '<section id="summary"><h2>Summary</h2><pre>' + html.escape("\n".join(summary_lines(rows, deltas))) + "</pre></section>",
        '<section id="routes"><h2>Routes and actions</h2><div class="bars">'
        + _bar_chart(f"route — {base_id}", count(base["answers"], "route", routes), "#8c959f")
        + _bar_chart(f"route — {cand_id}", count(candidate["answers"], "route", routes), "#0969da")
        + "</div><div class=\"bars\">"
        + _bar_chart(f"action — {base_id}", count(base["answers"], "action", actions), "#8c959f")
        + _bar_chart(f"action — {cand_id}", count(candidate["answers"], "action", actions), "#0969da")
        + "</div></section>",
        '<section id="relevance"><h2>Relevance of graded documents</h2><div class="bars">'
        + _bar_chart(f"relevance — {base_id}", _histogram(relevance(base), bins), "#8c959f")
        + _bar_chart(f"relevance — {cand_id}", _histogram(relevance(candidate), bins), "#0969da")
        + "</div></section>",
    ]
    if not deltas.empty:
        def fmt(d):
            css = "pos" if d > 0 else "neg" if d < 0 else ""
            return f'<span class="{css}">{d:+.3f}</span>'

        sections.append('<section id="metrics"><h2>Metric deltas (slice all)</h2>' + _table(
            ["metric", base_id, cand_id, "delta", "n base", "n candidate"],
            [[html.escape(r.metric), f"{r.base:.3f}", f"{r.candidate:.3f}", fmt(r.delta), r.n_base, r.n_candidate]
             for r in deltas.itertuples(index=False)], numeric={1, 2, 3, 4, 5}) + "</section>")
    else:
        sections.append('<section id="metrics"><h2>Metric deltas</h2><p class="muted">No gold columns in these runs.</p></section>')
    changed = both[both["answer_changed"]].sort_values("answer_similarity").head(most_changed)
    sections.append('<section id="changed"><h2>Most changed answers</h2>' + (_table(
        ["question", "similarity", "route", "answer: base → candidate"],
        [[html.escape(str(r.question)), f"{r.answer_similarity:.2f}",
          html.escape(f"{r.route_base} → {r.route_candidate}"), f'<div class="diff">{word_diff(r.answer_base, r.answer_candidate)}</div>']
         for r in changed.itertuples(index=False)], numeric={1}) if len(changed) else '<p class="muted">No answer changed.</p>')
        + "</section>")
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>crag compare {html.escape(base_id)} vs '
            f'{html.escape(cand_id)}</title><style>{_CSS}</style></head><body>{"".join(sections)}</body></html>')


def compare(warehouse: str, base_id: str, candidate_id: str, report: str | None, backend: str = "delta_rs",
            spark=None, tracking=None) -> tuple[pd.DataFrame, list[str], str]:
    """Read both runs, write their comparison rows (replacing an earlier comparison of the same pair)
    and the HTML report; return the rows, the summary lines and the report's path."""
    from datetime import datetime, timezone
    from pathlib import Path

    import pyarrow as pa

    from crag import schema, tables
    from crag.errors import InputError
    from crag.evaluation import question_scores

    if report and Path(report).is_dir():  # checked first: not after both runs are read
        raise InputError(f"--report {report} is a folder: give the path of the HTML file to write, "
                         f"e.g. {Path(report) / f'compare_{base_id}_vs_{candidate_id}.html'}")
    runs = {}
    for run_id in (base_id, candidate_id):
        tables.check_run_id(run_id)
        parts = {name: tables.read_run_rows(warehouse, name, run_id, backend, spark)
                 for name in ("answers", "grades", "gold", "metrics")}
        if parts["answers"].empty:
            raise InputError(f"run {run_id!r} has no answers in {warehouse}")
        runs[run_id] = parts
    base, candidate = runs[base_id], runs[candidate_id]
    scores = None
    if not base["gold"].empty and not candidate["gold"].empty:
        scores = tuple(question_scores(r["answers"], r["grades"], r["gold"]) for r in (base, candidate))
    rows = compare_runs(base, candidate, base_id, candidate_id, scores)
    deltas = metric_deltas(base["metrics"], candidate["metrics"])
    stored = rows.assign(created_at=pd.Timestamp(datetime.now(timezone.utc)))
    predicate = f"base_run = '{base_id}' AND candidate_run = '{candidate_id}'"
    tables.replace_where(warehouse, "comparisons", pa.Table.from_pandas(stored, schema=schema.COMPARISONS, preserve_index=False),
                         predicate, backend, spark)
    path = Path(report or f"compare_{base_id}_vs_{candidate_id}.html")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(rows, deltas, base, candidate), encoding="utf-8")
    if tracking is not None:
        from crag.tracking import log_report

        log_report(tracking, warehouse, candidate_id, str(path))
    return rows, summary_lines(rows, deltas), str(path)
