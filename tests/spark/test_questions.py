"""The question table read and validated by Spark: every format, row numbers, repeated ids, text
read as text, and every input row accounted for."""

import csv
import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from crag.errors import InputError
from crag.questions import read_questions, validate


def _validated(spark, path, max_chars=100) -> pd.DataFrame:
    return (
        validate(spark, read_questions(spark, str(path)), max_chars, str(path))
        .toPandas()
        .sort_values("input_row")
        .reset_index(drop=True)
    )


def test_every_format_reads_the_same_rows(spark, tmp_path):
    from deltalake import write_deltalake

    df = pd.DataFrame({"question_id": ["a", "b"], "question": ["one?", "two?"]})
    df.to_json(tmp_path / "q.jsonl", orient="records", lines=True)
    df.to_parquet(tmp_path / "q.parquet")
    df.to_csv(tmp_path / "q.csv", index=False)
    write_deltalake(str(tmp_path / "delta"), df)
    for name in ("q.jsonl", "q.parquet", "q.csv", "delta"):
        out = _validated(spark, tmp_path / name)
        assert list(out["question"]) == ["one?", "two?"] and out["reason"].isna().all(), name
        assert list(out["input_row"]) == [0, 1], name


def test_gold_lists_survive_a_csv_file(spark, tmp_path):
    """A CSV cell is text: a list column pandas wrote (from lists or numpy arrays), or a JSON array, is
    read back as the list."""
    answers = [["every 12 months", "12 months"], ["a, b", 'say "c"']]
    frame = pd.DataFrame({"question_id": ["a", "b"], "question": ["one?", "two?"], "answers": answers})
    frame.to_csv(tmp_path / "pandas.csv", index=False)
    with open(tmp_path / "json.csv", "w", newline="") as f:
        csv.writer(f).writerows(
            [("question_id", "question", "answers")] + [(q, "q?", json.dumps(a)) for q, a in zip("ab", answers)]
        )
    frame.to_parquet(tmp_path / "q.parquet")
    pd.read_parquet(tmp_path / "q.parquet").to_csv(tmp_path / "numpy.csv", index=False)  # lists as numpy arrays
    for name in ("pandas.csv", "json.csv", "numpy.csv"):
        out = _validated(spark, tmp_path / name)
        assert out["reason"].isna().all() and [list(a) for a in out["answers"]] == answers, name


def test_a_parquet_file_is_read_for_its_question_and_gold_columns_only(spark, tmp_path):
    """pandas writes datetimes as nanosecond timestamps, a Parquet type Spark refuses: a column crag does
    not read must not make the file unreadable."""
    pd.DataFrame(
        {
            "question_id": [1, 2],
            "question": ["one?", "two?"],
            "expected_route": ["web", None],
            "created": pd.to_datetime(["2024-01-01", "2024-01-02"]),
        }
    ).to_parquet(tmp_path / "q.parquet")
    out = _validated(spark, tmp_path / "q.parquet")
    assert list(out["question_id"]) == ["1", "2"] and list(out["expected_route"]) == ["web", None]
    assert out["reason"].isna().all()
    # unsigned ids as Spark reads them (uint64: a decimal), a categorical question, beside the timestamps
    pq.write_table(
        pa.table(
            {
                "question_id": pa.array([7, 8], pa.uint64()),
                "question": pa.array(["one?", "two?"]).dictionary_encode(),
                "created": pa.array([0, 1], pa.timestamp("ns")),
            }
        ),
        tmp_path / "u.parquet",
    )
    out = _validated(spark, tmp_path / "u.parquet")
    assert list(out["question_id"]) == ["7", "8"] and list(out["question"]) == ["one?", "two?"]
    # a column crag reads, of a type Spark refuses: said before the run starts, naming the column
    pq.write_table(
        pa.table({"question_id": ["q1"], "question": ["a?"], "answers": pa.array([1], pa.timestamp("ns"))}),
        tmp_path / "bad.parquet",
    )
    with pytest.raises(InputError, match="column answers is timestamp\\[ns\\], which Spark does not read"):
        read_questions(spark, str(tmp_path / "bad.parquet"))


def test_rows_are_numbered_in_input_order_across_partitions(spark, tmp_path):
    rows = [{"question_id": f"q{i:05d}", "question": f"question {i}?"} for i in range(3000)]
    path = tmp_path / "many.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    raw = read_questions(spark, str(path)).repartition(3)  # rows spread over partitions
    out = validate(spark, raw, 100, "the test's table").toPandas()
    assert sorted(out["input_row"]) == list(range(3000))
    assert out["reason"].isna().all()


def test_a_file_read_in_more_splits_than_a_batch_has_tasks_keeps_its_row_numbers(spark, tmp_path):
    """The checks run in at most `tasks` partitions (crag.job: no more Python workers than a batch's
    tasks), the file's splits merged: each row keeps the number of its line."""
    rows = [{"question_id": f"q{i:05d}", "question": f"question {i}?"} for i in range(3000)]
    path = tmp_path / "many.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    previous = spark.conf.get("spark.sql.files.maxPartitionBytes")
    spark.conf.set("spark.sql.files.maxPartitionBytes", "20000")  # about ten splits of the file
    try:
        raw = read_questions(spark, str(path))
        assert raw.rdd.getNumPartitions() > 4
        merged = validate(spark, raw, 100, "many.jsonl", tasks=2).toPandas()
        split = validate(spark, raw, 100, "many.jsonl").toPandas()
    finally:
        spark.conf.set("spark.sql.files.maxPartitionBytes", previous)
    assert (merged["question_id"] == merged["input_row"].map(lambda i: f"q{i:05d}")).all()
    assert sorted(merged["input_row"]) == list(range(3000))
    columns = ["input_row", "question_id", "question", "reason"]
    pd.testing.assert_frame_equal(
        merged.sort_values("input_row")[columns].reset_index(drop=True),
        split.sort_values("input_row")[columns].reset_index(drop=True),
    )


def test_duplicates_keep_the_first_and_every_row_is_accounted_for(spark, tmp_path):
    rows = [
        {"question_id": "x", "question": "a?"},
        {"question_id": "y", "question": "b?"},
        {"question_id": "x", "question": "c?"},
        {"question_id": "z", "question": ""},
        {"question_id": "x", "question": "d?"},
        # the id's first row is rejected for itself: the next good row is the one kept
        {"question_id": "w", "question": ""},
        {"question_id": "w", "question": "e?"},
        {"question_id": "w", "question": "f?"},
    ]
    path = tmp_path / "dup.jsonl"
    path.write_text("\n\n".join(json.dumps(r) for r in rows) + "\n")  # blank lines are not rows
    out = _validated(spark, path)
    assert len(out) == len(rows)
    assert list(out["reason"]) == [
        None,
        None,
        "duplicate question_id 'x': first seen at input row 0",
        "question is empty",
        "duplicate question_id 'x': first seen at input row 0",
        "question is empty",
        None,
        "duplicate question_id 'w': first seen at input row 6",
    ]
    assert list(out.loc[out["reason"].isna(), "question"]) == ["a?", "b?", "e?"]


def test_csv_ids_and_questions_are_text(spark, tmp_path):
    path = tmp_path / "q.csv"
    path.write_text("question_id,question\n001,NA\n007,null\n1,2024-01-01\n2026-11-29,plain?\n", encoding="utf-8")
    out = _validated(spark, path)
    assert list(out["question_id"]) == ["001", "007", "1", "2026-11-29"]
    assert list(out["question"]) == ["NA", "null", "2024-01-01", "plain?"]
    assert out["reason"].isna().all()


def test_one_bad_line_is_one_reject_row(spark, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        b'{"question_id": "a", "question": "fine?"}\n{"question_id": "b", "question": "caf\xe9"}\n'
        b'{"question_id": "c"\n{"question_id": "d", "question": "\\ud800 lone"}\n'
    )
    out = _validated(spark, path)
    assert out.loc[0, "reason"] is None
    assert out.loc[1, "reason"] == "line is not valid UTF-8"
    assert out.loc[2, "reason"].startswith("line is not valid JSON")
    assert out.loc[3, "reason"].startswith("question is not valid text") and out.loc[3, "question_id"] == "d"


def test_unreadable_inputs_are_one_line_errors(spark, tmp_path):
    with pytest.raises(InputError, match="questions not found"):
        read_questions(spark, str(tmp_path / "missing.jsonl"))
    (tmp_path / "q.txt").write_text("hi")
    with pytest.raises(InputError, match="unsupported questions file"):
        read_questions(spark, str(tmp_path / "q.txt"))
    (tmp_path / "folder").mkdir()
    with pytest.raises(InputError, match="not a Delta table"):
        read_questions(spark, str(tmp_path / "folder"))
    (tmp_path / "empty_log" / "_delta_log").mkdir(parents=True)
    with pytest.raises(InputError, match="holds no commit"):
        read_questions(spark, str(tmp_path / "empty_log"))
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(InputError, match="empty"):
        read_questions(spark, str(tmp_path / "empty.parquet"))
    (tmp_path / "corrupt.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match="cannot read questions"):
        validate(spark, read_questions(spark, str(tmp_path / "corrupt.parquet")), 100, "corrupt.parquet").collect()
    pd.DataFrame({"question_id": ["a"], "text": ["?"]}).to_parquet(tmp_path / "cols.parquet")
    with pytest.raises(InputError, match=r"lack column\(s\) question \(found: question_id, text\)"):
        read_questions(spark, str(tmp_path / "cols.parquet"))
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(InputError, match="no rows"):
        validate(spark, read_questions(spark, str(tmp_path / "blank.jsonl")), 100, "blank.jsonl")


@pytest.mark.parametrize("name", ["batch[1].jsonl", "b{1,2}.csv", "x*y?.parquet", "back\\slash.jsonl"])
def test_a_file_name_with_glob_characters_reads_that_file_alone(spark, tmp_path, name):
    """Spark's readers expand glob patterns: batch[1].jsonl must not read batch1.jsonl (nor b{1,2}
    b1 and b2) in its place."""
    named = pd.DataFrame({"question_id": ["named"], "question": ["the file that was named?"]})
    other = pd.DataFrame({"question_id": ["other"], "question": ["a file it matches as a pattern?"]})
    for frame, file in (
        (named, tmp_path / name),
        *((other, tmp_path / f) for f in ("batch1.jsonl", "b1.csv", "b2.csv", "xay!.parquet", "xzy1.parquet")),
    ):
        if file.suffix == ".jsonl":
            frame.to_json(file, orient="records", lines=True)
        elif file.suffix == ".csv":
            frame.to_csv(file, index=False)
        else:
            frame.to_parquet(file)
    assert list(_validated(spark, tmp_path / name)["question_id"]) == ["named"]


def test_a_file_name_with_a_colon_is_one_line(spark, tmp_path):
    path = tmp_path / "q:1.jsonl"
    path.write_text(json.dumps({"question_id": "a", "question": "one?"}) + "\n")
    with pytest.raises(InputError, match=r"Spark cannot read a file whose name holds ':'.*rename or copy"):
        read_questions(spark, str(path))


def test_a_malformed_csv_row_is_a_reject_row_that_names_its_line_and_costs_no_other(spark, tmp_path):
    """Spark's CSV reader let an unterminated quote swallow the next row into its question, and
    answered a row with more fields than the header without its extra fields."""
    path = tmp_path / "q.csv"
    path.write_text(
        'question_id,question\nq1,"What is X?\nq2,What is Y?\nq3,What is Z?,extra\nq4,"multi\nline?"\nq5,fine?\n',
        encoding="utf-8",
    )
    out = _validated(spark, path)
    assert list(out["input_row"]) == [0, 1, 2, 3, 4]
    assert list(out["reason"]) == [
        'CSV line 2: a quoted field goes on after its closing quote (a quote inside a field must be doubled: "")',
        None,
        "CSV line 4: it has 3 fields; the header has 2",
        None,
        None,
    ]
    assert out.loc[0, "question"] == 'q1,"What is X?'  # the line, for the reject row
    accepted = out[out["reason"].isna()]
    assert list(accepted["question_id"]) == ["q2", "q4", "q5"]
    assert list(accepted["question"]) == ["What is Y?", "multi\nline?", "fine?"]


def test_ids_that_are_one_id_in_nfc_are_duplicates(spark, tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [("caf\u00e9", "composed?"), ("cafe\u0301", "decomposed?"), ("cafe", "other?")]
    path.write_text("".join(json.dumps({"question_id": i, "question": q}) + "\n" for i, q in rows), encoding="utf-8")
    out = _validated(spark, path)
    assert list(out["reason"]) == [
        None,
        "duplicate question_id 'cafe\u0301', spelt otherwise (the same id in NFC): first seen at input row 0",
        None,
    ]
