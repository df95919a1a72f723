"""Fault-injection scenario: the whole job with the production backends (Vector Search, model serving,
Tavily through their real clients) against the loopback emulators, a fraction of every endpoint's
calls failing: 429 with Retry-After, 500, hangs past the timeout, malformed model output.

Prints questions, faults injected by kind, retries, errors and rows lost (must be 0).
Run:  python -m bench.faults [--rate 0.2] [--questions data/sample/questions.jsonl]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from bench.datasets import REPO, read_jsonl, run_rows

SERVICES = ("serving", "vector_search", "tavily")


def run_scenario(
    rate: float,
    questions: str,
    workdir: Path,
    spark=None,
    hang_s: float = 2.0,
    seed: int = 0,
    max_attempts: int | None = None,
) -> dict:
    """Build the sample indexes, start the emulators with `rate` of faults on every endpoint (spread
    evenly over 429, 500, hang and malformed), run conf/databricks.yaml, and account for every row.
    `max_attempts`: attempts per call for every role (None: the config's)."""
    import pandas as pd

    from crag.config import load_config
    from crag.emulators import Emulator
    from crag.indexing import build_index
    from crag.job import run

    cfg = load_config(REPO / "conf" / "local.yaml")
    build_index(REPO / "data" / "sample" / "kb", workdir / "kb", cfg.indexing)
    build_index(REPO / "data" / "sample" / "web.jsonl", workdir / "web", cfg.indexing)
    token = "fault-token"
    with Emulator(str(workdir / "kb"), str(workdir / "web"), token=token, hang_s=hang_s, seed=seed) as emulator:
        for service in SERVICES:
            kinds = ("429", "500", "hang", "malformed") if service == "serving" else ("429", "500", "hang")
            emulator.behaviour[service].fault_rates = {k: rate / len(kinds) for k in kinds}
        # The driver's first open of the index gives a service that does not answer two short attempts
        # and ends the run (a wrong host fails in seconds: tests/slow/test_hardening_vector_search.py);
        # faults start after it. Each Spark task's open retries them as any call does.
        emulator.behaviour["vector_search"].scripted = ["ok"]
        os.environ.update(
            DATABRICKS_HOST=emulator.url, DATABRICKS_TOKEN=token, TAVILY_API_KEY=token, TAVILY_API_BASE_URL=emulator.url
        )
        fast = [
            f"{role}.policy.{key}"
            for role in ("retriever", "grader", "rewriter", "generator", "web_search")
            for key in (
                "timeout_s=1",
                "backoff_initial_s=0.05",
                "backoff_max_s=1",
                *([f"max_attempts={max_attempts}"] if max_attempts else []),
            )
        ]
        result = run(
            str(REPO / "conf" / "databricks.yaml"),
            questions,
            str(workdir / "warehouse"),
            run_id="faults",
            overrides=fast,
            spark=spark,
        )
        requests = len(emulator.requests)
        faults = dict(emulator.faults_injected)
    inputs = read_jsonl(Path(questions))
    answers = run_rows(result.warehouse, "answers", result.run_id)
    rejects = run_rows(result.warehouse, "rejects", result.run_id)
    unanswered = answers[answers["answer"].isna() & (answers["route"] != "error")]
    errors_without_text = answers[(answers["route"] == "error") & answers["error"].isna()]
    return {
        "questions": len(inputs),
        "accepted": len(answers),
        "rejected": len(rejects),
        "requests": requests,
        "faults_injected": faults,
        "retries": int(answers["retries"].sum()),
        "errors": int((answers["route"] == "error").sum()),
        "unreadable_grades": result.counts.grade_parse.get("failed", 0),
        "rows_lost": len(inputs) - len(answers) - len(rejects),
        "duplicates": int(answers["question_id"].duplicated().sum()),
        "unanswered_without_error": len(unanswered) + len(errors_without_text),
        "summary": result.summary(),
        "routes": pd.Series(answers["route"]).value_counts().to_dict(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=0.2, help="share of every endpoint's calls that fail")
    parser.add_argument("--questions", default=str(REPO / "data" / "sample" / "questions.jsonl"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = run_scenario(args.rate, args.questions, Path(tmp))
    print(report.pop("summary"))
    for key, value in report.items():
        print(f"{key:26s} {value}")


if __name__ == "__main__":
    sys.exit(main())
