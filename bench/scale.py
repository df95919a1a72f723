"""Embedded scale: 10,000 questions against a knowledge base of at least 50,000 chunks, built from the
shared corpora (SQuAD 2.0, JSQuAD, JaQuAD paragraphs; children of 100 characters sliding by 50), on
the machine's cores. The three corpora hold about 1.2 million characters, 23,000 such chunks; to reach
the size asked for they are indexed `--copies` times (3) as separate document sets. Reports index
build time, the job's wall time after Spark start-up and a Delta warm-up (crag/spark_warm.py; both
reported apart), and the peak memory of the whole process tree
(driver, JVM, Python workers) and of the Python driver alone, sampled every 0.2 s.

It measures the engine at scale (Spark, Delta commits, the driver's memory), so it runs the model-free
backends, `--variant lexical`, by default: the default's sentence encoders add their CPU time per
question (docs/quality.md), which `--variant base` (the default config) includes.

Run:  python -m bench.scale [--questions 10000] [--child-chars 100] [--child-overlap 50] [--variant lexical]
                            [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from bench.datasets import read_jsonl, require_dataset
from crag.spark_warm import warm_up

DATASETS = ("squad_v2", "jsquad", "jaquad")


def tree_rss(processes: list[tuple[int, int, str, int]]) -> int:
    """The RSS of a process tree, given (pid, ppid, name, rss) per process, each memory counted once.
    The JVM spawns helpers as it writes files (Hadoop's local file system runs chmod and readlink
    for each file): until such a child execs it shares the JVM's address space, and its RSS reads as
    the JVM's whole. A child of the JVM that is not a Python worker is therefore left out; otherwise
    a sample taken at that moment counts the JVM twice (seen here: sampled every 2 ms, 15 small Delta
    appends showed 38 such children reading 350-544 MB each; a 10k-question run's peak read 3.57 GB
    once and 2.81-2.86 GB in three other runs)."""
    names = {pid: name for pid, _, name, _ in processes}
    return sum(
        rss for _, ppid, name, rss in processes if not (names.get(ppid) == "java" and not name.startswith("python"))
    )


class PeakMemory:
    """Peak RSS of this process and all its descendants (`peak`, see tree_rss), and of this process
    alone, the Python driver (`driver_peak`)."""

    def __init__(self, interval: float = 0.2):
        self.interval, self.peak, self.driver_peak, self._stop = interval, 0, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        me = psutil.Process()
        while not self._stop.is_set():
            processes = []
            for p in [me, *me.children(recursive=True)]:
                try:
                    processes.append((p.pid, p.ppid(), p.name(), p.memory_info().rss))
                except psutil.Error:
                    pass
            self.peak = max(self.peak, tree_rss(processes))
            self.driver_peak = max(self.driver_peak, me.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def prepare(workdir: Path, n_questions: int, copies: int = 3) -> tuple[Path, Path, Path]:
    kb, web, questions = workdir / "kb.jsonl", workdir / "web.jsonl", workdir / "questions.jsonl"
    pool = []
    with kb.open("w", encoding="utf-8") as out:
        for name in DATASETS:
            path = require_dataset(name)
            corpus = read_jsonl(path / "corpus.jsonl")
            for copy in range(copies):
                for d in corpus:
                    out.write(
                        json.dumps(
                            {
                                "doc_id": f"{d['doc_id']}#{copy}",
                                "title": d["title"],
                                "text": f"{d['title']}\n{d['text']}",
                            },
                            ensure_ascii=False,
                        )
                        + "\n"
                    )
            pool += [q for q in read_jsonl(path / "questions.jsonl")]
    # The offline web collection: every third paragraph again, as a second, smaller collection.
    lines = kb.read_text(encoding="utf-8").splitlines()
    web.write_text("\n".join(lines[: len(lines) // copies : 3]) + "\n", encoding="utf-8")
    chosen = [pool[i % len(pool)] for i in range(n_questions)]
    questions.write_text(
        "\n".join(
            json.dumps({"question_id": f"s{i:06d}", "question": q["question"]}, ensure_ascii=False)
            for i, q in enumerate(chosen)
        )
        + "\n",
        encoding="utf-8",
    )
    return kb, web, questions


def run_scale(
    n_questions: int,
    child_chars: int,
    child_overlap: int,
    workdir: Path,
    spark=None,
    copies: int = 3,
    reuse_index: bool = False,
    overrides: list[str] | None = None,
    variant: str | None = "lexical",
) -> dict:
    """`overrides`: --set KEY=VALUE items for the run (not the index), e.g. an older commit's settings
    to time the same work on both. `variant`: conf/variants/NAME.yaml over conf/local.yaml (None: the
    default config)."""
    from bench.datasets import REPO
    from crag.config import load_config
    from crag.indexing import build_index
    from crag.job import run
    from crag.spark import get_spark

    kb, web, questions = prepare(workdir, n_questions, copies)
    sets = [f"indexing.child_chars={child_chars}", f"indexing.child_overlap={child_overlap}"]
    cfg = load_config(REPO / "conf" / "local.yaml", sets, variant)
    t0 = time.perf_counter()
    if reuse_index and (workdir / "kb_index" / "manifest.json").exists():
        kb_manifest = json.loads((workdir / "kb_index" / "manifest.json").read_text())
    else:
        kb_manifest = build_index(kb, workdir / "kb_index", cfg.indexing)
        build_index(web, workdir / "web_index", cfg.indexing)
    index_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    spark = spark or get_spark(cfg.spark)
    spark.range(1).count()
    startup_s = time.perf_counter() - t0
    warm_up_s = warm_up(spark, workdir / "warm_up")
    overrides = [
        *sets,
        f"retriever.index={workdir / 'kb_index'}",
        f"web_search.index={workdir / 'web_index'}",
        "cache.enabled=false",
        "mlflow.enabled=false",
        *(overrides or []),
    ]
    with PeakMemory() as memory:
        t0 = time.perf_counter()
        result = run(
            str(REPO / "conf" / "local.yaml"),
            str(questions),
            str(workdir / "warehouse"),
            variant=variant,
            run_id=f"scale-{n_questions}",
            overrides=overrides,
            spark=spark,
        )
        wall_s = time.perf_counter() - t0
    return {
        "questions": n_questions,
        "corpus_copies": copies,
        "kb_chunks": kb_manifest["n_chunks"],
        "kb_parents": kb_manifest["n_parents"],
        "index_build_s": round(index_s, 1),
        "spark_startup_s": round(startup_s, 1),
        "delta_warm_up_s": round(warm_up_s, 1),
        "wall_s_after_startup": round(wall_s, 1),
        "questions_per_s": round(n_questions / wall_s, 1),
        "peak_memory_gb": round(memory.peak / 2**30, 2),
        "driver_peak_rss_gb": round(memory.driver_peak / 2**30, 3),
        "answered": result.counts.accepted - result.counts.refused - result.counts.errors,
        "errors": result.counts.errors,
        "cores": psutil.cpu_count(),
        "variant": variant or "base",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--questions",
        default="10000",
        help="question counts, comma-separated (e.g. 10000,50000,100000): one run each, one session",
    )
    parser.add_argument("--child-chars", type=int, default=100)
    parser.add_argument("--child-overlap", type=int, default=50)
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--variant", default="lexical", help="conf/variants/NAME.yaml; base: the default config")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    args = parser.parse_args()
    variant = None if args.variant == "base" else args.variant
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, n in enumerate(int(x) for x in args.questions.split(",")):
            reports.append(
                run_scale(
                    n,
                    args.child_chars,
                    args.child_overlap,
                    Path(tmp),
                    copies=args.copies,
                    reuse_index=i > 0,
                    overrides=args.overrides,
                    variant=variant,
                )
            )
            print(json.dumps(reports[-1]), flush=True)
    if len(reports) > 1:
        first, last = reports[0], reports[-1]
        print(
            json.dumps(
                {
                    "driver_rss_growth": round(last["driver_peak_rss_gb"] / first["driver_peak_rss_gb"] - 1, 3),
                    "time_ratio": round(last["wall_s_after_startup"] / first["wall_s_after_startup"], 2),
                    "questions_ratio": round(last["questions"] / first["questions"], 1),
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    sys.exit(main())
