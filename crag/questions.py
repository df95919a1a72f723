"""The first stage: validate the question table. Every input row ends up either accepted or as a reject
row with a readable reason, never dropped."""

from __future__ import annotations

import re
import unicodedata

import numpy as np
import pandas as pd

from crag.errors import InputError

REQUIRED = ("question_id", "question")
# Optional columns that say what the right outcome is, for `crag eval`.
GOLD_COLUMNS = ("answers", "is_impossible", "expected_route", "gold_doc_ids")
# C0/C1 control characters except tab, newline and carriage return, which are ordinary whitespace.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def _is_missing(value) -> bool:
    return value is None or (isinstance(value, float) and value != value) or value is pd.NA


def _id_text(value) -> str | None:
    """Ids may arrive as strings or integers (CSV, Parquet); both become strings. Floats that hold an
    integer (a CSV column with gaps) lose their ".0"."""
    if _is_missing(value):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        text = str(value).strip()
        return text or None
    return None


def _problem(question, max_chars: int) -> str | None:
    if _is_missing(question):
        return "question is missing (null)"
    if not isinstance(question, str):
        return f"question is not text (got {type(question).__name__})"
    if question == "":
        return "question is empty"
    if not question.strip():
        return "question is only whitespace"
    if len(question) > max_chars:
        return f"question is {len(question)} characters; the limit is {max_chars} (input.max_question_chars)"
    control = _CONTROL.search(question)
    if control:
        char = control.group(0)
        return f"question contains control character U+{ord(char):04X} ({unicodedata.name(char, 'unnamed')}) at position {control.start()}"
    return None


EXPECTED_ROUTES = ("internal", "web", "none")
_TRUE, _FALSE = {"true", "1", "yes"}, {"false", "0", "no", ""}


def _string_list(value, column: str):
    """Gold lists: a list of strings, one string, or null (= empty)."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple, np.ndarray)):
        if _is_missing(value):
            return []
        shown = value.item() if isinstance(value, np.generic) else value
        raise ValueError(f"{column} must be a list of strings (got {shown!r})")
    if not all(isinstance(v, str) for v in value):
        raise ValueError(f"{column} must be a list of strings")
    return list(value)


def _gold(row: dict, columns) -> dict:
    """The gold columns of one row, normalised; ValueError names the bad one."""
    gold = {}
    if "answers" in columns:
        gold["answers"] = _string_list(row["answers"], "answers")
    if "gold_doc_ids" in columns:
        gold["gold_doc_ids"] = _string_list(row["gold_doc_ids"], "gold_doc_ids")
    if "is_impossible" in columns:
        value = row["is_impossible"]
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            value = value.strip().lower() in _TRUE
        elif _is_missing(value):
            value = None
        elif not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"is_impossible must be true or false (got {value!r})")
        gold["is_impossible"] = None if value is None else bool(value)
    if "expected_route" in columns:
        value = row["expected_route"]
        if _is_missing(value):
            value = None
        elif value not in EXPECTED_ROUTES:
            raise ValueError(f"expected_route must be one of {', '.join(EXPECTED_ROUTES)} (got {value!r})")
        gold["expected_route"] = value
    return gold


def validate_questions(raw: pd.DataFrame, max_chars: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(accepted, rejects). accepted has question_id (str) and question plus every other input column;
    rejects has question_id, question, input_row (0-based) and reason. Of rows sharing a question_id
    the first is kept and the later ones are rejected."""
    missing = [c for c in REQUIRED if c not in raw.columns]
    if missing:
        found = ", ".join(map(str, raw.columns)) or "none"
        raise InputError(f"questions lack column(s) {', '.join(missing)} (found: {found})")
    if raw.empty:
        raise InputError("the questions table has no rows")
    first_row: dict[str, int] = {}
    accepted_rows, rejects = [], []
    gold_columns = [c for c in GOLD_COLUMNS if c in raw.columns]
    gold_rows: dict[int, dict] = {}
    for i, (qid_raw, question) in enumerate(zip(raw["question_id"], raw["question"])):
        qid = _id_text(qid_raw)
        reason = None
        if qid is None:
            reason = "question_id is missing" if _is_missing(qid_raw) or str(qid_raw).strip() == "" else f"question_id is not text or an integer (got {type(qid_raw).__name__})"
        elif qid in first_row:
            reason = f"duplicate question_id {qid!r}: first seen at input row {first_row[qid]}"
        else:
            first_row[qid] = i
            reason = _problem(question, max_chars)
            if reason is None and gold_columns:
                try:
                    gold_rows[i] = _gold(raw.iloc[i], gold_columns)
                except ValueError as exc:
                    reason = str(exc)
        if reason:
            rejects.append(
                {"question_id": qid, "question": question if isinstance(question, str) else None, "input_row": i, "reason": reason}
            )
        else:
            accepted_rows.append(i)
    accepted = raw.iloc[accepted_rows].copy()
    accepted["question_id"] = [_id_text(v) for v in accepted["question_id"]]
    for column in gold_columns:
        accepted[column] = [gold_rows[i][column] for i in accepted_rows]
    accepted = accepted.reset_index(drop=True)
    rejected = pd.DataFrame(rejects, columns=["question_id", "question", "input_row", "reason"])
    return accepted, rejected
