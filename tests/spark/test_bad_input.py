"""Bad input, case by case: each ends in a reject row with a reason, or in a one-line error (exit 2)
before any work. Nothing is lost and nothing prints a traceback. (A bad config or argument, refused
before Spark starts: tests/unit/test_bad_input.py.)"""

import json

import pytest

from crag.cli import main
from tests.support import assert_run_refused, crag_run_args, run_rows, write_bytes

# question_id -> (row, expected reason)
REJECTED = {
    "null-question": ({"question": None}, "question is missing (null)"),
    "no-question-key": ({"text": "?"}, "question is missing (null)"),  # other lines have the key
    "empty": ({"question": ""}, "question is empty"),
    "spaces": ({"question": "  \t "}, "question is only whitespace"),
    "newlines": ({"question": "\n\n"}, "question is only whitespace"),
    "too-long": (
        {"question": "why? " * 500},
        "question is 2500 characters; the limit is 2000 (input.max_question_chars)",
    ),
    "bell": ({"question": "ring\x07"}, "question contains control character U+0007"),
    "nul": ({"question": "nul\x00byte"}, "question contains control character U+0000"),
    "escape": ({"question": "\x1b[31mred"}, "question contains control character U+001B"),
    "number": ({"question": 42}, "question is not text (got int)"),
    "list": ({"question": ["a", "b"]}, "question is not text (got list)"),
    "bad-answers": ({"question": "ok?", "answers": 5}, "answers must be a list of strings (got 5"),
    "bad-route": (
        {"question": "ok?", "expected_route": "sideways"},
        "expected_route must be one of internal, web, none",
    ),
    "bad-impossible": ({"question": "ok?", "is_impossible": "perhaps"}, "is_impossible must be true or false"),
    "bad-gold-docs": ({"question": "ok?", "gold_doc_ids": [1, 2]}, "gold_doc_ids must be a list of valid strings"),
}


@pytest.fixture(scope="module")
def rejected_run(spark, index_overrides, tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad")
    rows = [{"question_id": "good", "question": "How high is Mount Fuji?"}]
    rows += [{"question_id": qid, **row} for qid, (row, _) in REJECTED.items()]
    rows += [
        {"question_id": "good", "question": "the same id again?"},
        {"question_id": None, "question": "no id?"},
        {"question_id": {"a": 1}, "question": "odd id?"},
    ]
    path = folder / "questions.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code = main(crag_run_args(folder / "wh", "--run-id", "bad", questions=path, overrides=index_overrides))
    assert code == 0
    rejects = run_rows(folder / "wh", "rejects")
    answers = run_rows(folder / "wh", "answers")
    return rows, rejects, answers


@pytest.mark.parametrize("qid", sorted(REJECTED))
def test_rejected_with_reason(rejected_run, qid):
    _, rejects, _ = rejected_run
    reason = rejects.set_index("question_id").loc[qid, "reason"]
    assert reason.startswith(REJECTED[qid][1]), reason


def test_duplicate_and_missing_ids(rejected_run):
    rows, rejects, answers = rejected_run
    reasons = list(rejects["reason"])
    assert "duplicate question_id 'good': first seen at input row 0" in reasons
    assert "question_id is missing" in reasons
    assert "question_id is not text or an integer (got dict)" in reasons
    assert list(answers["question_id"]) == ["good"]
    assert len(answers) + len(rejects) == len(rows)  # nothing lost


INPUT_ERRORS = {
    "empty table": (lambda t: ["--questions", write_bytes(t, "q.jsonl", b"\n")], "q.jsonl hold no rows"),
    "empty CSV table": (
        lambda t: ["--questions", write_bytes(t, "q.csv", b"question_id,question\n")],
        "q.csv hold no rows",
    ),
    "no line with a question": (
        lambda t: ["--questions", write_bytes(t, "q.jsonl", b'{"question_id": "1", "text": "?"}\n["a"]\n')],
        "questions lack column(s) question: no line of ",
    ),
    "no line with either key": (
        lambda t: ["--questions", write_bytes(t, "q.jsonl", b'{"id": "1", "text": "?"}\n')],
        "questions lack column(s) question_id, question: no line of ",
    ),
    "path does not exist": (lambda t: ["--questions", str(t / "nope.jsonl")], "questions not found"),
    "unsupported file": (lambda t: ["--questions", write_bytes(t, "q.xlsx", b"x")], "unsupported questions file"),
    "folder not a Delta table": (lambda t: ["--questions", str(t)], "is a folder but not a Delta table"),
}


# A file whose every row is unreadable: each row is a reject row with its reason, and the run ends with
# one line saying that nothing was accepted.
UNREADABLE = {
    "invalid UTF-8": ("q.jsonl", b'{"question_id": "1", "question": "caf\xe9"}\n', "line is not valid UTF-8"),
    "invalid JSON": ("q.jsonl", b'{"question_id": "1",\n', "line is not valid JSON"),
    "not an object": ("q.jsonl", b'["a"]\n', "line is not a JSON object (got list)"),
    "invalid UTF-8 in CSV": (
        "q.csv",
        b"question_id,question\n1,caf\xe9\n",
        "question holds U+FFFD, the replacement character: the input was probably not UTF-8",
    ),
}


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_a_file_of_unreadable_rows_is_reject_rows_and_one_line(case, tmp_path, index_overrides, capsys):
    name, content, reason = UNREADABLE[case]
    argv = crag_run_args(
        tmp_path / "wh",
        "--run-id",
        "unreadable",
        questions=write_bytes(tmp_path, name, content),
        overrides=index_overrides,
    )
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "crag: error: no question was accepted: all 1 input rows were rejected" in err and "Traceback" not in err, (
        err
    )
    rejects = run_rows(tmp_path / "wh", "rejects")
    assert len(rejects) == 1 and rejects.loc[0, "reason"].startswith(reason), rejects["reason"]
    assert list(rejects["input_row"]) == [0]
    runs = run_rows(tmp_path / "wh", "runs")
    assert runs.loc[0, "status"] == "failed" and dict(runs.loc[0, "counts"])["rejected"] == 1  # its counts kept


@pytest.mark.parametrize("case", sorted(INPUT_ERRORS))
def test_one_line_error(case, tmp_path, index_overrides, capsys):
    build, message = INPUT_ERRORS[case]
    assert_run_refused(build(tmp_path), message, tmp_path / "wh", index_overrides, capsys)
