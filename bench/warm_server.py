"""The sample run's wall time as a user sees it, from the command to its exit: with a warm local Spark
(`crag spark start`) and without one (each command starts local Spark).

Starts a server in a CRAG_HOME of its own, runs `crag run` of the bundled sample into a new warehouse
`--runs` times (the first one loads the indexes into the server's Python workers, as a user's first
run does), stops the server, then runs the same command once more without it. Every run is a new
process and a new warehouse, with the embedded default config (MLflow on, as shipped).

Run:  python -m bench.warm_server [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.datasets import REPO

SAMPLE = REPO / "data" / "sample"


def crag(*args: str, env: dict[str, str]) -> tuple[float, str]:
    """`crag ARGS` in a new process: (its wall time in seconds, its stderr); a failure stops the bench."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "crag.cli", *args], capture_output=True, text=True, env=env, cwd=REPO)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"crag {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return seconds, done.stderr


def sample_run(workdir: Path, name: str, indexes: dict[str, str], env: dict[str, str]) -> tuple[float, str]:
    return crag(
        "run",
        "--conf",
        str(REPO / "conf" / "local.yaml"),
        "--set",
        f"retriever.index={indexes['kb']}",
        "--set",
        f"web_search.index={indexes['web']}",
        "--questions",
        str(SAMPLE / "questions.jsonl"),
        "--warehouse",
        str(workdir / name),
        env=env,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="sample runs against the warm server")
    args = parser.parse_args()
    from crag.config import load_config
    from crag.indexing import build_index

    with tempfile.TemporaryDirectory(prefix="crag-bench-") as tmp:
        workdir = Path(tmp)
        cfg = load_config(REPO / "conf" / "local.yaml")
        indexes = {"kb": str(workdir / "kb"), "web": str(workdir / "web")}
        build_index(SAMPLE / "kb", workdir / "kb", cfg.indexing)
        build_index(SAMPLE / "web.jsonl", workdir / "web", cfg.indexing)
        env = {**os.environ, "CRAG_HOME": str(workdir / "home")}
        report: dict = {}
        report["spark_start_s"] = round(crag("spark", "start", env=env)[0], 2)
        try:
            warm = []
            for i in range(args.runs):
                seconds, stderr = sample_run(workdir, f"warm{i}", indexes, env)
                warm.append(round(seconds, 2))
                report.setdefault("phases_of_the_last_warm_run", [])
                report["phases_of_the_last_warm_run"] = [line for line in stderr.splitlines() if ": " in line][-8:]
            report["warm_runs_s"] = warm
        finally:
            crag("spark", "stop", env=env)
        report["cold_run_s"] = round(sample_run(workdir, "cold", indexes, env)[0], 2)
    print(json.dumps(report, indent=2))
    print(
        f"\nsample into a new warehouse: {report['warm_runs_s']} s with `crag spark start` up (started in "
        f"{report['spark_start_s']} s); {report['cold_run_s']} s without it"
    )


if __name__ == "__main__":
    main()
