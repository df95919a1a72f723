"""Reading what a model said. Models wrap JSON in prose or code fences, answer "Yes." instead of JSON,
change case or add keys; each parser says whether the output was as asked (ok), had to be repaired, or
could not be read (failed) — a failed parse is its own state, never silently a "no"."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

BINARY_KEYS = ("grade", "score", "binary_score", "relevant", "relevance", "answer")
_YES = {"yes", "y", "true", "relevant", "1"}
_NO = {"no", "n", "false", "irrelevant", "not relevant", "0"}
_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S | re.I)
_OBJECT = re.compile(r"\{[^{}]*\}", re.S)
_LEADING_WORD = re.compile(r"^\W*(yes|no|true|false|relevant|irrelevant)\b", re.I)
_SCORE = re.compile(r"score\W{0,3}\s*(\d+(?:\.\d+)?)\s*(?:/\s*5)?", re.I)
_REASON = re.compile(r"reason\W{0,3}\s*(.+)", re.I)


@dataclass(frozen=True)
class Parsed:
    relevance: float | None  # None: unreadable
    status: str  # "ok" | "repaired" | "failed"
    rationale: str | None = None


def _word_to_bool(value) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value > 0
    if isinstance(value, str):
        word = value.strip().strip(".!").lower()
        if word in _YES:
            return True
        if word in _NO:
            return False
    return None


def _from_object(obj) -> tuple[bool | None, str | None]:
    if not isinstance(obj, dict):
        return None, None
    lowered = {str(k).lower(): v for k, v in obj.items()}
    reason = next((str(lowered[k]) for k in ("reason", "rationale", "explanation") if k in lowered), None)
    for key in BINARY_KEYS:
        if key in lowered:
            return _word_to_bool(lowered[key]), reason
    return None, reason


def _json_candidates(text: str) -> list[str]:
    return [m.group(1) for m in _FENCE.finditer(text)] + _OBJECT.findall(text)


def parse_binary(text: str) -> Parsed:
    """{"grade": "yes"|"no"} as asked -> ok; inside prose or fences, other keys or case, or a bare
    "Yes." -> repaired; anything else -> failed."""
    stripped = (text or "").strip()
    try:
        obj = json.loads(stripped)
    except json.JSONDecodeError:
        obj = None
    if obj in ({"grade": "yes"}, {"grade": "no"}):
        return Parsed(1.0 if obj["grade"] == "yes" else 0.0, "ok")
    value, reason = _from_object(obj)
    if value is not None:
        return Parsed(1.0 if value else 0.0, "repaired", reason)
    for candidate in _json_candidates(stripped):
        try:
            value, reason = _from_object(json.loads(candidate.strip()))
        except json.JSONDecodeError:
            continue
        if value is not None:
            return Parsed(1.0 if value else 0.0, "repaired", reason)
    word = _LEADING_WORD.match(stripped)
    if word:
        return Parsed(1.0 if _word_to_bool(word.group(1)) else 0.0, "repaired")
    return Parsed(None, "failed")


def parse_score(text: str) -> Parsed:
    """ "Score: N" (0-5) and "Reason: ..." lines as asked -> ok, relevance N/5; a score inside JSON or
    prose -> repaired; none, or out of range -> failed."""
    stripped = (text or "").strip()
    lines = [line.strip() for line in stripped.splitlines() if line.strip()]
    if lines and re.fullmatch(r"Score:\s*[0-5]", lines[0]) and (len(lines) == 1 or lines[1].startswith("Reason:")):
        reason = lines[1][len("Reason:") :].strip() if len(lines) > 1 else None
        return Parsed(int(lines[0].split(":")[1]) / 5, "ok", reason)
    for candidate in _json_candidates(stripped):
        try:
            obj = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        lowered = {str(k).lower(): v for k, v in obj.items()} if isinstance(obj, dict) else {}
        score = lowered.get("score")
        if isinstance(score, (int, float)) and 0 <= score <= 5:
            reason = lowered.get("reason")
            return Parsed(float(score) / 5, "repaired", str(reason) if reason is not None else None)
    match = _SCORE.search(stripped)
    if match and 0 <= float(match.group(1)) <= 5:
        found = _REASON.search(stripped)
        return Parsed(float(match.group(1)) / 5, "repaired", found.group(1).strip() if found else None)
    return Parsed(None, "failed")


_CITATION = re.compile(r"\s*\[(\d+)\]")


def parse_answer(text: str, refusal: str, n_documents: int) -> tuple[str | None, list[int]]:
    """(answer without [n] markers, cited document positions). None when the model gave the refusal
    sentence. With no readable citation, every context document counts as cited."""
    stripped = (text or "").strip()
    if not stripped or _normalise(stripped).startswith(_normalise(refusal)):
        return None, []
    cited = sorted({int(n) - 1 for n in _CITATION.findall(stripped) if 0 < int(n) <= n_documents})
    answer = _CITATION.sub("", stripped).strip()
    return answer, cited or list(range(n_documents))


def parse_yes_no(text: str) -> bool | None:
    word = _LEADING_WORD.match((text or "").strip())
    return _word_to_bool(word.group(1)) if word else None


def clean_query(text: str) -> str:
    """A rewritten query without the quotes, labels or JSON a model may wrap it in."""
    stripped = (text or "").strip()
    try:
        obj = json.loads(stripped)
        if isinstance(obj, dict):
            stripped = str(next(iter(obj.values()), ""))
    except json.JSONDecodeError:
        pass
    first = stripped.splitlines()[0] if stripped else ""
    first = re.sub(r"^(search query|query|improved query)\s*:\s*", "", first, flags=re.I)
    return first.strip().strip("\"'`").strip()


def _normalise(text: str) -> str:
    return re.sub(r"\W+", " ", text).strip().lower()
