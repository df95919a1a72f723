"""crag.console: tables for the terminal (CJK widths, narrow terminals), CSV, JSON Lines, Markdown,
and crag eval's metric x slice table."""

from __future__ import annotations

import csv
import io
import json

import pandas as pd
import pyarrow as pa
import pytest

from crag.console import display_width, fit, render, render_metrics, select_slices, slice_names
from crag.errors import InputError
from tests.support import ANSWER_EN, ANSWER_JA


def columns_upto(line: str, width: int) -> str:
    """The start of the line that takes `width` display columns."""
    out = ""
    for ch in line:
        if display_width(out + ch) > width:
            break
        out += ch
    return out


@pytest.fixture
def frame() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "question_id": ["q-en-01", "q-ja-02", "q-03"],
            "route": ["internal", "web", None],
            "answer": [ANSWER_EN, ANSWER_JA, None],
            "n_retrieved": [10, 3, 0],
            "score": [0.5, 12.345678, float("nan")],
            "sources": [[{"doc_id": "filter", "title": "フィルター"}], [], None],
        }
    )


def test_display_width_counts_wide_and_combining_characters():
    assert display_width("abc") == 3
    assert display_width("日本語") == 6 and display_width("ｶﾀｶﾅ") == 4  # half-width katakana is narrow
    assert display_width("e\u0301") == 1  # e + combining acute accent


@pytest.mark.parametrize(
    "text, width, expected",
    [
        ("日本語テキスト", 5, "日本…"),
        ("日本語テキスト", 6, "日本… "),  # a wide character never straddles the cut: padded instead
        ("日本語テキスト", 7, "日本語…"),
        ("short", 8, "short   "),
        ("exactly8", 8, "exactly8"),
        ("abcdefghij", 4, "abc…"),
    ],
)
def test_fit_cuts_by_display_width(text, width, expected):
    assert fit(text, width) == expected and display_width(fit(text, width)) == width


def test_fit_right_aligns():
    assert fit("42", 5, "right") == "   42"


def test_table_aligns_text_left_and_numbers_right(frame):
    lines = render(frame, "table", width=200).splitlines()
    header, rule, *rows = lines
    assert header.startswith("question_id  route     answer") and len(rows) == 3
    # numbers end at the right edge of their column, which ends where its header does
    end = header.index("n_retrieved") + len("n_retrieved")
    assert [columns_upto(r, end)[-3:] for r in rows] == [" 10", "  3", "  0"]
    assert columns_upto(rows[1], 31) == "q-ja-02      web       富士山は"  # text starts where its header does
    assert "12.345678" in rows[1] and "0.5" in rows[0]
    # one line per row: the line break inside the answer shows as a space
    assert "twelve months. Vacuum the pre-filter" in rows[0]
    assert rows[0].endswith('[{"doc_id":"filter","title":"フィルター"}]')
    assert rows[2].split() == ["q-03", "0"]  # nulls are empty


@pytest.mark.parametrize("width", [30, 40, 60, 80, 100])
def test_table_fits_narrow_terminals_with_cjk_text(frame, width):
    out = render(frame, "table", width=width)
    for line in out.splitlines():
        assert display_width(line) <= width, (width, line)
    assert "…" in out  # the long answers were cut
    for value in ("10", "12.345678", "0.5"):  # numbers are never cut
        assert value in out
    blocks = out.split("\n\n")
    assert all(block.startswith("questi") for block in blocks)  # each block repeats the first column
    for block in blocks:
        assert len(block.splitlines()) == 2 + len(frame)


def test_table_from_arrow_matches_pandas(frame):
    no_nulls = frame.iloc[:2]
    assert render(pa.Table.from_pandas(no_nulls, preserve_index=False), "table", width=70) == render(
        no_nulls, "table", width=70
    )
    arrow = pa.table({"id": ["a", "b"], "n": pa.array([1, None], pa.int64())})
    assert render(arrow, "table", width=40).splitlines() == ["id  n", "--  -", "a   1", "b"]


def test_table_uses_the_terminal_width(frame, monkeypatch):
    monkeypatch.setenv("COLUMNS", "50")
    out = render(frame, "table")
    assert max(display_width(line) for line in out.splitlines()) == 50


def test_csv_round_trips(frame):
    out = render(frame, "csv")
    rows = list(csv.reader(io.StringIO(out)))
    assert rows[0] == list(frame.columns)
    assert rows[1][2] == ANSWER_EN and rows[2][2] == ANSWER_JA  # exact: nothing cut or flattened
    assert rows[2][4] == "12.345678"
    assert json.loads(rows[1][5]) == [{"doc_id": "filter", "title": "フィルター"}]
    assert rows[3] == ["q-03", "", "", "0", "", ""]
    back = pd.read_csv(io.StringIO(out))
    assert back["n_retrieved"].tolist() == [10, 3, 0]


def test_json_is_one_object_per_line(frame):
    records = [json.loads(line) for line in render(frame, "json").splitlines()]
    assert len(records) == 3
    assert records[0]["answer"] == ANSWER_EN and records[0]["sources"] == [{"doc_id": "filter", "title": "フィルター"}]
    assert records[1]["score"] == 12.345678 and records[0]["n_retrieved"] == 10
    assert records[2] == {
        "question_id": "q-03",
        "route": None,
        "answer": None,
        "n_retrieved": 0,
        "score": None,
        "sources": None,
    }
    assert "富士山" in render(frame, "json")  # not \\u-escaped


def test_json_keeps_timestamps_as_iso_text():
    stamp = pd.Timestamp("2026-11-29T14:58:35", tz="UTC")
    assert json.loads(render(pd.DataFrame({"created_at": [stamp]}), "json")) == {
        "created_at": "2026-11-29T14:58:35+00:00"
    }


def test_markdown_table(frame):
    lines = render(frame.assign(route=["a|b", "web", None]), "markdown").splitlines()
    assert lines[0] == "| question_id | route | answer | n_retrieved | score | sources |"
    assert lines[1] == "| --- | --- | --- | ---: | ---: | --- |"
    assert lines[2].startswith("| q-en-01 | a\\|b | Replace the HEPA-13 main filter every twelve months. Vacuum")
    assert ANSWER_JA in lines[3] and len(lines) == 5


@pytest.mark.parametrize("fmt", ["table", "markdown"])
def test_floats_are_shown_whole(fmt):
    """crag sql's table and markdown show each float as the shortest text that reads back as it."""
    values = [1234567.25, 0.1, 1e-7, 2.0**60]
    out = render(pd.DataFrame({"x": values}), fmt, width=80)
    shown = [line.strip("| ") for line in out.splitlines()[2:]]
    assert shown == ["1234567.25", "0.1", "1e-07", "1.152921504606847e+18"]
    assert [float(v) for v in shown] == values


def test_unknown_format():
    with pytest.raises(InputError, match="unknown format 'xml': expected one of table, csv, json, markdown"):
        render(pd.DataFrame({"a": [1]}), "xml")


# ---------------------------------------------------------------- crag eval's metrics


@pytest.fixture
def metrics() -> pd.DataFrame:
    """Rows as crag.evaluation.evaluate writes them: 15 slices besides "all"."""
    slices = [
        "all",
        "language=en",
        "language=ja",
        "route=internal",
        "route=web",
        "route=mixed",
        "route=refused",
        "action=correct",
        "action=ambiguous",
        "action=incorrect",
        "expected_route=internal",
        "expected_route=web",
        "expected_route=none",
        "answerable=yes",
        "answerable=no",
        "route=error",
    ]
    rows = []
    for i, name in enumerate(slices):
        rows.append(("answer_contained", name, 0.5 + i / 100, 10 + i))
        rows.append(("routing_accuracy", name, 1 - i / 200, 10 + i))
        if name != "answerable=no":  # a metric that does not apply to a slice has no row
            rows.append(("recall_at_k", name, i / 16, 5))
    rows.append(("grader_precision", "all", 0.875, 120))
    return pd.DataFrame(rows, columns=["metric", "slice", "value", "n"])


def test_select_slices(metrics):
    assert select_slices(metrics, "language=en,language=ja") == ["language=en", "language=ja"]
    assert select_slices(metrics, "all,language") == ["all", "language=en", "language=ja"]
    assert select_slices(metrics, ["route=web", "route=web"]) == ["route=web"]
    default = select_slices(metrics)
    assert default[0] == "all" and len(default) == 16 and default[1:] == sorted(default[1:])
    with pytest.raises(
        InputError, match=r"unknown slice 'expected_route=unknown': this run has all, action=ambiguous, .*route=web"
    ):
        select_slices(metrics, "expected_route=unknown")  # a slice a run can have, this one has not
    with pytest.raises(InputError, match=r"^unknown slice 'language=fr': language is one of en, ja$"):
        slice_names("language=fr")  # said before a run's metrics are computed
    with pytest.raises(InputError, match=r"^unknown slice 'answerable=true': answerable is one of yes, no$"):
        slice_names("all,answerable=true")
    with pytest.raises(InputError, match=r"unknown slice 'lang=en': a slice is all, or one of route, action, language"):
        slice_names("all,lang=en")  # said before a run's metrics are computed
    with pytest.raises(InputError, match="names no slice"):
        select_slices(metrics, " , ")


def test_metrics_table_for_chosen_slices(metrics):
    lines = render_metrics(metrics, "language=en,language=ja", width=80).splitlines()
    assert lines[0].split() == ["metric", "language=en", "language=ja"]
    assert lines[2].split() == ["answer_contained", "0.510", "0.520"]  # crag.evaluation's metric order
    assert lines[3].split() == ["routing_accuracy", "0.995", "0.990"]
    assert len(lines) == 5  # grader_precision has a value in neither slice: no row


def test_metrics_table_of_every_slice_fits_80_columns(metrics):
    out = render_metrics(metrics, None, width=80)
    assert all(display_width(line) <= 80 for line in out.splitlines())
    blocks = out.split("\n\n")
    assert len(blocks) > 1 and all(b.startswith("metric") for b in blocks)
    headers = [name for b in blocks for name in b.splitlines()[0].split()[1:]]
    assert headers == select_slices(metrics)  # every slice, once, in order
    assert "0.875" in blocks[0]


def test_metrics_as_csv_and_json_are_long_rows_with_counts(metrics):
    rows = list(csv.DictReader(io.StringIO(render_metrics(metrics, "language=ja,all", fmt="csv"))))
    assert [(r["metric"], r["slice"]) for r in rows] == [
        ("answer_contained", "language=ja"),
        ("answer_contained", "all"),
        ("routing_accuracy", "language=ja"),
        ("routing_accuracy", "all"),
        ("recall_at_k", "language=ja"),
        ("recall_at_k", "all"),
        ("grader_precision", "all"),
    ]
    assert rows[0]["n"] == "12" and float(rows[0]["value"]) == pytest.approx(0.52)
    records = [json.loads(line) for line in render_metrics(metrics, "all", fmt="json").splitlines()]
    assert records[-1] == {"metric": "grader_precision", "slice": "all", "value": 0.875, "n": 120}


def test_metrics_markdown(metrics):
    lines = render_metrics(metrics, "all,answerable=no", fmt="markdown").splitlines()
    assert lines[0] == "| metric | all | answerable=no |" and lines[1] == "| --- | ---: | ---: |"
    assert "| recall_at_k | 0.000 | - |" in lines


@pytest.mark.parametrize("fmt", ["table", "markdown", "json"])
def test_bidi_controls_in_a_value_are_escapes_not_a_reordered_line(fmt):
    """`crag sql --format table` printed a right-to-left override raw: the rest of the line read backwards."""
    value = "txt\u202egpj.exe and \u2067isolated\u2069 \u200fmark"
    out = render(pd.DataFrame({"name": [value], "n": [1]}), fmt, width=200)
    assert not any(c in out for c in "\u202e\u2067\u2069\u200f"), out
    assert "\\u202e" in out and "\\u2067" in out and "\\u200f" in out
    if fmt == "json":  # the escape is JSON's: the same value
        assert json.loads(out)["name"] == value


def test_csv_keeps_values_exact():
    value = "txt\u202egpj.exe"
    assert render(pd.DataFrame({"name": [value]}), "csv") == f"name\n{value}"
