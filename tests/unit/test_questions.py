"""Row checks of the question table (crag.questions.check_rows): pure, no Spark."""

import json
from decimal import Decimal

import numpy as np
import pandas as pd
import pytest

from crag.errors import InputError
from crag.questions import MAX_ID_CHARS, check_one, check_rows
from tests.support import crag_run_args


def _check(questions, ids=None, max_chars=50):
    ids = ids or [f"q{i}" for i in range(len(questions))]
    frame = pd.DataFrame({"question_id": ids, "question": questions, "input_row": range(len(questions))})
    return check_rows(frame, max_chars)


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
        ("half a pair \ud800", "question is not valid text: it holds a lone surrogate"),
        ("mojibake \ufffd", "question holds U+FFFD, the replacement character: the input was probably not UTF-8"),
        ("\u200b\ufeff", "question has no visible character"),
        ("\u3164 \u034f\ufe0f\u2800", "question has no visible character"),
    ],
)
def test_bad_questions_get_their_reason_and_good_ones_none(question, reason):
    checked = _check(["fine?", question])
    assert checked.loc[0, "reason"] is None and checked.loc[0, "question_id"] == "q0"
    assert checked.loc[1, "reason"].startswith(reason), checked.loc[1, "reason"]
    assert checked.loc[1, "input_row"] == 1 and checked.loc[1, "question_id"] == "q1"


def test_text_that_cannot_be_encoded_is_kept_escaped_for_the_reject_row():
    checked = _check(["a \ud800 b"])
    assert checked.loc[0, "question"] == "a \\ud800 b"
    checked.loc[0, "question"].encode("utf-8")  # storable


def test_tabs_newlines_and_japanese_at_the_limit_are_accepted():
    checked = _check(["line one\nline\ttwo?", "あ" * 50])
    assert checked["reason"].isna().all()


def test_ids_integers_become_text_and_missing_ids_are_marked():
    checked = _check(["a?", "b?", "c?", "d?", "e?", "f?"], ids=[7, 8.0, None, " ", "007", Decimal("9")])
    assert list(checked["question_id"][:2]) == ["7", "8"] and checked.loc[4, "question_id"] == "007"
    assert checked.loc[5, "question_id"] == "9"  # Spark reads an unsigned 64-bit integer as a decimal
    assert list(checked["reason"][2:4]) == ["question_id is missing", "question_id is missing"]
    assert list(checked["id_problem"]) == [False, False, True, True, False, False]


def test_ids_lose_their_spaces_and_may_hold_no_control_or_invisible_character_nor_run_past_the_limit():
    ids = [
        " q1 ",
        "x" * MAX_ID_CHARS,
        "line\nbreak",
        "q1\t",
        "bell\x07",
        "a\u200bb",
        "a\u2028b",
        "x" * (MAX_ID_CHARS + 1),
    ]
    checked = _check(["q?"] * len(ids), ids=ids)
    assert checked.loc[0, "question_id"] == "q1" and checked["reason"][:2].isna().all()
    assert list(checked["reason"][2:7]) == [
        "question_id contains control or invisible character U+000A at position 4",
        "question_id contains control or invisible character U+0009 at position 2",  # not trimmed away
        "question_id contains control or invisible character U+0007 at position 4",
        "question_id contains control or invisible character U+200B (ZERO WIDTH SPACE) at position 1",
        "question_id contains control or invisible character U+2028 (LINE SEPARATOR) at position 1",
    ]
    assert checked.loc[7, "reason"] == f"question_id is {MAX_ID_CHARS + 1} characters; the limit is {MAX_ID_CHARS}"
    assert list(checked["id_problem"]) == [False, False] + [True] * 6
    # the joiners are parts of real names where they shape a word (Persian, Indic, emoji sequences)
    names = ["می\u200cخواهم", "👨\u200d👩", "क्\u200dष"]
    assert _check(["q?"] * 3, ids=names)["reason"].isna().all()


@pytest.mark.parametrize(
    ("qid", "said"),
    [
        ("q1\u00a0", "space character U+00A0 (NO-BREAK SPACE) at position 2 (the one space an id may hold is ' ')"),
        ("q\u30001", "space character U+3000 (IDEOGRAPHIC SPACE) at position 1 (the one space an id may hold is ' ')"),
        ("q\u3164", "control or invisible character U+3164 (HANGUL FILLER) at position 1"),
        ("\u115fq", "control or invisible character U+115F (HANGUL CHOSEONG FILLER) at position 0"),
        ("q\u1160", "control or invisible character U+1160 (HANGUL JUNGSEONG FILLER) at position 1"),
        ("q\uffa0", "control or invisible character U+FFA0 (HALFWIDTH HANGUL FILLER) at position 1"),
        ("q1\U000e0041", "control or invisible character U+E0041 (TAG LATIN CAPITAL LETTER A) at position 2"),
        ("q\u180e1", "control or invisible character U+180E (MONGOLIAN VOWEL SEPARATOR) at position 1"),
        ("co\u00adop", "control or invisible character U+00AD (SOFT HYPHEN) at position 2"),
        ("a\u200db", "control or invisible character U+200D (ZERO WIDTH JOINER) at position 1"),  # joins nothing
        ("q\u202e1", "control or invisible character U+202E (RIGHT-TO-LEFT OVERRIDE) at position 1"),
        ("\u2764\ufe0f", "control or invisible character U+FE0F (VARIATION SELECTOR-16) at position 1"),
    ],
)
def test_an_id_that_prints_alike_or_invisibly_is_refused_as_unicode_identifiers_are(qid, said):
    """What NFKC_Casefold erases (Default_Ignorable_Code_Point) and every space but ' ' (UTS #39)."""
    checked = _check(["q?"], ids=[qid])
    assert checked.loc[0, "reason"] == f"question_id contains {said}" and checked.loc[0, "id_problem"]


def test_an_id_that_was_not_utf8_is_rejected_not_merged_with_another():
    """café and cafè in Latin-1 both read as caf\ufffd: taken as ids they would be one id."""
    checked = _check(["a?", "b?"], ids=["caf\ufffd", "caf\ufffd"])
    assert list(checked["id_problem"]) == [True, True]
    assert set(checked["reason"]) == {
        "question_id holds U+FFFD, the replacement character: the input was probably not UTF-8"
    }


def test_jsonl_lines_are_parsed_one_by_one():
    lines = [
        json.dumps({"question_id": "a", "question": "ok?", "answers": ["x"]}),
        '{"question_id": "b"',
        "[1, 2]",
        json.dumps({"question_id": "c", "question": 5}),
        json.dumps({"question_id": "d", "question": "\ud800"}),
    ]
    checked = check_rows(pd.DataFrame({"value": lines, "input_row": range(len(lines))}), 100)
    assert checked.loc[0, "reason"] is None and list(checked.loc[0, "answers"]) == ["x"] and checked.loc[0, "has_gold"]
    assert checked.loc[1, "reason"].startswith("line is not valid JSON")
    assert checked.loc[2, "reason"] == "line is not a JSON object (got list)"
    assert checked.loc[3, "reason"] == "question is not text (got int)"
    assert checked.loc[4, "reason"].startswith("question is not valid text")


def test_gold_columns_are_normalised_or_rejected():
    frame = pd.DataFrame(
        {
            "question_id": ["a", "b", "c", "d", "e"],
            "question": ["q?"] * 5,
            "answers": [["x", "y"], "single", None, [1, 2], ["ok"]],
            "expected_route": ["internal", "web", None, "internal", "sideways"],
            "is_impossible": [False, "true", None, False, False],
            "input_row": range(5),
        }
    )
    checked = check_rows(frame, 10)
    assert [list(a) for a in checked["answers"][:3]] == [["x", "y"], ["single"], []]
    assert list(checked["is_impossible"][:3]) == [False, True, None]
    assert list(checked["expected_route"][:3]) == ["internal", "web", None]
    assert list(checked["reason"][3:]) == [
        "answers must be a list of valid strings",
        "expected_route must be one of internal, web, none (got 'sideways')",
    ]
    numbers = pd.DataFrame({"question_id": list("abcd"), "question": ["q?"] * 4, "input_row": range(4)})
    numbers["is_impossible"] = pd.Series([1, 0, 1.0, 2], dtype=object)  # 0 / 1 as CSV's "0" / "1"
    checked = check_rows(numbers, 10)
    assert list(checked["is_impossible"][:3]) == [True, False, True]
    assert checked.loc[3, "reason"] == "is_impossible must be true or false (got 2)"


def test_a_list_written_out_as_text_is_that_list():
    """CSV holds only text: pandas writes a list column as Python's repr (a numpy array's, when the
    frame was read from Parquet), a hand-made file as JSON. Other text, even in brackets, is one answer."""
    written = {
        "['every 12 months', '12 months']": ["every 12 months", "12 months"],
        "['every 12 months' '12 months']": ["every 12 months", "12 months"],  # numpy's repr
        "['a' 'b'\n 'c']": ["a", "b", "c"],  # a long numpy array, wrapped
        '["a, b", "say \\"c\\""]': ["a, b", 'say "c"'],
        " [] ": [],
        "['a',]": ["a"],
    }
    single = ["12 months", "[citation needed]", "[2, 3]", "['it''s']", "['a', __import__('os')]", "['a' ,'b' 'c']"]
    cells = [*written, *single]
    frame = pd.DataFrame(
        {"question_id": [f"q{i}" for i in range(len(cells))], "question": ["q?"] * len(cells), "answers": cells}
    ).assign(input_row=range(len(cells)))
    checked = check_rows(frame, 10)
    assert checked["reason"].isna().all()
    assert [list(a) for a in checked["answers"]] == [*written.values(), *([c] for c in single)]
    gold_docs = check_rows(frame.assign(gold_doc_ids='["d1", "d2"]').head(1), 10)["gold_doc_ids"]
    assert list(gold_docs[0]) == ["d1", "d2"]


def test_json_python_cannot_convert_is_a_reject_row_not_a_failed_run():
    lines = [
        json.dumps({"question_id": "ok", "question": "fine?"}),
        '{"question_id": "deep", "question": "q?", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"question_id": ' + "9" * 5000 + ', "question": "q?"}',
    ]
    checked = check_rows(pd.DataFrame({"value": lines, "input_row": range(3)}), 100)
    assert checked.loc[0, "reason"] is None
    assert checked.loc[1, "reason"] == "line is not readable JSON: it is nested too deeply"
    assert checked.loc[2, "reason"].startswith("line is not readable JSON (Exceeds the limit (4300 digits)")


def test_an_expected_route_given_as_a_list_is_rejected_whatever_its_length():
    routes = [np.array(["web"]), np.array(["web", "x"]), np.array([], dtype=object), None]
    frame = pd.DataFrame(
        {"question_id": list("abcd"), "question": ["q?"] * 4, "expected_route": routes, "input_row": range(4)}
    )
    reasons = list(check_rows(frame, 10)["reason"])
    assert reasons[:3] == [
        f"expected_route must be one of internal, web, none (got {shown!r})" for shown in (["web"], ["web", "x"], [])
    ]
    assert reasons[3] is None


def test_a_row_no_check_foresaw_is_rejected_alone(monkeypatch):
    import crag.questions

    real = crag.questions.gold_of

    def gold_of(row):
        if row["question_id"] == "odd":
            raise TypeError("unhashable type: 'dict'")
        return real(row)

    monkeypatch.setattr(crag.questions, "gold_of", gold_of)
    checked = _check(["a?", "b?", "c?"], ids=["a", "odd", "c"])
    assert list(checked["reason"].isna()) == [True, False, True]
    assert checked.loc[1, "reason"] == "row could not be checked (TypeError: unhashable type: 'dict')"
    assert checked.loc[1, "input_row"] == 1 and checked.loc[1, "id_problem"]


def test_ask_checks_its_one_question():
    check_one("ask", "Is this fine?", 100)
    with pytest.raises(InputError, match="question is only whitespace"):
        check_one("ask", "   ", 100)


def test_resuming_an_unknown_run_in_a_folder_is_one_line_before_spark(tmp_path, capsys, monkeypatch, index_overrides):
    import crag.job
    from crag.cli import main

    def no_spark(*args, **kwargs):
        raise AssertionError("Spark was started")

    monkeypatch.setattr(crag.job, "get_spark", no_spark)
    code = main(crag_run_args(tmp_path, "--resume", "ghost", overrides=index_overrides))
    assert code == 2
    assert capsys.readouterr().err.strip().endswith(f"crag: error: no run 'ghost' to resume in {tmp_path}")


def test_a_missing_file_is_not_taken_for_a_table_name(tmp_path):
    from crag.questions import _catalog_name

    assert _catalog_name("main.crag.questions") and _catalog_name("crag.questions")
    assert not _catalog_name(str(tmp_path / "questions.jsonl")) and not _catalog_name("questions.jsonl")
    assert not _catalog_name("questions.CSV")
    assert _catalog_name("main.raw.parquet")  # three parts: a catalog's table, whatever its name


def test_a_control_character_in_a_jsonl_line_is_described_once():
    from crag.text import parse_json_line

    assert (
        parse_json_line(b'{"question": "a\x00b"}')[1]
        == "line is not valid JSON (Invalid control character at column 16)"
    )


def test_a_json_line_that_repeats_a_key_is_a_reject_not_its_last_value():
    lines = [
        '{"question_id": "a", "question": "first?", "question": "second?"}',
        '{"question_id": "b", "question": "ok?", "question_id": "c"}',
        '{"question_id": "d", "question": "fine?", "answers": ["x", "x"]}',  # a value repeated is no key repeated
    ]
    checked = check_rows(pd.DataFrame({"value": lines, "input_row": range(3)}), 100)
    assert list(checked["reason"]) == [
        'line repeats the key "question" (JSON would keep only its last value)',
        'line repeats the key "question_id" (JSON would keep only its last value)',
        None,
    ]


def test_csv_records_are_read_strictly_and_a_bad_one_costs_no_other_row():
    from crag.text import csv_records

    text = (
        "question_id,question\r\n"
        'q1,"What is X?\r\n'  # an unterminated quote: it would swallow q2 into its question
        "q2,What is Y?\r\n"
        "\r\n"
        'q3,"a ""quoted"" word",extra\r\n'  # one field more than the header
        'q4,"two\nlines"\n'
        'q5,"open\n'
        'q6,",x\n'  # q5's quote closes here: a record of three fields over two lines
        "q7,last?"
    )
    records = [(r.line, r.fields, r.problem) for r in csv_records(text)]
    assert records == [
        (1, ["question_id", "question"], None),
        (2, None, 'a quoted field goes on after its closing quote (a quote inside a field must be doubled: "")'),
        (3, ["q2", "What is Y?"], None),
        (5, None, "it has 3 fields; the header has 2"),
        (6, ["q4", "two\nlines"], None),
        (8, None, "it has 3 fields; the header has 2"),
        (9, None, "a quoted field is not closed (an unterminated quote)"),  # read again from its second line
        (10, ["q7", "last?"], None),
    ]
