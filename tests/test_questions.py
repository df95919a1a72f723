import numpy as np
import pandas as pd
import pytest

from crag.errors import InputError
from crag.questions import validate_questions
from crag.tables import read_questions


def _validate(questions, ids=None, max_chars=50):
    ids = ids or [f"q{i}" for i in range(len(questions))]
    return validate_questions(pd.DataFrame({"question_id": ids, "question": questions}), max_chars)


@pytest.mark.parametrize(
    "question, reason",
    [
        (None, "question is missing (null)"),
        (np.nan, "question is missing (null)"),
        ("", "question is empty"),
        ("  \t\n ", "question is only whitespace"),
        ("x" * 51, "question is 51 characters; the limit is 50 (input.max_question_chars)"),
        ("bell\x07", "question contains control character U+0007 (unnamed) at position 4"),
        (42, "question is not text (got int)"),
    ],
)
def test_bad_questions_become_reject_rows_with_reasons(question, reason):
    accepted, rejects = _validate(["fine?", question])
    assert list(accepted["question_id"]) == ["q0"]
    assert rejects.to_dict("records") == [
        {"question_id": "q1", "question": question if isinstance(question, str) else None, "input_row": 1, "reason": reason}
    ]


def test_tabs_and_newlines_are_ordinary_whitespace():
    accepted, rejects = _validate(["line one\nline\ttwo?"])
    assert len(accepted) == 1 and rejects.empty


def test_japanese_question_at_the_limit_is_accepted():
    accepted, rejects = _validate(["あ" * 50])
    assert len(accepted) == 1 and rejects.empty


def test_duplicate_ids_keep_the_first_and_reject_later_ones():
    accepted, rejects = _validate(["a?", "b?", "c?"], ids=["x", "y", "x"])
    assert list(accepted["question"]) == ["a?", "b?"]
    assert rejects.iloc[0]["reason"] == "duplicate question_id 'x': first seen at input row 0"
    assert rejects.iloc[0]["input_row"] == 2


def test_ids_integers_become_strings_and_missing_ids_are_rejected():
    accepted, rejects = _validate(["a?", "b?", "c?", "d?"], ids=[7, 8.0, None, " "])
    assert list(accepted["question_id"]) == ["7", "8"]
    assert list(rejects["reason"]) == ["question_id is missing", "question_id is missing"]


def test_every_input_row_is_accounted_for():
    questions = ["ok?", None, "", "ok too?", "x" * 99]
    accepted, rejects = _validate(questions, ids=["a", "b", "c", "a", "d"])
    assert len(accepted) + len(rejects) == len(questions)


def test_missing_columns_and_empty_table_are_errors():
    with pytest.raises(InputError, match=r"lack column\(s\) question \(found: question_id, text\)"):
        validate_questions(pd.DataFrame({"question_id": ["a"], "text": ["?"]}), 10)
    with pytest.raises(InputError, match="no rows"):
        validate_questions(pd.DataFrame({"question_id": [], "question": []}), 10)


def test_extra_columns_travel_with_accepted_questions():
    df = pd.DataFrame({"question_id": ["a"], "question": ["q?"], "answers": [["x"]]})
    accepted, _ = validate_questions(df, 10)
    assert accepted.loc[0, "answers"] == ["x"]


def test_read_questions_formats(tmp_path):
    from deltalake import write_deltalake

    df = pd.DataFrame({"question_id": ["a", "b"], "question": ["one?", "two?"]})
    df.to_json(tmp_path / "q.jsonl", orient="records", lines=True)
    df.to_parquet(tmp_path / "q.parquet")
    df.to_csv(tmp_path / "q.csv", index=False)
    write_deltalake(str(tmp_path / "delta"), df)
    for name in ("q.jsonl", "q.parquet", "q.csv", "delta"):
        assert list(read_questions(tmp_path / name)["question"]) == ["one?", "two?"], name


def test_read_questions_errors(tmp_path):
    with pytest.raises(InputError, match="questions not found"):
        read_questions(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_bytes(b'{"question_id": "a", "question": "caf\xe9"}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:1: not valid UTF-8"):
        read_questions(tmp_path / "bad.jsonl")
    (tmp_path / "broken.jsonl").write_text('{"question_id": "a"\n')
    with pytest.raises(InputError, match=r"broken.jsonl:1: not valid JSON"):
        read_questions(tmp_path / "broken.jsonl")
    (tmp_path / "q.txt").write_text("hi")
    with pytest.raises(InputError, match="unsupported questions file"):
        read_questions(tmp_path / "q.txt")
    (tmp_path / "folder").mkdir()
    with pytest.raises(InputError, match="not a Delta table"):
        read_questions(tmp_path / "folder")


def test_gold_columns_are_normalised_or_rejected():
    df = pd.DataFrame({
        "question_id": ["a", "b", "c", "d", "e"],
        "question": ["q?"] * 5,
        "answers": [["x", "y"], "single", None, [1, 2], ["ok"]],
        "expected_route": ["internal", "web", None, "internal", "sideways"],
        "is_impossible": [False, "true", None, False, False],
    })
    accepted, rejects = validate_questions(df, 10)
    assert list(accepted["answers"]) == [["x", "y"], ["single"], []]
    assert list(accepted["is_impossible"]) == [False, True, None]
    assert list(accepted["expected_route"]) == ["internal", "web", None]
    assert list(rejects["reason"]) == ["answers must be a list of strings",
                                       "expected_route must be one of internal, web, none (got 'sideways')"]
