import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from crag.cli import main
from tests.support import LOCAL_CONF, SAMPLE, crag_run_args, set_args


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


def test_ask_rejects_a_blank_question_in_one_line(capsys, index_overrides):
    assert main(["ask", "--conf", str(LOCAL_CONF), *set_args(index_overrides), "   "]) == 2
    assert capsys.readouterr().err == "crag: error: question is only whitespace\n"


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


def test_run_with_missing_questions_is_one_line(capsys, tmp_path, index_overrides):
    code = main(crag_run_args(tmp_path, questions=tmp_path / "none.jsonl", overrides=index_overrides))
    assert code == 2
    assert capsys.readouterr().err == f"crag: error: questions not found: {tmp_path / 'none.jsonl'}\n"


def test_run_prints_the_summary(capsys, spark, tmp_path, index_overrides):
    code = main(crag_run_args(tmp_path, "--run-id", "cli", overrides=index_overrides))
    assert code == 0
    out = capsys.readouterr().out
    assert "run cli (variant base)" in out and "questions   51: 49 accepted, 2 rejected" in out
    assert "refusals" in out and "wall time" in out


def test_console_script_builds_an_index(tmp_path):
    crag = shutil.which("crag", path=str(Path(sys.executable).parent))
    assert crag, "the crag console script is installed with the package"
    done = subprocess.run(
        [crag, "index", "--conf", str(LOCAL_CONF), "--docs", str(SAMPLE / "web.jsonl"), "--out", str(tmp_path / "web")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "indexed 13 documents" in done.stdout
    assert (tmp_path / "web" / "manifest.json").exists()


def test_sql_over_the_warehouse(capsys, spark, tmp_path, index_overrides):
    assert main(crag_run_args(tmp_path, "--run-id", "sql", overrides=index_overrides)) == 0
    capsys.readouterr()
    sql = (
        "SELECT a.route, count(DISTINCT a.question_id) AS questions, count(g.doc_id) AS graded "
        "FROM answers a LEFT JOIN grades g ON a.run_id = g.run_id AND a.question_id = g.question_id "
        "WHERE a.run_id = 'sql' GROUP BY a.route ORDER BY a.route"
    )
    assert main(["sql", "--warehouse", str(tmp_path), "--format", "csv", sql]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(",") == ["route", "questions", "graded"]
    assert sum(int(line.split(",")[1]) for line in lines[1:]) == 49
    assert main(["sql", "--warehouse", str(tmp_path), sql]) == 0  # the terminal table: a header, a rule, rows
    table = capsys.readouterr().out.splitlines()
    assert (
        table[0].split() == ["route", "questions", "graded"]
        and set(table[1]) <= {"-", " "}
        and len(table) == len(lines) + 1
    )
    assert main(["sql", "--warehouse", str(tmp_path), "SELECT nope FROM answers"]) == 2
    assert capsys.readouterr().err.startswith("crag: error: SQL failed:")
    assert main(["sql", "--warehouse", str(tmp_path / "empty"), "SELECT 1"]) == 2


@pytest.mark.parametrize(
    "command", [["eval", "--run", "r"], ["calibrate", "--run", "r"], ["compare", "--base", "a", "--candidate", "b"]]
)
def test_table_commands_apply_set_without_a_config_file(capsys, tmp_path, command):
    """--set chooses their session (spark.remote) with or without --conf: it is read, not dropped."""
    assert main([command[0], "--warehouse", str(tmp_path), *command[1:], "--set", "spark.no_such_key=1"]) == 2
    assert "spark.no_such_key" in capsys.readouterr().err


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


def test_a_spark_connect_server_that_does_not_answer_is_one_line_at_once(capsys, tmp_path):
    """The Connect client would retry its connection for about a quarter of an hour, printing nothing."""
    import socket

    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    url = f"sc://127.0.0.1:{port}/;token=dapi-SECRET"
    assert main(["eval", "--warehouse", str(tmp_path), "--run", "r", "--set", f"spark.remote={url}"]) == 2
    assert f"no Spark Connect server answers at sc://127.0.0.1:{port} (" in capsys.readouterr().err
    # the URL's credentials are not in the error itself (the CLI's scrubber aside: the Python API raises it)
    from crag.errors import ConfigError
    from crag.spark import _check_reachable

    with pytest.raises(ConfigError) as refused:
        _check_reachable(f"sc://me:dapi-PASS@127.0.0.1:{port}/;token=dapi-SECRET")
    assert "dapi-" not in str(refused.value) and f"sc://127.0.0.1:{port} (" in str(refused.value)
    with pytest.raises(ConfigError, match="not a Spark Connect URL"):
        _check_reachable("sc://127.0.0.1:99999/")


def _self_signed(folder) -> tuple[str, str]:
    """A certificate and key for 127.0.0.1, signed by themselves."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(hours=1))
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


@pytest.fixture
def tls_and_plain_servers(tmp_path):
    """Two loopback servers: one that completes TLS handshakes, one that answers in plain bytes (as a
    Spark Connect server without TLS does). Their ports."""
    import socket
    import ssl
    import threading

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*_self_signed(tmp_path))
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]

    def serve(listener, tls):
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                try:
                    if tls:
                        context.wrap_socket(conn, server_side=True).close()
                    else:
                        conn.recv(1024)
                        conn.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00")  # an HTTP/2 SETTINGS frame
                except OSError:
                    pass

    for listener, tls in zip(listeners, (True, False), strict=True):
        threading.Thread(target=serve, args=(listener, tls), daemon=True).start()
    yield [listener.getsockname()[1] for listener in listeners]
    for listener in listeners:
        listener.close()


def test_a_token_to_a_server_without_tls_is_one_line_at_once(tls_and_plain_servers):
    """With a token (or use_ssl=true) the Connect client speaks TLS to any host but "localhost"; to a
    server without TLS it would retry its handshake for about a quarter of an hour, printing nothing."""
    from crag.errors import ConfigError
    from crag.spark import _check_reachable

    tls_port, plain_port = tls_and_plain_servers
    for params in ("/;token=dapi-SECRET", "/;use_ssl=true"):
        with pytest.raises(
            ConfigError, match=f"server at sc://127.0.0.1:{plain_port} does not answer in TLS"
        ) as refused:
            _check_reachable(f"sc://127.0.0.1:{plain_port}{params}")
        assert "dapi-" not in str(refused.value)
        _check_reachable(f"sc://127.0.0.1:{tls_port}{params}")  # a TLS server passes, its certificate unchecked
    _check_reachable(f"sc://127.0.0.1:{plain_port}/")  # no token: the client speaks plain gRPC


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
