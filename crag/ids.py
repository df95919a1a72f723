"""Ids: what a user may name a run, and what no question or document id may hold."""

from __future__ import annotations

import re
import unicodedata
import uuid
from datetime import UTC, datetime

from crag.errors import InputError

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")


def run_id_or_new(run_id: str | None) -> str:
    """The run id given, checked, or a new one: the time it was made and six random hex digits."""
    if run_id is None:
        return f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"
    return check_run_id(run_id)


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise InputError(
            f"invalid run id {run_id!r}: use 1-128 letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    return run_id


# Ids are keys in every table, printed by `crag ask`, `crag eval` and `crag sql`: control characters (tab
# and newline included), line separators, and the invisible characters that make two ids print alike
# (zero-width space, word joiner, BOM) or reorder a line (bidi controls) have no place in one. The
# joiners and the soft hyphen stay allowed: Persian and Indic names and emoji sequences need them.
_FORBIDDEN_CATEGORIES = ("Cc", "Zl", "Zp")
_INVISIBLE = re.compile("[\u061c\u200b\u200e\u200f\u202a-\u202e\u2060-\u2064\u2066-\u2069\ufeff]")


def forbidden_character(text: str) -> str | None:
    """The first control or invisible character in an id, described with its position; None if none."""
    for position, char in enumerate(text):
        if unicodedata.category(char) in _FORBIDDEN_CATEGORIES or _INVISIBLE.match(char):
            name = unicodedata.name(char, "")
            return (
                f"control or invisible character U+{ord(char):04X}"
                + (f" ({name})" if name else "")
                + f" at position {position}"
            )
    return None
