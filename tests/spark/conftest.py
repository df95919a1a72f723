"""Fixtures of the Spark tier shared by its modules: whole-job runs made once per test session and read by
many tests (the warm Spark Connect server is tests/conftest.py's: tests/slow uses it too).

The shared runs are read-only: a test that writes to a run's warehouse (another run, a re-run, eval,
compare, a status changed) writes to a copy of it (tests.support.copy_warehouse). A test keeps a run of
its own only where it needs one: a fault injected, another config or input, a kill, a resume."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path

import pytest

from crag.cli import main
from tests.support import (
    BASE_RUN,
    CANDIDATE_RUN,
    LOCAL_CONF,
    SAMPLE_QUESTIONS,
    SAMPLE_RUN,
    crag_run_args,
    run_job_task,
)


@dataclass(frozen=True)
class SampleRun:
    """`crag run` of the sample: its warehouse, and what the command printed."""

    warehouse: Path
    out: str
    err: str


@dataclass(frozen=True)
class VariantPair:
    """Two runs of the sample in one warehouse: the base variant, and paper_thresholds as the candidate."""

    warehouse: Path
    base: str = BASE_RUN
    candidate: str = CANDIDATE_RUN


@pytest.fixture(scope="session")
def sample_run(spark, index_overrides, tmp_path_factory) -> SampleRun:
    """`crag run` of conf/local.yaml (MLflow off) on the sample's questions, run id sample-1, into a
    warehouse folder of its own, on the session's Spark."""
    warehouse = tmp_path_factory.mktemp("sample-run") / "warehouse"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(crag_run_args(warehouse, "--run-id", SAMPLE_RUN, overrides=index_overrides))
    assert code == 0, err.getvalue()[-3000:]
    return SampleRun(warehouse, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def variant_pair(spark, index_overrides, tmp_path_factory) -> VariantPair:
    """The base and paper_thresholds runs of the sample (conf/local.yaml, MLflow off) into one warehouse,
    each written by the bundle's crag_batch job as Databricks runs its task: the script as __main__ with
    the bundle's exact parameter list (tests/spark/test_bundle_jobs.py). The candidate also sets
    grader.threshold=0.4, so that some grades flip between the two."""
    warehouse = tmp_path_factory.mktemp("variant-pair") / "warehouse"
    overrides = ";".join(index_overrides)
    for variant, extra in (("base", ""), ("paper_thresholds", ";grader.threshold=0.4")):
        values = {
            "config": str(LOCAL_CONF),
            "questions": str(SAMPLE_QUESTIONS),
            "variant": variant,
            "overrides": overrides + extra,
        }
        assert run_job_task("crag_batch", values, {"warehouse": str(warehouse)}) == 0, variant
    return VariantPair(warehouse)
