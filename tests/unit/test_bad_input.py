"""A bad config or argument of `crag run`, case by case: each ends in a one-line error (exit 2) before any
work, and before Spark starts. (Bad input rows and files, which Spark reads: tests/spark/test_bad_input.py.)"""

import pytest

from tests.support import REPO, assert_run_refused, write_bytes

OPENAI_CONF = REPO / "conf" / "openai.yaml"


def _old_index(tmp_path):
    index = tmp_path / "old"
    index.mkdir()
    (index / "manifest.json").write_text('{"format": "crag-bm25", "version": 1}')
    return index


CONFIG_ERRORS = {
    "malformed config": (lambda t: ["--conf", write_bytes(t, "c.yaml", b"retriever: [oops\n")], "is not valid YAML"),
    "config not a mapping": (
        lambda t: ["--conf", write_bytes(t, "c.yaml", b"- a\n- b\n")],
        "must be a mapping of sections",
    ),
    "config file missing": (lambda t: ["--conf", str(t / "none.yaml")], "config file not found"),
    "unknown config key": (
        lambda t: ["--set", "retriever.top_k=3"],
        "unknown config key 'retriever.top_k' (allowed here: backend, index, k)",
    ),
    "unknown section": (lambda t: ["--set", "retreiver.k=3"], "unknown config key 'retreiver'"),
    "mistyped value": (
        lambda t: ["--set", "retriever.k=ten"],
        "config key 'retriever.k': Input should be a valid integer",
    ),
    "unknown backend": (
        lambda t: ["--set", "grader.backend=gpt4"],
        "config key 'grader.backend': got 'gpt4', expected one of 'lexical', 'semantic', 'databricks', 'openai'",
    ),
    "unknown policy": (lambda t: ["--set", "routing.policy=sometimes"], "config key 'routing.policy': got 'sometimes'"),
    "thresholds out of order": (
        lambda t: ["--set", "routing.lower=0.9", "--set", "routing.upper=0.1"],
        "must not exceed",
    ),
    "bad --set": (
        lambda t: ["--set", "retriever.k"],
        "an override (--set, or one of --overrides) must be key=value",
    ),
    "unknown variant": (lambda t: ["--variant", "nope"], "unknown variant 'nope'"),
    "unset env var": (
        lambda t: ["--conf", write_bytes(t, "c.yaml", b"input:\n  max_question_chars: ${CRAG_NO_SUCH_VAR}\n")],
        "refers to ${CRAG_NO_SUCH_VAR}, which is not set",
    ),
    "missing index": (lambda t: ["--set", f"retriever.index={t / 'none'}"], "no crag index at"),
    "incompatible index": (lambda t: ["--set", f"retriever.index={_old_index(t)}"], "rebuild it with crag index"),
    "missing credential": (
        lambda t: [
            "--set",
            "grader.backend=openai",
            "--set",
            "grader.endpoint=m",
            "--set",
            "grader.api_key_env=CRAG_NO_KEY",
        ],
        "missing credential for grader (openai model 'm'): set the environment variable CRAG_NO_KEY",
    ),
    "invalid run id": (lambda t: ["--run-id", "bad id!"], "invalid run id 'bad id!'"),
    "resume of an unknown run": (lambda t: ["--resume", "ghost"], "no run 'ghost' to resume"),
    "missing prompt": (
        lambda t: ["--conf", str(OPENAI_CONF), "--set", "generator.prompt=nope.yaml"],
        "prompt template not found",
    ),
}


@pytest.mark.parametrize("case", sorted(CONFIG_ERRORS))
def test_one_line_error_before_spark_starts(case, tmp_path, index_overrides, capsys, monkeypatch):
    monkeypatch.delenv("CRAG_NO_KEY", raising=False)
    build, message = CONFIG_ERRORS[case]
    assert_run_refused(build(tmp_path), message, tmp_path / "wh", index_overrides, capsys)
