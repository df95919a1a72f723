"""Threshold fitting without re-grading (`crag calibrate`): the relevance scores a run stored in its
grades table, against the run's gold labels, give the thresholds that would have routed best.

- routing thresholds (policy `thresholds`): each question's best internal relevance s. Predicted
  action: correct if s >= upper, incorrect if s < lower, else ambiguous. A question expected from the
  knowledge base should be `correct`, one expected from the web or from nowhere `incorrect`;
  `ambiguous` uses both sources, so it earns half credit. The proposal maximises that route accuracy;
  among equals it prefers the narrower ambiguous band.
- the grader's yes/no threshold: the relevance cut that maximises F1 of "yes" against gold_doc_ids.
- the semantic grader's weights, per language: when the run was graded by it, a logistic regression of
  "the document is gold" on its lexical relevance and cosine (both kept in each grade's rationale);
  then, where the run has questions of both routes, its question-level best_cosine term: a logistic
  regression of "the question is expected from the knowledge base" on its best knowledge-base
  document's logit (those weights, without the term) and its best knowledge-base cosine, folded into
  the documents' logits (best_cosine, best_cosine_center; docs/quality.md).
  The routing and yes/no thresholds are then proposed on the relevance the fitted weights give, so
  one `crag calibrate` yields a complete, consistent configuration.
- the lexical grader's exponents, per language: when the run was graded by it (score and language
  kept in each grade's rationale), each language's best single cut c between knowledge-base and web
  questions on the score, and the exponent that moves c onto the grader's threshold t
  (c ** exponent = t). The thresholds are then proposed on the relevance those exponents give.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from crag.backends.lexical import RATIONALE as LEXICAL_RATIONALE
from crag.backends.semantic import RATIONALE as SEMANTIC_RATIONALE
from crag.errors import InputError
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


def _weighted(values: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    return np.ones(len(values)) if weights is None else np.asarray(weights, float)


def routing_scores(
    best: np.ndarray, internal: np.ndarray, lower: float, upper: float, weights: np.ndarray | None = None
) -> RoutingProposal:
    """The figures of (lower, upper) over questions with their best internal relevance `best` and
    whether they are expected from the knowledge base; `weights`: how many questions each entry
    stands for (crag calibrate receives counts per value, not questions)."""
    best, internal = np.asarray(best, float), np.asarray(internal, bool)
    w = _weighted(best, weights)
    correct, incorrect = best >= upper, best < lower
    ambiguous = ~correct & ~incorrect
    external = ~internal
    credit = (correct & internal) + (incorrect & external) + 0.5 * ambiguous
    total = w.sum()

    def ratio(a, b):
        return float((w * a).sum() / (w * b).sum()) if (w * b).sum() else float("nan")

    return RoutingProposal(
        lower=float(lower),
        upper=float(upper),
        accuracy=float((w * credit).sum() / total) if total else float("nan"),
        correct_precision=ratio(correct & internal, correct),
        correct_recall=ratio(correct & internal, internal),
        incorrect_precision=ratio(incorrect & external, incorrect),
        incorrect_recall=ratio(incorrect & external, external),
        ambiguous_share=float((w * ambiguous).sum() / total) if total else float("nan"),
        n=int(round(total)),
    )


def propose_routing(best: np.ndarray, internal: np.ndarray, weights: np.ndarray | None = None) -> RoutingProposal:
    """Best (lower, upper) for the thresholds policy by exhaustive search over the cut points."""
    best, internal = np.asarray(best, float), np.asarray(internal, bool)
    w = _weighted(best, weights)
    cuts = _candidates(best)

    def below(mask):  # the weight of the entries of `mask` that are < each cut
        order = np.argsort(best[mask], kind="stable")
        sums = np.concatenate([[0.0], np.cumsum(w[mask][order])])
        return sums[np.searchsorted(best[mask][order], cuts, side="left")]

    int_below, ext_below, all_below = below(internal), below(~internal), below(np.ones(len(best), bool))
    # credit(lower = cuts[i], upper = cuts[j]) for every pair, from prefix sums:
    #   internal sent to correct + external sent to incorrect + half of the ambiguous ones
    credit = (
        (w[internal].sum() - int_below[None, :]) + ext_below[:, None] + 0.5 * (all_below[None, :] - all_below[:, None])
    )
    lo, up = np.meshgrid(cuts, cuts, indexing="ij")
    score = np.where(lo <= up, credit, -1.0)
    ties = np.argwhere(np.isclose(score, score.max(), rtol=0, atol=1e-9))
    # among the best: the narrowest ambiguous band, then the lowest upper
    i, j = min(ties, key=lambda ij: (up[tuple(ij)] - lo[tuple(ij)], up[tuple(ij)]))
    return routing_scores(best, internal, shortest_cut(lo[i, j], best), shortest_cut(up[i, j], best), w)


def grade_threshold_scores(
    relevance: np.ndarray,
    is_gold: np.ndarray,
    threshold: float,
    always_yes: np.ndarray | None = None,
    weights: np.ndarray | None = None,
) -> tuple[float, float, float, float]:
    """(threshold, precision, recall, F1) of "relevance >= threshold" against gold relevance;
    `always_yes`: documents the grader calls relevant by another rule, whatever the threshold;
    `weights`: how many documents each entry stands for."""
    relevance, is_gold = np.asarray(relevance, float), np.asarray(is_gold, bool)
    w = _weighted(relevance, weights)
    yes = relevance >= threshold
    if always_yes is not None:
        yes = yes | np.asarray(always_yes, bool)
    tp = (w * (yes & is_gold)).sum()
    precision = tp / (w * yes).sum() if (w * yes).sum() else 0.0
    recall = tp / (w * is_gold).sum() if (w * is_gold).sum() else 0.0
    f = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return float(threshold), float(precision), float(recall), float(f)


def propose_grade_threshold(
    relevance: np.ndarray,
    is_gold: np.ndarray,
    always_yes: np.ndarray | None = None,
    weights: np.ndarray | None = None,
) -> tuple[float, float, float, float]:
    """The (threshold, precision, recall, F1) with the best F1 of "relevance >= threshold" (or
    `always_yes`, see grade_threshold_scores)."""
    relevance = np.asarray(relevance, float)
    best = (0.5, 0.0, 0.0, -1.0)
    for t in _candidates(relevance):
        scores = grade_threshold_scores(relevance, is_gold, shortest_cut(t, relevance), always_yes, weights)
        if scores[3] > best[3] + 1e-12:
            best = scores
    return best


def newton(moments, keys: Sequence, size: int = 3, ridge: float = 1e-3, steps: int = 50) -> dict:
    """Weights (bias first) of one logistic regression per key by Newton's method, with a small L2
    penalty on the non-bias weights so that separable data still converges. `moments(weights)`: for
    each key of `weights` (those not yet converged), the log-loss's gradient and Hessian at its weights,
    summed over its data (logistic_moments: wherever the data is). The regressions step together, so
    that data held elsewhere is read once a step for all of them."""
    w = {key: np.zeros(size) for key in keys}
    penalty = ridge * np.eye(size)
    penalty[0, 0] = 0.0
    open_keys = list(keys)
    for _ in range(steps):
        if not open_keys:
            break
        sums = moments({key: w[key] for key in open_keys})
        for key in list(open_keys):
            gradient, hessian = sums[key]
            step = np.linalg.solve(hessian + penalty + 1e-9 * np.eye(size), gradient + penalty @ w[key])
            w[key] = w[key] - step
            if np.abs(step).max() < 1e-8:
                open_keys.remove(key)
    return w


def logistic_moments(features: np.ndarray, target: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The log-loss's gradient and Hessian at `w` over these rows (sums: parts of the data add up)."""
    x = np.column_stack([np.ones(len(features)), features])
    p = 1 / (1 + np.exp(-(x @ w)))
    return x.T @ (p - target), (x * (p * (1 - p))[:, None]).T @ x


def fit_logistic(features: np.ndarray, target: np.ndarray, ridge: float = 1e-3, steps: int = 50) -> np.ndarray:
    """newton() over rows held here."""
    fitted = newton(lambda w: {0: logistic_moments(features, target, w[0])}, [0], features.shape[1] + 1, ridge, steps)
    return fitted[0]


def best_cut(best: np.ndarray, internal: np.ndarray, weights: np.ndarray | None = None) -> tuple[float, float]:
    """(cut, route accuracy) of the best single cut: correct at or above it, incorrect below (the
    thresholds policy with lower = upper); among equals, the lowest."""
    best, internal = np.asarray(best, float), np.asarray(internal, bool)
    w = _weighted(best, weights)
    cuts = _candidates(best)
    accuracy = np.array([(w * ((best >= c) == internal)).sum() / w.sum() for c in cuts])
    i = int(np.argmax(accuracy >= accuracy.max() - 1e-12))
    return float(cuts[i]), float(accuracy[i])


# ------------------------------------------------------------------ a run's graded documents, in parts
#
# What the proposals are computed from is counts and sums over a run's graded documents and its gold:
# each is made by a function of a part of them (the documents of some questions, every document of a
# question in the same part) and added up by an Aggregate: locally over one part (a run's frames), or
# in Spark over its partitions (crag calibrate), where the driver receives the sums and no row.

# A part's documents: one row per graded document of a question with gold (a question without any has
# one row of nulls), with the question's gold.
DOC_COLUMNS = ("question_id", "expected_route", "gold_doc_ids", "source", "doc_id", "relevance", "grade", "rationale")
Aggregate = Callable[[Callable[[pd.DataFrame], pd.DataFrame], Sequence[str], str], pd.DataFrame]
Relevance = Callable[[pd.DataFrame], pd.Series]  # a part's documents (parsed) -> their relevance


def docs_of(grades: pd.DataFrame, gold: pd.DataFrame) -> pd.DataFrame:
    """The documents of a run's frames as the parts hold them (documents not graded left out)."""
    graded = grades[grades["grade"].notna()] if "grade" in grades else grades
    columns = [c for c in DOC_COLUMNS[3:] if c in graded]
    return (
        gold[["question_id", "expected_route", "gold_doc_ids"]]
        .merge(graded[["question_id", *columns]], on="question_id", how="left")
        .reindex(columns=list(DOC_COLUMNS))
    )


def local_aggregate(docs: pd.DataFrame) -> Aggregate:
    """The Aggregate of documents held here: one part."""

    def aggregate(per_part, keys, spark_schema):
        out = per_part(docs)
        if not keys:
            return out.sum().to_frame().T
        return out.groupby(list(keys), as_index=False, dropna=False).sum() if len(out) else out

    return aggregate


def spark_aggregate(docs) -> Aggregate:
    """The Aggregate of a Spark DataFrame of documents (DOC_COLUMNS) partitioned by question: each
    partition's rows made by the part's function in the workers, summed by Spark; the driver receives
    the sums."""
    from pyspark.sql import functions as F  # noqa: PLC0415  # the pure functions above need no Spark

    def aggregate(per_part, keys, spark_schema):
        def apply(frames):
            frames = list(frames)  # the partition's batches: a question's documents may span two
            if frames:
                yield per_part(pd.concat(frames, ignore_index=True))

        out = docs.mapInPandas(apply, spark_schema)
        sums = [F.sum(name).alias(name) for name in out.columns if name not in keys]
        return (out.groupBy(*keys) if keys else out).agg(*sums).toPandas()

    return aggregate


def calibrate_run(warehouse, run_id: str, config: dict) -> dict:
    """`crag calibrate`: calibrate_documents over a run of the Warehouse in Spark, with the settings of
    its stored `config` as the current ones."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    gold = warehouse.load_run("gold", run_id).select("question_id", "expected_route", "gold_doc_ids")
    if not gold.limit(1).count():
        raise InputError(f"run {run_id!r} has no gold columns to calibrate against")
    graded = warehouse.load_run("grades", run_id).where(F.col("grade").isNotNull())  # not_graded: no grade to fit
    docs = gold.join(graded.select("question_id", *DOC_COLUMNS[3:]), "question_id", "left")
    routing, grader = config["routing"], config["grader"]
    from crag.spark import kept  # noqa: PLC0415

    # Kept between passes: the semantic grader's refit reads them once per Newton step.
    with kept(docs.select(*DOC_COLUMNS).repartition("question_id")) as parts:
        return calibrate_documents(
            spark_aggregate(parts),
            routing["lower"],
            routing["upper"],
            grader.get("threshold"),
            routing["policy"],
            grader.get("format") == "binary",
        )


def _parsed(docs: pd.DataFrame) -> pd.DataFrame:
    """A part's documents with what their rationale records: the semantic grader's lexical, cosine and
    language, the lexical grader's score and language (NaN / None where it records none)."""
    rationale = docs["rationale"].fillna("").astype(str)
    semantic = rationale.str.extract(SEMANTIC_RATIONALE)
    lexical = rationale.str.extract(LEXICAL_RATIONALE)
    gold_docs = docs["gold_doc_ids"].map(lambda v: set(_as_list(v)))
    return docs.assign(
        lexical=semantic["lexical"].astype(float),
        cosine=semantic["cosine"].astype(float),
        semantic_language=semantic["language"],
        from_web=docs["source"] == "web",
        score=lexical["score"].astype(float),
        score_language=lexical["language"],
        has_gold_docs=gold_docs.map(bool),
        is_gold=[d in g for d, g in zip(docs["doc_id"], gold_docs)],
    )


def stored_relevance(docs: pd.DataFrame) -> pd.Series:
    return docs["relevance"]


def _route_samples(docs: pd.DataFrame, relevance: pd.Series) -> pd.DataFrame:
    """Questions with an expected route by their best internal relevance (0 when none) and whether
    they are expected from the knowledge base: best, internal, n."""
    known = docs["expected_route"].isin(["internal", "web", "none"])
    internal_relevance = relevance.where(docs["source"] == "internal")[known]
    questions = docs[known].groupby("question_id", sort=False)
    table = pd.DataFrame(
        {
            "best": internal_relevance.groupby(docs.loc[known, "question_id"], sort=False).max().fillna(0.0),
            "internal": questions["expected_route"].first() == "internal",
        }
    )
    return table.groupby(["best", "internal"], as_index=False).size().rename(columns={"size": "n"})


def _doc_samples(docs: pd.DataFrame, relevance: pd.Series, threshold: float | None) -> pd.DataFrame:
    """The documents of questions with gold documents by relevance, whether gold, and whether the
    grader's web rule called them relevant below its threshold (_web_rule_yes): relevance, is_gold,
    web_yes, n."""
    keep = docs["has_gold_docs"] & docs["doc_id"].notna() & relevance.notna()
    table = pd.DataFrame(
        {
            "relevance": relevance[keep].astype(float),
            "is_gold": docs.loc[keep, "is_gold"].astype(bool),
            "web_yes": _web_rule_yes(docs[keep], threshold),
        }
    )
    return table.groupby(["relevance", "is_gold", "web_yes"], as_index=False).size().rename(columns={"size": "n"})


def _web_rule_yes(docs: pd.DataFrame, threshold: float | None) -> np.ndarray:
    """Web results the run's grader called relevant below its threshold: by its web_threshold rule
    (crag.backends.lexical.is_relevant), which does not depend on the threshold and needs what the
    grades do not store (how many question terms matched), so the run's own yes stands for it. For a
    proposed threshold above the run's, a web result between the two counts as no, though the rule
    might keep it: the proposal's recall can be a little low there. None of them without a threshold."""
    if threshold is None:
        return np.zeros(len(docs), bool)
    return ((docs["source"] == "web") & (docs["grade"] == "yes") & (docs["relevance"] < threshold)).to_numpy()


def _samples(aggregate: Aggregate, relevance: Relevance, threshold: float | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    routes = aggregate(
        lambda d: _route_samples(d, relevance(_parsed(d))),
        ("best", "internal"),
        "best double, internal boolean, n long",
    )
    docs = aggregate(
        lambda d: _doc_samples(_parsed(d), relevance(_parsed(d)), threshold),
        ("relevance", "is_gold", "web_yes"),
        "relevance double, is_gold boolean, web_yes boolean, n long",
    )
    return routes, docs


def _proposals(
    aggregate: Aggregate,
    relevance: Relevance,
    current_lower: float,
    current_upper: float,
    current_threshold: float | None,
    binary_grader: bool = False,
) -> dict:
    """The proposed routing thresholds and grader threshold on `relevance`, and the current settings
    scored on the relevance the run stored."""
    result: dict = {}
    routes, docs = _samples(aggregate, relevance, current_threshold)
    stored_routes, stored_docs = (
        (routes, docs) if relevance is stored_relevance else _samples(aggregate, stored_relevance, current_threshold)
    )
    if len(routes):
        result["routing"] = propose_routing(routes["best"], routes["internal"], routes["n"])
        result["routing_current"] = routing_scores(
            stored_routes["best"], stored_routes["internal"], current_lower, current_upper, stored_routes["n"]
        )
    if not len(docs):
        return result
    if binary_grader:
        result["grade_binary"] = grade_threshold_scores(docs["relevance"], docs["is_gold"], 0.5, weights=docs["n"])
        return result
    web_rule = docs["web_yes"] if current_threshold is not None else None
    result["grade_threshold"] = propose_grade_threshold(docs["relevance"], docs["is_gold"], web_rule, docs["n"])
    if current_threshold is not None:
        result["grade_threshold_current"] = grade_threshold_scores(
            stored_docs["relevance"],
            stored_docs["is_gold"],
            current_threshold,
            stored_docs["web_yes"],
            stored_docs["n"],
        )
    return result


def _semantic_counts(docs: pd.DataFrame) -> pd.DataFrame:
    """Documents the semantic grader graded (its rationale records their features), by language: n
    of questions with gold documents, gold of them, and any (every one of the part's)."""
    d = _parsed(docs)
    d = d[d["lexical"].notna()]
    counted = d.assign(n=d["has_gold_docs"].astype(int), gold=(d["has_gold_docs"] & d["is_gold"]).astype(int), any=1)
    return (
        counted.groupby("semantic_language", as_index=False)[["n", "gold", "any"]]
        .sum()
        .rename(columns={"semantic_language": "language"})
    )


def _moments_frame(parts: dict[str, tuple[np.ndarray, np.ndarray]], weights: dict[str, np.ndarray]) -> pd.DataFrame:
    """logistic_moments of each language's (features, target) at its `weights`: language, g0..g2 (the
    gradient), h00..h22 (the Hessian)."""
    rows = []
    for language, (features, target) in parts.items():
        g, h = logistic_moments(features, target, weights[language])
        rows.append(
            {
                "language": language,
                **{f"g{i}": g[i] for i in range(3)},
                **{f"h{i}{j}": h[i, j] for i in range(3) for j in range(3)},
            }
        )
    return pd.DataFrame(
        rows, columns=["language", *(f"g{i}" for i in range(3)), *(f"h{i}{j}" for i in range(3) for j in range(3))]
    )


def _moments_by_language(docs: pd.DataFrame, weights: dict[str, np.ndarray]) -> pd.DataFrame:
    """_moments_frame over each language's semantic features in questions with gold documents, against
    whether the document is gold."""
    d = _parsed(docs)
    d = d[d["lexical"].notna() & d["has_gold_docs"] & d["semantic_language"].isin(list(weights))]
    return _moments_frame(
        {
            language: (part[["lexical", "cosine"]].to_numpy(), part["is_gold"].to_numpy(float))
            for language, part in d.groupby("semantic_language")
        },
        weights,
    )


def _document_logit(d: pd.DataFrame, weights: dict[str, dict]) -> pd.Series:
    """Each parsed document's logit under its language's weights, without the question-level term (NaN
    for a language not in `weights`)."""
    language = d["semantic_language"]
    return (
        language.map({k: w["bias"] for k, w in weights.items()})
        + language.map({k: w["lexical"] for k, w in weights.items()}) * d["lexical"]
        + language.map({k: w["semantic"] for k, w in weights.items()}) * d["cosine"]
    )


def _questions(docs: pd.DataFrame, weights: dict[str, dict]) -> pd.DataFrame:
    """The questions with an expected route and knowledge-base documents graded by the semantic grader
    in a language of `weights`: language, internal (expected from the knowledge base), best_logit (the
    best such document's logit under those weights, no question-level term), best_cosine (the best
    cosine among them)."""
    d = _parsed(docs)
    d = d[
        d["lexical"].notna()
        & ~d["from_web"]
        & d["expected_route"].isin(["internal", "web", "none"])
        & d["semantic_language"].isin(list(weights))
    ]
    grouped = d.assign(logit=_document_logit(d, weights)).groupby("question_id", sort=False)
    return pd.DataFrame(
        {
            "language": grouped["semantic_language"].first(),
            "internal": grouped["expected_route"].first() == "internal",
            "best_logit": grouped["logit"].max(),
            "best_cosine": grouped["cosine"].max(),
        }
    )


def _route_counts(docs: pd.DataFrame, weights: dict[str, dict]) -> pd.DataFrame:
    q = _questions(docs, weights)
    return (
        q.assign(n=1, internal=q["internal"].astype(int)).groupby("language", as_index=False)[["n", "internal"]].sum()
    )


def _route_moments(docs: pd.DataFrame, doc_weights: dict[str, dict], weights: dict[str, np.ndarray]) -> pd.DataFrame:
    """_moments_frame over each language's questions (_questions), their best logit and best cosine
    against whether they are expected from the knowledge base."""
    q = _questions(docs, {k: v for k, v in doc_weights.items() if k in weights})
    return _moments_frame(
        {
            language: (part[["best_logit", "best_cosine"]].to_numpy(), part["internal"].to_numpy(float))
            for language, part in q.groupby("language")
        },
        weights,
    )


_MOMENTS_SCHEMA = "language string, " + ", ".join(
    [f"g{i} double" for i in range(3)] + [f"h{i}{j} double" for i in range(3) for j in range(3)]
)


def refit_semantic(aggregate: Aggregate) -> tuple[dict[str, dict], Relevance] | None:
    """Per-language weights fitted against gold documents, then each language's best_cosine term
    against the expected routes (Newton's method, each step's sums made where the documents are), and
    the relevance they give. None when the run was not graded by the semantic grader."""
    counts = aggregate(_semantic_counts, ("language",), "language string, n long, gold long, any long")
    if not len(counts) or not counts["any"].sum():
        return None
    languages = [r.language for r in counts.itertuples() if 0 < r.gold < r.n]  # else nothing to tell apart

    def moments(per_part) -> Callable[[dict[str, np.ndarray]], dict[str, tuple[np.ndarray, np.ndarray]]]:
        def at(by_language: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
            m = aggregate(lambda d: per_part(d, by_language), ("language",), _MOMENTS_SCHEMA)
            return {
                row["language"]: (
                    np.array([row[f"g{i}"] for i in range(3)]),
                    np.array([[row[f"h{i}{j}"] for j in range(3)] for i in range(3)]),
                )
                for _, row in m.iterrows()
            }

        return at

    weights: dict[str, dict] = {}
    for language, fitted in newton(moments(_moments_by_language), languages).items():
        # rounded as printed, and the relevance computed from the rounded weights: the thresholds
        # proposed on it are then the ones `--set` with the printed weights gives
        bias, lexical, semantic = (round(float(w), 3) for w in fitted)
        n = int(counts.set_index("language").loc[language, "n"])
        weights[language] = {
            "lexical": lexical,
            "semantic": semantic,
            "bias": bias,
            "n": n,
            "best_cosine": 0.0,
            "best_cosine_center": 0.0,
        }

    routes = aggregate(lambda d: _route_counts(d, weights), ("language",), "language string, n long, internal long")
    routed = [r.language for r in routes.itertuples() if 0 < r.internal < r.n]
    for language, (b0, b1, b2) in newton(moments(lambda d, by: _route_moments(d, weights, by)), routed).items():
        # P(internal) = sigmoid(b0 + b1 * best logit + b2 * best cosine): folded into every document's
        # logit, its 0.5 is where the best document's relevance crosses 0.5; a cosine that does not
        # help tell the routes apart (b2 <= 0; a language the model gives no vector) adds no term
        if b1 > 1e-3 and b2 > 1e-3:
            weights[language] |= {
                "best_cosine": round(float(b2 / b1), 3),
                "best_cosine_center": round(float(-b0 / b2), 3),
            }

    def relevance(d: pd.DataFrame) -> pd.Series:
        # every document the grader graded, in questions with gold documents or not: the routing
        # thresholds are proposed over questions of every expected route
        fitted = d["lexical"].notna() & d["semantic_language"].isin(list(weights))
        out = d["relevance"].astype(float).copy()
        # the best cosine among a question's knowledge-base documents, which the term reads
        best = d["cosine"].where(~d["from_web"]).groupby(d["question_id"]).transform("max")
        language = d["semantic_language"]
        term = language.map({k: w["best_cosine"] for k, w in weights.items()}) * (
            best - language.map({k: w["best_cosine_center"] for k, w in weights.items()})
        )
        z = _document_logit(d, weights) + term.where(~d["from_web"], 0.0)
        out[fitted] = (1 / (1 + np.exp(-z[fitted]))).round(4)
        return out

    return weights, relevance


def _lexical_samples(docs: pd.DataFrame) -> pd.DataFrame:
    """Per language the lexical grader graded in: the questions with documents of it and an expected
    route internal or web, by their best internal score (0 when none) and whether expected internal:
    language, best, internal, n."""
    d = _parsed(docs)
    expected = d.groupby("question_id")["expected_route"].first()
    expected = expected[expected.isin(["internal", "web"])]
    tables = []
    for language, part in d[d["score"].notna()].groupby("score_language"):
        internal = part[part["source"] == "internal"].groupby("question_id")["score"].max()
        asked = expected[expected.index.isin(part["question_id"])]
        tables.append(
            pd.DataFrame(
                {"language": language, "best": asked.index.map(internal).fillna(0.0), "internal": asked == "internal"}
            )
        )
    if not tables:
        return pd.DataFrame(columns=["language", "best", "internal", "n"])
    table = pd.concat(tables, ignore_index=True)
    return table.groupby(["language", "best", "internal"], as_index=False).size().rename(columns={"size": "n"})


def _scored(docs: pd.DataFrame) -> pd.DataFrame:
    d = _parsed(docs)
    return pd.DataFrame({"any": [int(d["score"].notna().sum())]})


def refit_lexical(aggregate: Aggregate, threshold: float) -> tuple[dict[str, dict], Relevance] | None:
    """Per-language exponents that put each language's best cut on `threshold`, and the relevance they
    give. None when the run was not graded by the lexical grader."""
    scored = aggregate(_scored, (), "any long")
    if not 0 < threshold < 1 or not len(scored) or not scored["any"].sum():
        return None
    samples = aggregate(
        _lexical_samples, ("language", "best", "internal"), "language string, best double, internal boolean, n long"
    )
    exponents: dict[str, dict] = {}
    for language, table in samples.groupby("language"):
        internal = table["internal"].to_numpy(bool)
        if internal.all() or not internal.any():
            continue  # nothing to tell apart
        cut, accuracy = best_cut(table["best"], internal, table["n"])
        if not 0 < cut < 1:
            continue  # every question on one side: no exponent moves that cut
        exponent = float(np.log(threshold) / np.log(cut))
        exponents[str(language)] = {
            "exponent": round(exponent, 3),
            "cut": round(cut, 4),
            "accuracy": accuracy,
            "n": int(table["n"].sum()),
        }

    def relevance(d: pd.DataFrame) -> pd.Series:
        out = d["relevance"].astype(float).copy()
        for language, e in exponents.items():
            rows = d["score"].notna() & (d["score_language"] == language)
            out[rows] = (d.loc[rows, "score"] ** e["exponent"]).round(4)
        return out

    return exponents, relevance


def calibrate(
    grades: pd.DataFrame,
    gold: pd.DataFrame,
    current_lower: float,
    current_upper: float,
    current_threshold: float | None = None,
    current_policy: str = "thresholds",
    binary_grader: bool = False,
) -> dict:
    """calibrate_documents over a run's grades and gold frames."""
    return calibrate_documents(
        local_aggregate(docs_of(grades, gold)),
        current_lower,
        current_upper,
        current_threshold,
        current_policy,
        binary_grader,
    )


def calibrate_documents(
    aggregate: Aggregate,
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
    settings = (current_lower, current_upper, current_threshold, binary_grader)
    refit = refit_semantic(aggregate)
    if refit is not None:
        result["semantic"], relevance = refit
        return result | _proposals(aggregate, relevance, *settings)
    lexical = refit_lexical(aggregate, current_threshold) if current_threshold is not None else None
    if lexical is None or not lexical[0]:
        return result | _proposals(aggregate, stored_relevance, *settings)
    proposals = _proposals(aggregate, lexical[1], *settings)
    if not _worse_than_current(proposals):
        return result | {"lexical": lexical[0]} | proposals
    # The exponents are fitted to the routing cut of each language they can fit (one with too few
    # questions keeps its own): the thresholds fitted over them can score below the current settings,
    # and then the run's own relevance is the better ground
    return result | {"lexical_dropped": sorted(lexical[0])} | _proposals(aggregate, stored_relevance, *settings)


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
            "semantic grader weights per language (logistic fits against gold_doc_ids, then best_cosine against "
            "the expected routes); the thresholds below assume them:"
        )
        keys = ("lexical", "semantic", "bias", "best_cosine", "best_cosine_center")
        for lang, w in sorted(result["semantic"].items()):
            term = (
                f"best_cosine {w['best_cosine']} from {w['best_cosine_center']}"
                if w["best_cosine"]
                else "no best_cosine term"
            )
            lines.append(
                f"  {lang}: lexical {w['lexical']}, semantic {w['semantic']}, bias {w['bias']}, {term} ({w['n']} documents)"
            )
            lines.append("  use: " + " ".join(f"--set grader.languages.{lang}.{k}={w[k]}" for k in keys))
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
