"""CPU the stage chain itself costs per question, apart from any backend: `run_pipeline` and
`to_stage_output` over frames of 1, 2, 4 and 8 questions, with backends that answer at once.
This is the price of taking few questions at a time through the stages (spark.questions_per_pipeline).

Run:  python -m bench.stage_overhead [--questions 400] [--sizes 1 2 4 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import pandas as pd

from bench.datasets import REPO
from crag.backends import Backends
from crag.backends.base import Answer, Grade
from crag.config import load_config
from crag.spark import to_stage_output
from crag.stages import run_pipeline


def _doc(source: str, i: int) -> dict:
    return {
        "source": source,
        "doc_id": f"{source}{i}",
        "parent_id": f"{source}{i}",
        "title": "t",
        "url": None,
        "text": "a short passage of text",
        "retrieval_score": 1.0,
        "rank": i + 1,
    }


class _Instant:
    """Every role at once, answering without work: five documents, alternate grades, three web results."""

    name, prompt_hash, concurrency, policy_keywords = "instant", None, 16, []

    def search(self, queries, k, usages=None, *, question=None):
        if isinstance(queries, str):  # web search: one query (and the question it serves)
            return [_doc("web", i) for i in range(3)]
        return [[_doc("internal", i) for i in range(5)] for _ in queries]

    def grade(self, question, documents, usage):
        return [Grade(0.9, "yes") if i % 2 else Grade(0.1, "no") for i in range(len(documents))]

    def rewrite(self, question, usage):
        return question

    def generate(self, question, context, usage):
        return Answer("an answer", [0])


def cpu_ms_per_question(size: int, questions: int) -> float:
    cfg = load_config(REPO / "conf" / "databricks.yaml", [])
    instant = _Instant()
    backends = Backends(instant, instant, instant, instant, instant)
    frame = pd.DataFrame({"question_id": [f"q{i}" for i in range(size)], "question": ["what is it?"] * size})
    rounds = max(1, questions // size)
    t0 = time.process_time()
    for _ in range(rounds):
        staged = to_stage_output(run_pipeline(frame, backends, cfg))
    elapsed = time.process_time() - t0
    failed = [e for e in staged.column("error").to_pylist() if e]
    if failed:  # a question that fails skips the later stages: its time would measure less than the chain
        raise RuntimeError(f"the stage chain failed: {failed[0]}")
    return elapsed * 1000 / (rounds * size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=400)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    cpu_ms_per_question(1, 10)  # imports and first-call costs out of the figures
    report = {f"{size} per frame": round(cpu_ms_per_question(size, args.questions), 2) for size in args.sizes}
    print(json.dumps({"cpu_ms_per_question": report}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
