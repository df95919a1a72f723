"""Threshold fitting without re-grading (`crag calibrate`): the relevance scores a run stored in its
grades table, against the run's gold labels, give the thresholds that would have routed best.

- routing thresholds (policy `thresholds`): each question's best internal relevance s. Predicted
  action: correct if s >= upper, incorrect if s < lower, else ambiguous. A question expected from the
  knowledge base should be `correct`, one expected from the web or from nowhere `incorrect`;
  `ambiguous` uses both sources, so it earns half credit. The proposal maximises that route accuracy;
  among equals it prefers the narrower ambiguous band.
- the grader's yes/no threshold: the relevance cut that maximises F1 of "yes" against gold_doc_ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd


@dataclass(frozen=True)
class RoutingProposal:
    lower: float
    upper: float
    accuracy: float  # ambiguous = half credit
    correct_precision: float  # of questions sent to `correct`, the share expected internal
    correct_recall: float  # of questions expected internal, the share sent to `correct`
    incorrect_precision: float
    incorrect_recall: float
    ambiguous_share: float
    n: int


def _candidates(values: np.ndarray, limit: int = 400) -> np.ndarray:
    """Cut points between the observed scores (midpoints), plus 0 and just above the maximum."""
    unique = np.unique(values)
    if len(unique) > limit:
        unique = np.unique(np.quantile(unique, np.linspace(0, 1, limit)))
    mids = (unique[:-1] + unique[1:]) / 2
    return np.unique(np.concatenate([[0.0], mids, [unique[-1] + 1e-6] if len(unique) else []]))


def routing_scores(best: np.ndarray, internal: np.ndarray, lower: float, upper: float) -> RoutingProposal:
    correct, incorrect = best >= upper, best < lower
    ambiguous = ~correct & ~incorrect
    external = ~internal
    credit = (correct & internal) + (incorrect & external) + 0.5 * ambiguous

    def ratio(a, b):
        return float(a.sum() / b.sum()) if b.sum() else float("nan")

    return RoutingProposal(
        lower=float(lower), upper=float(upper), accuracy=float(credit.mean()) if len(best) else float("nan"),
        correct_precision=ratio(correct & internal, correct), correct_recall=ratio(correct & internal, internal),
        incorrect_precision=ratio(incorrect & external, incorrect), incorrect_recall=ratio(incorrect & external, external),
        ambiguous_share=float(ambiguous.mean()) if len(best) else float("nan"), n=len(best),
    )


def propose_routing(best: np.ndarray, internal: np.ndarray) -> RoutingProposal:
    """Best (lower, upper) for the thresholds policy by exhaustive search over the cut points."""
    best, internal = np.asarray(best, float), np.asarray(internal, bool)
    cuts = _candidates(best)

    def below(values):  # how many of `values` are < each cut
        return np.searchsorted(np.sort(values), cuts, side="left")

    int_below, ext_below, all_below = below(best[internal]), below(best[~internal]), below(best)
    # credit(lower = cuts[i], upper = cuts[j]) for every pair, from prefix counts:
    #   internal sent to correct + external sent to incorrect + half of the ambiguous ones
    credit = (internal.sum() - int_below[None, :]) + ext_below[:, None] + 0.5 * (all_below[None, :] - all_below[:, None])
    lo, up = np.meshgrid(cuts, cuts, indexing="ij")
    score = np.where(lo <= up, credit, -1.0)
    ties = np.argwhere(score == score.max())
    # among the best: the narrowest ambiguous band, then the lowest upper
    i, j = min(ties, key=lambda ij: (up[tuple(ij)] - lo[tuple(ij)], up[tuple(ij)]))
    return routing_scores(best, internal, lo[i, j], up[i, j])


def propose_grade_threshold(relevance: np.ndarray, is_gold: np.ndarray) -> tuple[float, float, float, float]:
    """(threshold, precision, recall, F1) of "relevance >= threshold" against gold relevance."""
    relevance, is_gold = np.asarray(relevance, float), np.asarray(is_gold, bool)
    best = (0.5, 0.0, 0.0, -1.0)
    for t in _candidates(relevance):
        yes = relevance >= t
        tp = (yes & is_gold).sum()
        precision = tp / yes.sum() if yes.sum() else 0.0
        recall = tp / is_gold.sum() if is_gold.sum() else 0.0
        f = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        if f > best[3]:
            best = (float(t), float(precision), float(recall), float(f))
    return best


def question_best_relevance(grades: pd.DataFrame, gold: pd.DataFrame) -> pd.DataFrame:
    """question_id, best internal relevance (0 when nothing was retrieved), expected_route."""
    internal = grades[grades["source"] == "internal"].groupby("question_id")["relevance"].max()
    known = gold[gold["expected_route"].isin(["internal", "web", "none"])]
    return pd.DataFrame({
        "question_id": known["question_id"].values,
        "best": known["question_id"].map(internal).fillna(0.0).values,
        "expected_route": known["expected_route"].values,
    })


def calibrate(grades: pd.DataFrame, gold: pd.DataFrame, current_lower: float, current_upper: float) -> dict:
    from crag.evaluation import _as_list

    table = question_best_relevance(grades, gold)
    result: dict = {}
    if len(table):
        internal = (table["expected_route"] == "internal").to_numpy()
        result["routing"] = propose_routing(table["best"].to_numpy(), internal)
        result["routing_current"] = routing_scores(table["best"].to_numpy(), internal, current_lower, current_upper)
    gold_docs = gold.set_index("question_id")["gold_doc_ids"].map(lambda v: set(_as_list(v)))
    docs = grades[grades["question_id"].map(lambda q: bool(gold_docs.get(q)))]
    if len(docs):
        is_gold = [d in gold_docs[q] for q, d in zip(docs["question_id"], docs["doc_id"])]
        result["grade_threshold"] = propose_grade_threshold(docs["relevance"].to_numpy(), np.array(is_gold))
    return result


def report(result: dict) -> str:
    lines = []
    if "routing" in result:
        p, c = result["routing"], result["routing_current"]
        lines.append(f"routing thresholds over {p.n} questions with expected_route (ambiguous = half credit):")
        for name, r in (("current ", c), ("proposed", p)):
            lines.append(
                f"  {name} lower {r.lower:.3f} upper {r.upper:.3f}: route accuracy {r.accuracy:.3f}, "
                f"correct P/R {r.correct_precision:.3f}/{r.correct_recall:.3f}, "
                f"incorrect P/R {r.incorrect_precision:.3f}/{r.incorrect_recall:.3f}, ambiguous {r.ambiguous_share:.3f}"
            )
        lines.append(f"  use: --set routing.policy=thresholds --set routing.lower={p.lower:.3f} --set routing.upper={p.upper:.3f}")
    if "grade_threshold" in result:
        t, precision, recall, f = result["grade_threshold"]
        lines.append(f"grader yes/no threshold: {t:.3f} (precision {precision:.3f}, recall {recall:.3f}, F1 {f:.3f} against gold_doc_ids)")
        lines.append(f"  use: --set grader.threshold={t:.3f}")
    return "\n".join(lines) or "nothing to calibrate: the run has no expected_route or gold_doc_ids"
