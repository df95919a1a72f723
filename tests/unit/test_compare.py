"""crag.compare's pure functions: the comparison rows, the metric deltas and the summary lines."""

import pandas as pd

from crag.compare import metric_deltas
from crag.evaluation import METRICS


def test_metric_deltas_follow_crag_evals_order_not_the_stored_one():
    stored = ["grader_recall", "web_search_rate", "f1", "refused", "grader_precision", "exact_match"]
    metrics = pd.DataFrame({"metric": stored, "slice": "all", "value": 0.5, "n": 10})
    deltas = metric_deltas(metrics, metrics.iloc[::-1])
    assert deltas["metric"].tolist() == [m for m in METRICS if m in stored]
    assert deltas["metric"].tolist()[:2] == ["exact_match", "f1"] and deltas["metric"].iloc[-1] == "grader_recall"
