"""`crag` processes on a Spark Connect server (the run's warm one, tests/conftest.py): a killed client
resumed, two writers of one run id, spark.conf, and the heartbeat (with the server to itself). The server does the Spark work; these
tests' own process holds no JVM, as a Databricks serverless client holds none. The tables are read
back with delta-rs, as any Delta reader would. Connect beside classic Spark: tests/spark/test_connect.py."""

from __future__ import annotations

import re
import subprocess
import sys
import time

from deltalake import DeltaTable

from tests.support import REPO, crag_on, crag_run_args, killed_once_committed, run_rows, uniform_questions


def run_args_on(index_overrides, warehouse, run_id, *extra):
    return crag_run_args(warehouse, "--run-id", run_id, overrides=[*index_overrides, *extra])


def test_the_client_holds_no_jvm(connect_url):
    """The crag process on Connect starts no JVM of its own: the server does the work."""
    probe = (
        "from crag.config import SparkConfig; from crag.spark import get_spark, is_connect;"
        f"s = get_spark(SparkConfig(remote={connect_url!r})); print(is_connect(s), s.range(5).count());"
        "import pyspark; from pyspark import SparkContext; print(SparkContext._jvm is None)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["True", "5", "True"], done.stderr[-2000:]


def test_sigkill_then_resume_on_connect(connect_url, index_overrides, tmp_path):
    """A `crag run` client killed with SIGKILL after its first batch is committed; `--resume`
    (another client) finishes the run without answering a committed question again."""
    warehouse = tmp_path / "wh"
    args = run_args_on(index_overrides, warehouse, "killed", "spark.batch_questions=12", "spark.batch_seconds=null")
    command = [sys.executable, "-m", "crag.cli", *args, "--set", f"spark.remote={connect_url}"]
    first = subprocess.Popen(
        command, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    done = killed_once_committed(first, warehouse, "killed", 12, within_s=300)
    assert 12 <= len(done) < 49
    second = crag_on(connect_url, *args[:-2], "--resume", "killed")
    # The server finishes the write a killed client had started: it may commit after `done` was read.
    resumed = re.search(r"resuming: (\d+) questions already answered", second.stderr)
    assert resumed and len(done) <= int(resumed[1]) < 49, second.stderr
    answers = run_rows(warehouse, "answers")
    assert len(answers) == 49 and answers["question_id"].is_unique
    runs = run_rows(warehouse, "runs")
    assert runs.loc[0, "status"] == "succeeded"
    # one generation, resumed: the killed client's and the resume's results are the rows shown
    assert runs.loc[0, "shown_generation"] == runs.loc[0, "generation"]
    assert set(run_rows(warehouse, "results")["generation"]) == {runs.loc[0, "generation"]}


def test_one_writer_per_run_id_on_connect(connect_url, index_overrides, tmp_path):
    """Two clients start the same run id at once: one runs it, the other is refused with one line;
    a third run id beside them is unaffected."""
    warehouse = tmp_path / "wh"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "crag.cli",
                *run_args_on(index_overrides, warehouse, run_id),
                "--set",
                f"spark.remote={connect_url}",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for run_id in ("twice", "twice", "beside")
    ]
    results = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
    codes = sorted(code for _, _, code in results[:2])
    assert codes == [0, 2], [r[1][-800:] for r in results]
    refused = next(err for _, err, code in results[:2] if code == 2)
    assert "is being written by another crag process" in refused and "Traceback" not in refused
    assert results[2][2] == 0, results[2][1][-1500:]
    answers = run_rows(warehouse, "answers")
    assert answers.groupby("run_id").size().to_dict() == {"beside": 49, "twice": 49}
    assert not answers.duplicated(["run_id", "question_id"]).any()


def test_the_heartbeat_commits_while_a_batch_holds_its_tasks_on_connect(connect_url_alone, emulator, tmp_path):
    """As on classic Spark (test_production_job): the server keeps a task slot beside the batch's, so
    the heartbeat's commits land while the batch runs. Each one is a MERGE in `runs`' log, as the
    claim is (which commits before the first request). The server to itself: another test's run on it
    could take that slot."""
    emulator.behaviour["serving"].latency_s = 0.2  # a batch of about 7 s
    overrides = [
        "tables.stale_run_after_s=0.9",  # a beat every 0.3 s
        "spark.pipelines_per_task=1",
        "spark.questions_per_pipeline=1",  # one question after another in each task
        "cache.enabled=false",
    ]
    questions = uniform_questions(tmp_path / "questions.jsonl", 32)
    conf = REPO / "conf" / "databricks.yaml"
    crag_on(
        connect_url_alone,
        *crag_run_args(tmp_path, "--run-id", "beats", questions=questions, conf=conf, overrides=overrides),
    )
    now_ms, now = time.time() * 1000, time.perf_counter()
    first_request = now_ms - (now - min(admitted for _, admitted, _ in emulator.spans)) * 1000
    last_reply = now_ms - (now - max(released for _, _, released in emulator.spans)) * 1000
    assert last_reply - first_request > 5000  # the batch took long enough for several beats
    writes = [c["timestamp"] for c in DeltaTable(str(tmp_path / "runs")).history() if c["operation"] == "MERGE"]
    # a beat committed while every task of the batch ran (a first one may slip in before they start)
    assert [t for t in writes if first_request + 1500 < t < last_reply - 750], (writes, first_request, last_reply)


def test_spark_conf_reaches_a_connect_session_and_a_static_setting_is_one_line(connect_url, tmp_path):
    probe = (
        "from crag.config import load_config; from crag.spark import get_spark;"
        f"cfg = load_config(None, ['spark.remote={connect_url}', 'spark.conf.spark.sql.ansi.enabled=false']);"
        "s = get_spark(cfg.spark); print(s.conf.get('spark.sql.ansi.enabled'), s.conf.get('spark.sql.session.timeZone'))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["false", "UTC"], done.stderr[-2000:]
    refused = crag_on(
        connect_url,
        "eval",
        "--warehouse",
        str(tmp_path),
        "--run",
        "r",
        "--set",
        "spark.conf.spark.executor.memory=3g",
        check=False,
    )
    assert refused.returncode == 2 and refused.stderr.startswith(
        "crag: error: spark.conf spark.executor.memory: the running Spark session does not take it ("
    ), refused.stderr
