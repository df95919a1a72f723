"""Ids: what a user may name a run, and what no question or document id may hold."""

from __future__ import annotations

import re
import unicodedata
import uuid
from datetime import UTC, datetime

import regex

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


# Ids are keys in every table, printed by `crag ask`, `crag eval` and `crag sql`: two ids that print alike
# must not be two ids. Unicode's identifier rules are the measure: what NFKC_Casefold (UAX #44, UTS #39's
# skeletons) erases, the Default_Ignorable_Code_Point characters, has no place in one (zero-width spaces
# and joiners, bidi controls, the soft hyphen, variation selectors, the Hangul fillers U+115F, U+1160,
# U+3164 and U+FFA0, tag characters, U+180E), nor control characters, line separators, or any space but
# ' ' (a trailing no-break space prints as nothing). The joiners stay where they shape a word, as
# UAX #31 allows them in identifiers (after a virama; ZWNJ between joining letters, as in Persian) and
# UTS #51 in emoji sequences. Ids that are the same once NFC-normalised are one id (crag.questions).
_FORBIDDEN_CATEGORIES = ("Cc", "Zl", "Zp")
_IGNORABLE = regex.compile(r"\p{Default_Ignorable_Code_Point}")
_SHAPING_JOINER = regex.compile(
    r"(?<=\p{Canonical_Combining_Class=Virama}\p{Mn}*)[\u200c\u200d]"  # UAX #31 A2, B
    r"|(?<=[\p{Joining_Type=Dual_Joining}\p{Joining_Type=Left_Joining}]\p{Joining_Type=Transparent}*)\u200c"
    r"(?=\p{Joining_Type=Transparent}*[\p{Joining_Type=Dual_Joining}\p{Joining_Type=Right_Joining}])"  # A1
    r"|(?<=\p{Extended_Pictographic})\u200d(?=\p{Extended_Pictographic})"  # an emoji ZWJ sequence
)


def forbidden_character(text: str) -> str | None:
    """The first character an id may not hold (see above), described with its position; None if none."""
    for position, char in enumerate(text):
        if unicodedata.category(char) in _FORBIDDEN_CATEGORIES or (
            _IGNORABLE.match(char) and not _SHAPING_JOINER.match(text, position)
        ):
            kind, why = "control or invisible character", ""
        elif char.isspace() and char != " ":
            kind, why = "space character", " (the one space an id may hold is ' ')"
        else:
            continue
        name = unicodedata.name(char, "")
        return f"{kind} U+{ord(char):04X}" + (f" ({name})" if name else "") + f" at position {position}{why}"
    return None


def id_key(text: str) -> str:
    """What two ids are compared by: their NFC form (an é written as e and a combining accent is é)."""
    return unicodedata.normalize("NFC", text)
