"""Every way a command ends is one line: run ids, ports, report paths, failures of files and data, and
Ctrl-C / SIGTERM during `crag run`, which say how to resume."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest

from crag import cli
from crag.cli import main
from crag.errors import InputError
from crag.ids import check_run_id
from tests.support import REPO, committed_questions, crag_run_args, run_rows


@pytest.mark.parametrize("run_id", ["r1\n", "r1\r\n", "r1\n\n", "\nr1", "r 1", "r1/..", "", "-r1", "r1\x00"])
def test_a_run_id_with_a_line_break_or_other_junk_is_refused(run_id):
    with pytest.raises(InputError, match="invalid run id"):
        check_run_id(run_id)


@pytest.mark.parametrize("run_id", ["r1", "base-2026.11.29_a", "A" * 128])
def test_good_run_ids_pass(run_id):
    assert check_run_id(run_id) == run_id


def test_the_cli_refuses_a_run_id_with_a_trailing_newline(tmp_path, capsys, index_overrides):
    code = main(crag_run_args(tmp_path, "--run-id", "r1\n", overrides=index_overrides))
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("crag: error: invalid run id 'r1\\n'") and err.count("\n") == 1
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_emulate_on_a_port_in_use_is_one_line(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert main(["emulate", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == f"crag: error: port {port} is in use: stop what holds it or choose another with --port\n"


def test_emulate_on_an_impossible_port_is_one_line(capsys):
    assert main(["emulate", "--port", "70000"]) == 2
    assert capsys.readouterr().err == "crag: error: --port 70000: a port is a number from 0 to 65535\n"


def test_compare_report_given_a_folder_is_one_line_before_any_work(tmp_path, capsys):
    code = main(
        [
            "compare",
            "--warehouse",
            str(tmp_path / "nowhere"),
            "--base",
            "a",
            "--candidate",
            "b",
            "--report",
            str(tmp_path),
            "--no-mlflow",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"crag: error: --report {tmp_path} is a folder") and err.count("\n") == 1


# ---------------------------------------------------------------- the last-resort handler


def _bad_parquet(tmp_path, content: bytes):
    path = tmp_path / "questions.parquet"
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("content", [b"", b"PAR1 not really parquet"])
def test_unreadable_parquet_input_is_one_line(tmp_path, capsys, index_overrides, content):
    questions = _bad_parquet(tmp_path, content)
    code = main(crag_run_args(tmp_path / "wh", questions=questions, overrides=index_overrides))
    assert code == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"crag: error: [^\n]*(not a Parquet file|cannot read questions)[^\n]*\n", err), err


def test_a_delta_folder_with_an_empty_log_is_one_line(tmp_path, capsys, index_overrides):
    (tmp_path / "questions" / "_delta_log").mkdir(parents=True)
    code = main(crag_run_args(tmp_path / "wh", questions=tmp_path / "questions", overrides=index_overrides))
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("crag: error: ") and err.count("\n") == 1, err


def test_crag_debug_shows_the_traceback(tmp_path, monkeypatch, capsys, index_overrides):
    monkeypatch.setenv("CRAG_DEBUG", "1")
    import crag.job

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(crag.job, "prepare", full_disk)
    assert main(crag_run_args(tmp_path / "wh", overrides=index_overrides)) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "in full_disk" in err
    assert err.endswith("crag: error: OSError: [Errno 28] No space left on device\n")


def test_a_file_system_error_is_one_scrubbed_line(monkeypatch, capsys):
    def fail(args):
        raise PermissionError(13, "Permission denied", "http://u:pa55word-x@host/warehouse/runs")

    monkeypatch.setattr(cli, "_eval", fail)
    assert main(["eval", "--warehouse", "w", "--run", "r"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("crag: error: PermissionError: [Errno 13] Permission denied") and "pa55word" not in err


@pytest.mark.parametrize("debug", ["", "1"])
def test_a_bug_keeps_its_traceback_without_secrets(debug, monkeypatch, capsys):
    """A bug's exception text may hold what it was given: a token in a URL, a resolved secret."""
    from crag import secrets

    secrets.remember(["dapi-RESOLVED-9876"])
    monkeypatch.setenv("CRAG_DEBUG", debug)

    def fail(args):
        raise ZeroDivisionError("a bug near sc://host:15002/;token=dapi-URL-1234 with dapi-RESOLVED-9876")

    monkeypatch.setattr(cli, "_eval", fail)
    assert main(["eval", "--warehouse", "w", "--run", "r"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "in fail" in err
    assert err.endswith("ZeroDivisionError: a bug near sc://host:15002/;token=*** with ***\n")


def test_an_interrupt_behind_a_cancelled_spark_job_is_an_interrupt(monkeypatch, capsys):
    def fail(args):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("An error occurred while calling o102.getResult")  # as Spark's collect does

    monkeypatch.setattr(cli, "_run", fail)
    assert main(crag_run_args("w", "--run-id", "r7", questions="q.jsonl", conf="c.yaml")) == 130
    err = capsys.readouterr().err
    assert err == (
        "crag: interrupted: run r7 did not finish; continue it with: "
        "crag run --resume r7 --conf c.yaml --questions q.jsonl --warehouse w\n"
    )


# ---------------------------------------------------------------- Ctrl-C and SIGTERM, for real


def _start_run(tmp_path, sample_indexes, extra: list[str]):
    sets = [
        f"retriever.index={sample_indexes['kb']}",
        f"web_search.index={sample_indexes['web']}",
        "mlflow.enabled=false",
        "spark.batch_questions=3",
        "spark.batch_seconds=null",
        "routing.policy=thresholds",
    ]
    args = [sys.executable, "-m", "crag.cli", *crag_run_args(tmp_path / "wh", "--no-cache", *extra, overrides=sets)]
    err = open(tmp_path / "stderr.txt", "w+", encoding="utf-8")
    return subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO, env={**os.environ, "CRAG_DEBUG": ""}
    ), err


def _wait_for(err, text: str, proc, limit_s: float = 180) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        err.seek(0)
        if text in err.read():
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never appeared")


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum, code, how", [(signal.SIGTERM, 143, "terminated (SIGTERM)"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_signal_during_crag_run_ends_with_the_resume_line(tmp_path, sample_indexes, signum, code, how):
    proc, err = _start_run(tmp_path, sample_indexes, ["--run-id", "sig"])
    try:
        _wait_for(err, "batch 2 committed", proc)
        proc.send_signal(signum)
        assert proc.wait(timeout=120) == code
    finally:
        if proc.poll() is None:
            proc.kill()
    err.seek(0)
    text = err.read()
    assert "Traceback" not in text and "Exception" not in text, text
    last = text.strip().splitlines()[-1]
    assert last.startswith(f"crag: {how}: run sig did not finish; continue it with: crag run --resume sig ")
    # The line is the interrupted command as a resume: the same config, overrides, questions and
    # warehouse (that such a command finishes the run is tested in test_resume and test_connect).
    resume = shlex.split(last.split("continue it with: ", 1)[1])
    assert resume[:2] == ["crag", "run"]
    started, resumed = (cli.parser().parse_args(words) for words in (proc.args[3:], resume[1:]))
    assert (started.run_id, started.resume, resumed.run_id, resumed.resume) == ("sig", None, None, "sig")
    assert cli._overrides(started) == cli._overrides(resumed)
    same = [k for k in vars(started) if k not in ("run_id", "resume", "overrides", "override_list")]
    assert [getattr(started, k) for k in same] == [getattr(resumed, k) for k in same]
    # and what it resumes is there: the run recorded as failed, its committed batches kept

    assert run_rows(tmp_path / "wh", "runs").loc[0, "status"] == "failed"
    assert 0 < len(committed_questions(tmp_path / "wh", "sig")) < 49


def test_the_resume_line_shows_no_credential(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run", interrupted)
    assert (
        main(
            crag_run_args(
                "w",
                "--run-id",
                "r8",
                questions="q.jsonl",
                conf="c.yaml",
                overrides=[
                    "web_search.api_base_url=http://proxy:pa55word-x@h:8080",
                    "retriever.kwargs.api_key=pcsk_LIVEKEY_123456",
                    "retriever.kwargs.headers.Authorization=Bearer LIVEBEARER998877",
                ],
            )
        )
        == 130
    )
    err = capsys.readouterr().err
    assert "crag run --resume r8" in err and "pa55word" not in err and "proxy" not in err
    assert "LIVEKEY" not in err and "LIVEBEARER" not in err and "--set 'retriever.kwargs.api_key=***'" in err
