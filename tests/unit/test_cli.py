"""The command line, without Spark: `crag ask` shows every stage (and escapes what documents and pages
hold), and every way a command ends is one line: config errors, run ids, missing files, ports, a
bug (its traceback, without secrets) and Ctrl-C, which says how to resume. (Ctrl-C and SIGTERM
during a real `crag run`: tests/spark/test_cli.py.)"""

from __future__ import annotations

import socket

import pytest

from crag import cli
from crag.cli import main
from tests.support import LOCAL_CONF, crag_run_args, set_args


def test_ask_prints_every_stage(capsys, index_overrides):
    assert main(["ask", "--conf", str(LOCAL_CONF), *set_args(index_overrides), "How high is Mount Fuji?"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "[backends] retriever bm25, grader semantic, rewriter keywords, web_search offline_corpus, generator extractive\n"
    )
    for marker in (
        "[retrieve]",
        "[grade]",
        "[decide] incorrect",
        "[rewrite] web query: high Mount Fuji",
        "[web_search] 3 results",
        "[generate] route web",
    ):
        assert marker in out, out
    assert "3,776 metres" in out and "https://example.org/wiki/Mount_Fuji" in out


def test_ask_says_when_the_answer_comes_from_the_last_resort(capsys, index_overrides):
    """The sample's one question answered from a document graded irrelevant (routing.last_resort)."""
    assert main(["ask", "--conf", str(LOCAL_CONF), *set_args(index_overrides), "How much does the AQ-7 weigh?"]) == 0
    out = capsys.readouterr().out
    assert "[last_resort] " in out and "no relevant context survived" in out, out
    assert out.index("[last_resort]") < out.index("[context] 1 documents") < out.index("[generate] route internal")


def test_ask_prints_a_retrieved_document_without_a_score(capsys, index_overrides, monkeypatch):
    """A LangChain retriever may return documents with no score."""
    import crag.backends.bm25

    real = crag.backends.bm25.BM25Retriever.search

    def unscored(self, *args, **kwargs):
        return [[{**d, "retrieval_score": None} for d in docs] for docs in real(self, *args, **kwargs)]

    monkeypatch.setattr(crag.backends.bm25.BM25Retriever, "search", unscored)
    question = "How often should the AQ-7 filter be replaced?"
    assert main(["ask", "--conf", str(LOCAL_CONF), *set_args(index_overrides), question]) == 0
    retrieved = capsys.readouterr().out.split("[grade]")[0]
    assert "[retrieve]" in retrieved and " 1. " in retrieved and " score " not in retrieved


def test_ask_shows_control_characters_as_escapes(capsys, index_overrides, monkeypatch):
    """Titles, URLs and answers come from documents and web pages: an escape sequence in them must not
    reach the terminal (clear the screen, set its title, ring its bell) nor a line break forge a line."""
    import crag.backends.bm25
    import crag.backends.extractive
    from crag.backends.base import Answer

    search, generate = (
        crag.backends.bm25.OfflineCorpusSearch.search,
        crag.backends.extractive.ExtractiveGenerator.generate,
    )

    def hostile_pages(self, *args, **kwargs):
        pages = search(self, *args, **kwargs)
        return [
            {**d, "title": f"{d['title']}\x1b]0;owned\x07", "url": f"{d['url']}\x1b[2J\n[generate] route internal"}
            for d in pages
        ]

    def hostile_answer(self, *args, **kwargs):
        answer = generate(self, *args, **kwargs)
        return Answer(f"{answer.text}\u202e\r[generate] route internal", answer.cited)

    monkeypatch.setattr(crag.backends.bm25.OfflineCorpusSearch, "search", hostile_pages)
    monkeypatch.setattr(crag.backends.extractive.ExtractiveGenerator, "generate", hostile_answer)
    assert main(["ask", "--conf", str(LOCAL_CONF), *set_args(index_overrides), "How high is Mount Fuji?"]) == 0
    out = capsys.readouterr().out
    assert not {"\x1b", "\x07", "\r", "\u202e"} & set(out), out
    assert "Mount Fuji\\x1b]0;owned\\x07" in out and "/Mount_Fuji\\x1b[2J\\n[generate] route internal" in out
    assert "2013.\\u202e [generate] route internal" in out  # wrapped: whitespace is a space
    assert [line for line in out.splitlines() if line.startswith("[generate]")] == ["[generate] route web"]


def test_ask_rejects_a_blank_question_in_one_line(capsys, index_overrides):
    assert main(["ask", "--conf", str(LOCAL_CONF), *set_args(index_overrides), "   "]) == 2
    assert capsys.readouterr().err == "crag: error: question is only whitespace\n"


def test_ask_fails_with_its_question_in_one_line(capsys, index_overrides, monkeypatch):
    """A question that fails ends `crag ask` with exit code 2 and its error, which shows on screen at the
    stage that raised it only."""
    import crag.backends.semantic

    def down(self, *args, **kwargs):
        raise RuntimeError("grader down\x1b[2J")

    monkeypatch.setattr(crag.backends.semantic.SemanticGrader, "grade", down)
    question = "How often should the AQ-7 filter be replaced?"
    assert main(["ask", "--conf", str(LOCAL_CONF), *set_args(index_overrides), question]) == 2
    printed = capsys.readouterr()
    assert printed.err == "crag: error: grade: RuntimeError: grader down\\x1b[2J\n"
    stages = [line.split("]")[0] + "]" for line in printed.out.splitlines() if line.startswith("[")]
    assert stages == ["[backends]", "[retrieve]", "[grade]", "[generate]"], printed.out
    assert "[grade] error: grade: RuntimeError: grader down\\x1b[2J\n" in printed.out
    assert printed.out.count("grader down") == 1 and "[generate] route error\n" in printed.out


# ---------------------------------------------------------------- one line for every error


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--set", "retriever.kk=1"],
            "crag: error: unknown config key 'retriever.kk' (allowed here: backend, index, k)\n",
        ),
        (
            ["--set", "web_search.backend=bing"],
            "crag: error: config key 'web_search.backend': got 'bing', expected one of 'offline_corpus', 'tavily', 'none'\n",
        ),
        (["--variant", "nope"], "crag: error: unknown variant 'nope'"),
    ],
)
def test_config_errors_are_one_line(capsys, args, message):
    assert main(["ask", "--conf", str(LOCAL_CONF), *args, "q?"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_the_cli_refuses_a_run_id_with_a_trailing_newline(tmp_path, capsys, index_overrides):
    code = main(crag_run_args(tmp_path, "--run-id", "r1\n", overrides=index_overrides))
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("crag: error: invalid run id 'r1\\n'") and err.count("\n") == 1
    assert not any(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.parametrize(
    "command", [["eval", "--run", "r"], ["calibrate", "--run", "r"], ["compare", "--base", "a", "--candidate", "b"]]
)
def test_table_commands_apply_set_without_a_config_file(capsys, tmp_path, command):
    """--set chooses their session (spark.remote) with or without --conf: it is read, not dropped."""
    assert main([command[0], "--warehouse", str(tmp_path), *command[1:], "--set", "spark.no_such_key=1"]) == 2
    assert "spark.no_such_key" in capsys.readouterr().err


def test_index_errors_are_one_line(tmp_path, capsys):
    assert (
        main(["index", "--conf", str(LOCAL_CONF), "--docs", str(tmp_path / "none"), "--out", str(tmp_path / "i")]) == 2
    )
    assert capsys.readouterr().err == f"crag: error: documents not found: {tmp_path / 'none'}\n"


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


# ---------------------------------------------------------------- the last-resort handler


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


def test_the_crag_command_exits_with_mains_code_its_objects_frozen_for_the_exit(monkeypatch):
    """`crag` (the console script, and `python -m crag.cli`) freezes what the command left before the
    process ends, sparing the exit's garbage collection a walk over all of it; main itself does not,
    since tests and the bundle's job scripts call it in processes that go on."""
    import tomllib

    from tests.support import REPO

    calls: list[str] = []
    monkeypatch.setattr(cli, "main", lambda: calls.append("main") or 3)
    monkeypatch.setattr(cli.gc, "freeze", lambda: calls.append("freeze"))
    with pytest.raises(SystemExit) as ended:
        cli.command()
    assert ended.value.code == 3 and calls == ["main", "freeze"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["crag"] == "crag.cli:command"
