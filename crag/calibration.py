"""Threshold fitting without re-grading (`crag calibrate`): the relevance scores a run stored in its
grades table, against the run's gold labels, give the thresholds that would have routed best.

- routing thresholds (policy `thresholds`): each question's best internal relevance s. Predicted
  action: correct if s >= upper, incorrect if s < lower, else ambiguous. A question expected from the
  knowledge base should be `correct`, one expected from the web or from nowhere `incorrect`;
  `ambiguous` uses both sources, so it earns half credit. The proposal maximises that route accuracy;
  among equals it prefers the narrower ambiguous band.
- the grader's yes/no threshold: the relevance cut that maximises F1 of "yes" against gold_doc_ids.
- the semantic grader's weights, per language: when the run was graded by it, a logistic regression of
  "the document is gold" on its lexical relevance and cosine (both kept in each grade's rationale).
  The routing and yes/no thresholds are then proposed on the relevance the fitted weights give, so
  one `crag calibrate` yields a complete, consistent configuration.
- the lexical grader's exponents, per language: when the run was graded by it (score and language
  kept in each grade's rationale), each language's best single cut c between knowledge-base and web
  questions on the score, and the exponent that moves c onto the grader's threshold t
  (c ** exponent = t). The thresholds are then proposed on the relevance those exponents give.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from crag.backends.lexical import RATIONALE as LEXICAL_RATIONALE
from crag.backends.semantic import RATIONALE as SEMANTIC_RATIONALE
from crag.evaluation import _as_list


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


def shortest_cut(cut: float, values: np.ndarray) -> float:
    """The shortest decimal near `cut` that splits `values` as `cut` does (each at or above it, or
    below it, alike), so that the value printed is the one whose figures are reported: relevance is
    stored with 4 decimals and a cut falls between two of them, where 3 printed decimals could land on
    the wrong side of a score."""
    values = np.asarray(values, float)
    below, above = values[values < cut], values[values >= cut]
    low = below.max() if len(below) else -np.inf
    high = above.min() if len(above) else np.inf
    for decimals in range(1, 16):
        short = round(float(cut), decimals)
        if low < short <= high:
            return short
    return float(cut)


def routing_scores(best: np.ndarray, internal: np.ndarray, lower: float, upper: float) -> RoutingProposal:
    correct, incorrect = best >= upper, best < lower
    ambiguous = ~correct & ~incorrect
    external = ~internal
    credit = (correct & internal) + (incorrect & external) + 0.5 * ambiguous

    def ratio(a, b):
        return float(a.sum() / b.sum()) if b.sum() else float("nan")

    return RoutingProposal(
        lower=float(lower),
        upper=float(upper),
        accuracy=float(credit.mean()) if len(best) else float("nan"),
        correct_precision=ratio(correct & internal, correct),
        correct_recall=ratio(correct & internal, internal),
        incorrect_precision=ratio(incorrect & external, incorrect),
        incorrect_recall=ratio(incorrect & external, external),
        ambiguous_share=float(ambiguous.mean()) if len(best) else float("nan"),
        n=len(best),
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
    credit = (
        (internal.sum() - int_below[None, :]) + ext_below[:, None] + 0.5 * (all_below[None, :] - all_below[:, None])
    )
    lo, up = np.meshgrid(cuts, cuts, indexing="ij")
    score = np.where(lo <= up, credit, -1.0)
    ties = np.argwhere(score == score.max())
    # among the best: the narrowest ambiguous band, then the lowest upper
    i, j = min(ties, key=lambda ij: (up[tuple(ij)] - lo[tuple(ij)], up[tuple(ij)]))
    return routing_scores(best, internal, shortest_cut(lo[i, j], best), shortest_cut(up[i, j], best))


def grade_threshold_scores(
    relevance: np.ndarray, is_gold: np.ndarray, threshold: float, always_yes: np.ndarray | None = None
) -> tuple[float, float, float, float]:
    """(threshold, precision, recall, F1) of "relevance >= threshold" against gold relevance;
    `always_yes`: documents the grader calls relevant by another rule, whatever the threshold."""
    relevance, is_gold = np.asarray(relevance, float), np.asarray(is_gold, bool)
    yes = relevance >= threshold
    if always_yes is not None:
        yes = yes | np.asarray(always_yes, bool)
    tp = (yes & is_gold).sum()
    precision = tp / yes.sum() if yes.sum() else 0.0
    recall = tp / is_gold.sum() if is_gold.sum() else 0.0
    f = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return float(threshold), float(precision), float(recall), float(f)


def propose_grade_threshold(
    relevance: np.ndarray, is_gold: np.ndarray, always_yes: np.ndarray | None = None
) -> tuple[float, float, float, float]:
    """The (threshold, precision, recall, F1) with the best F1 of "relevance >= threshold" (or
    `always_yes`, see grade_threshold_scores)."""
    relevance = np.asarray(relevance, float)
    best = (0.5, 0.0, 0.0, -1.0)
    for t in _candidates(relevance):
        scores = grade_threshold_scores(relevance, is_gold, shortest_cut(t, relevance), always_yes)
        if scores[3] > best[3]:
            best = scores
    return best


def fit_logistic(features: np.ndarray, target: np.ndarray, ridge: float = 1e-3, steps: int = 50) -> np.ndarray:
    """Weights (bias first) of a logistic regression by Newton's method, with a small L2 penalty on
    the non-bias weights so that separable data still converges."""
    x = np.column_stack([np.ones(len(features)), features])
    w = np.zeros(x.shape[1])
    penalty = ridge * np.eye(x.shape[1])
    penalty[0, 0] = 0.0
    for _ in range(steps):
        p = 1 / (1 + np.exp(-(x @ w)))
        gradient = x.T @ (p - target) + penalty @ w
        hessian = (x * (p * (1 - p))[:, None]).T @ x + penalty
        step = np.linalg.solve(hessian + 1e-9 * np.eye(len(w)), gradient)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w


def semantic_features(grades: pd.DataFrame) -> pd.DataFrame | None:
    """lexical, cosine and language of each grade written by the semantic grader (None if none was)."""
    parsed = grades["rationale"].fillna("").str.extract(SEMANTIC_RATIONALE)
    if parsed["lexical"].isna().all():
        return None
    keep = parsed["lexical"].notna()
    return grades[keep].assign(
        lexical=parsed.loc[keep, "lexical"].astype(float),
        cosine=parsed.loc[keep, "cosine"].astype(float),
        language=parsed.loc[keep, "language"],
    )


def refit_semantic(grades: pd.DataFrame, gold_docs: pd.Series) -> tuple[dict[str, dict], pd.DataFrame] | None:
    """Per-language weights fitted against gold documents, and the grades with `relevance` recomputed
    from them. None when the run was not graded by the semantic grader."""
    features = semantic_features(grades)
    if features is None:
        return None
    features = features[features["question_id"].map(lambda q: bool(gold_docs.get(q)))]
    is_gold = np.array([d in gold_docs[q] for q, d in zip(features["question_id"], features["doc_id"])], bool)
    weights: dict[str, dict] = {}
    relevance = pd.Series(np.nan, index=features.index)
    for lang, part in features.groupby("language"):
        target = is_gold[features.index.get_indexer(part.index)]
        if target.all() or not target.any():
            continue  # nothing to tell apart
        # rounded as printed, and the relevance computed from the rounded weights: the thresholds
        # proposed on it are then the ones `--set` with the printed weights gives
        bias, lexical, semantic = (
            round(float(w), 3) for w in fit_logistic(part[["lexical", "cosine"]].to_numpy(), target.astype(float))
        )
        weights[lang] = {"lexical": lexical, "semantic": semantic, "bias": bias, "n": len(part)}
        relevance[part.index] = 1 / (1 + np.exp(-(bias + lexical * part["lexical"] + semantic * part["cosine"])))
    refitted = grades.copy()
    refitted.loc[relevance.dropna().index, "relevance"] = relevance.dropna().round(4)
    return weights, refitted


def best_cut(best: np.ndarray, internal: np.ndarray) -> tuple[float, float]:
    """(cut, route accuracy) of the best single cut: correct at or above it, incorrect below (the
    thresholds policy with lower = upper); among equals, the lowest."""
    best, internal = np.asarray(best, float), np.asarray(internal, bool)
    cuts = _candidates(best)
    accuracy = np.array([((best >= c) == internal).mean() for c in cuts])
    i = int(np.argmax(accuracy))
    return float(cuts[i]), float(accuracy[i])


def refit_lexical(
    grades: pd.DataFrame, gold: pd.DataFrame, threshold: float
) -> tuple[dict[str, dict], pd.DataFrame] | None:
    """Per-language exponents that put each language's best cut on `threshold`, and the grades with
    `relevance` recomputed from them. None when the run was not graded by the lexical grader."""
    parsed = grades["rationale"].fillna("").str.extract(LEXICAL_RATIONALE)
    if parsed["score"].isna().all() or not 0 < threshold < 1:
        return None
    keep = parsed["score"].notna()
    features = grades[keep].assign(score=parsed.loc[keep, "score"].astype(float), language=parsed.loc[keep, "language"])
    exponents: dict[str, dict] = {}
    refitted = grades.copy()
    for lang, part in features.groupby("language"):
        internal_docs = part[part["source"] == "internal"]
        table = question_best_relevance(internal_docs.assign(relevance=internal_docs["score"]), gold)
        table = table[
            table["question_id"].isin(part["question_id"]) & table["expected_route"].isin(["internal", "web"])
        ]
        expected_internal = (table["expected_route"] == "internal").to_numpy()
        if expected_internal.all() or not expected_internal.any():
            continue  # nothing to tell apart
        cut, accuracy = best_cut(table["best"].to_numpy(), expected_internal)
        if not 0 < cut < 1:
            continue  # every question on one side: no exponent moves that cut
        exponent = float(np.log(threshold) / np.log(cut))
        exponents[lang] = {"exponent": round(exponent, 3), "cut": round(cut, 4), "accuracy": accuracy, "n": len(table)}
        refitted.loc[part.index, "relevance"] = (part["score"] ** round(exponent, 3)).round(4)
    return exponents, refitted


def question_best_relevance(grades: pd.DataFrame, gold: pd.DataFrame) -> pd.DataFrame:
    """question_id, best internal relevance (0 when nothing was retrieved), expected_route."""
    internal = grades[grades["source"] == "internal"].groupby("question_id")["relevance"].max()
    known = gold[gold["expected_route"].isin(["internal", "web", "none"])]
    return pd.DataFrame(
        {
            "question_id": known["question_id"].values,
            "best": known["question_id"].map(internal).fillna(0.0).values,
            "expected_route": known["expected_route"].values,
        }
    )


def _web_rule_yes(grades: pd.DataFrame, threshold: float | None) -> np.ndarray | None:
    """Web results the run's grader called relevant below its threshold: by its web_threshold rule
    (crag.backends.lexical.is_relevant), which does not depend on the threshold and needs what the
    grades do not store (how many question terms matched), so the run's own yes stands for it. For a
    proposed threshold above the run's, a web result between the two counts as no, though the rule
    might keep it: the proposal's recall can be a little low there."""
    if threshold is None or not {"source", "grade"} <= set(grades.columns):
        return None
    return ((grades["source"] == "web") & (grades["grade"] == "yes") & (grades["relevance"] < threshold)).to_numpy()


def calibrate(
    grades: pd.DataFrame,
    gold: pd.DataFrame,
    current_lower: float,
    current_upper: float,
    current_threshold: float | None = None,
    current_policy: str = "thresholds",
    binary_grader: bool = False,
) -> dict:
    """Proposed thresholds, each with the figures of the run's own setting next to it. The current
    grader threshold is scored on the relevance the run stored (its own weights, if semantic). A
    binary grader's relevance is its yes (1) or no (0): there is no threshold to fit, only its grades
    to score."""
    result: dict = {"routing_policy": current_policy}
    gold_docs = gold.set_index("question_id")["gold_doc_ids"].map(lambda v: set(_as_list(v)))

    def propose(relevance_from: pd.DataFrame) -> dict:
        return _proposals(
            relevance_from, grades, gold, gold_docs, current_lower, current_upper, current_threshold, binary_grader
        )

    refit = refit_semantic(grades, gold_docs)
    if refit is not None:
        result["semantic"], refitted = refit
        return result | propose(refitted)
    lexical = refit_lexical(grades, gold, current_threshold) if current_threshold is not None else None
    if lexical is None or not lexical[0]:
        return result | propose(grades)
    proposals = propose(lexical[1])
    if not _worse_than_current(proposals):
        return result | {"lexical": lexical[0]} | proposals
    # The exponents are fitted to the routing cut of each language they can fit (one with too few
    # questions keeps its own): the thresholds fitted over them can score below the current settings,
    # and then the run's own relevance is the better ground
    return result | {"lexical_dropped": sorted(lexical[0])} | propose(grades)


def _proposals(
    grades: pd.DataFrame,
    stored: pd.DataFrame,
    gold: pd.DataFrame,
    gold_docs: pd.Series,
    current_lower: float,
    current_upper: float,
    current_threshold: float | None,
    binary_grader: bool = False,
) -> dict:
    """The proposed routing thresholds and grader threshold on `grades`' relevance, and the current
    settings scored on the relevance the run stored."""
    result: dict = {}
    table = question_best_relevance(grades, gold)
    if len(table):
        internal = (table["expected_route"] == "internal").to_numpy()
        result["routing"] = propose_routing(table["best"].to_numpy(), internal)
        stored_best = question_best_relevance(stored, gold)["best"].to_numpy()  # same questions, in the same order
        result["routing_current"] = routing_scores(stored_best, internal, current_lower, current_upper)
    docs = grades[grades["question_id"].map(lambda q: bool(gold_docs.get(q)))]
    if len(docs):
        is_gold = [d in gold_docs[q] for q, d in zip(docs["question_id"], docs["doc_id"])]
        if binary_grader:
            result["grade_binary"] = grade_threshold_scores(docs["relevance"].to_numpy(), np.array(is_gold), 0.5)
            return result
        web_rule = _web_rule_yes(stored.loc[docs.index], current_threshold)
        result["grade_threshold"] = propose_grade_threshold(docs["relevance"].to_numpy(), np.array(is_gold), web_rule)
        if current_threshold is not None:
            stored_relevance = stored.loc[docs.index, "relevance"].to_numpy()
            result["grade_threshold_current"] = grade_threshold_scores(
                stored_relevance, np.array(is_gold), current_threshold, web_rule
            )
    return result


def _worse_than_current(proposals: dict) -> bool:
    """A proposed routing (accuracy) or grader threshold (F1) that scores below the current one."""
    routing = proposals.get("routing"), proposals.get("routing_current")
    grading = proposals.get("grade_threshold"), proposals.get("grade_threshold_current")
    return bool(
        (routing[0] is not None and routing[1] is not None and routing[0].accuracy < routing[1].accuracy)
        or (grading[0] is not None and grading[1] is not None and grading[0][3] < grading[1][3])
    )


def _setting(value: float) -> str:
    """A threshold as printed: three decimals, or as many as it takes to give the value itself (a
    proposed cut between 0.4981 and 0.4989 is 0.4985, and 0.498 would put 0.4981 above it)."""
    text = f"{value:.3f}"
    return text if float(text) == value else repr(float(value))


def report(result: dict) -> str:
    lines = []
    # with refitted weights, the run's own settings are scored on the relevance its own weights gave
    current = "current (the run's weights)" if result.get("semantic") or result.get("lexical") else "current "
    if result.get("semantic"):
        lines.append(
            "semantic grader weights per language (logistic fit against gold_doc_ids); the thresholds below "
            "assume them:"
        )
        for lang, w in sorted(result["semantic"].items()):
            lines.append(
                f"  {lang}: lexical {w['lexical']}, semantic {w['semantic']}, bias {w['bias']} ({w['n']} documents)"
            )
            lines.append(
                "  use: "
                + " ".join(f"--set grader.languages.{lang}.{k}={w[k]}" for k in ("lexical", "semantic", "bias"))
            )
    if result.get("lexical_dropped"):
        lines.append(
            f"lexical grader exponents: a refit ({', '.join(result['lexical_dropped'])}) was tried and dropped, since "
            "the thresholds fitted over it scored below the current settings; the thresholds below keep the "
            "run's exponents"
        )
    if result.get("lexical"):
        lines.append(
            "lexical grader exponents per language (each language's best cut on the score moved onto the "
            "grader threshold); the thresholds below assume them:"
        )
        for lang, e in sorted(result["lexical"].items()):
            lines.append(
                f"  {lang}: best cut {e['cut']} (route accuracy {e['accuracy']:.3f} over {e['n']} questions) "
                f"-> exponent {e['exponent']}"
            )
        lines.append(
            "  use: "
            + " ".join(f"--set grader.exponents.{k}={e['exponent']}" for k, e in sorted(result["lexical"].items()))
        )
    if "routing" in result:
        p, c = result["routing"], result["routing_current"]
        lines.append(f"routing thresholds over {p.n} questions with expected_route (ambiguous = half credit):")
        for name, r in ((current, c), ("proposed", p)):
            lines.append(
                f"  {name} lower {_setting(r.lower)} upper {_setting(r.upper)}: route accuracy {r.accuracy:.3f}, "
                f"correct P/R {r.correct_precision:.3f}/{r.correct_recall:.3f}, "
                f"incorrect P/R {r.incorrect_precision:.3f}/{r.incorrect_recall:.3f}, ambiguous {r.ambiguous_share:.3f}"
            )
        if result.get("routing_policy", "thresholds") != "thresholds":
            lines.append(
                f"  (the run routed by policy {result['routing_policy']}: its lower and upper were set but not used)"
            )
        if p.lower == p.upper:
            lines.append(
                f"  proposed lower = upper: no ambiguous band. Every question is either internal (best relevance >= "
                f"{_setting(p.upper)}: answered from the knowledge base alone) or web (below it: answered from a web search)"
            )
        lines.append(
            f"  use: --set routing.policy=thresholds --set routing.lower={_setting(p.lower)} "
            f"--set routing.upper={_setting(p.upper)}"
        )
    if "grade_binary" in result:
        _, precision, recall, f = result["grade_binary"]
        lines.append(
            f"grader: answers yes or no (format binary), so there is no threshold to fit; its grades against "
            f"gold_doc_ids: precision {precision:.3f}, recall {recall:.3f}, F1 {f:.3f} "
            "(format score gives a 0-5 score that a threshold can be fitted on)"
        )
    if "grade_threshold" in result:
        lines.append("grader yes/no threshold, against gold_doc_ids:")
        named = [(current, result.get("grade_threshold_current")), ("proposed", result["grade_threshold"])]
        for name, scores in named:
            if scores is not None:
                t, precision, recall, f = scores
                lines.append(f"  {name} {_setting(t)}: precision {precision:.3f}, recall {recall:.3f}, F1 {f:.3f}")
        lines.append(f"  use: --set grader.threshold={_setting(result['grade_threshold'][0])}")
    return "\n".join(lines) or "nothing to calibrate: the run has no expected_route or gold_doc_ids"
