"""Reading what a model said. Models wrap JSON in prose or code fences, answer "Yes." instead of JSON,
change case or add keys; each parser says whether the output was as asked (ok), had to be repaired, or
could not be read (failed) — a failed parse is its own state, never silently a "no"."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

# Part of the stage cache's key for the model roles (crag.cache.role_slices): raise it when these
# parsers read a model's output differently, so that results read the old way are not reused.
READING_VERSION = 4

BINARY_KEYS = ("grade", "score", "binary_score", "relevant", "relevance", "answer")
_YES = {"yes", "y", "true", "relevant", "1"}
_NO = {"no", "n", "false", "irrelevant", "not relevant", "0"}
_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S | re.I)
_OBJECT = re.compile(r"\{[^{}]*\}", re.S)
_LEADING_WORD = re.compile(r"^\W*(yes|no|true|false|relevant|irrelevant)\b", re.I)
# "Score: 4", "score (0-5): 4", "**Score:** 4", "Score：4", "score: 3/5"; not a negative number
# ("Score: -4", also with a Unicode minus), nor one of another scale ("3/10", "3 out of 10", "3 (of 10)") or a range
# ("score 0-5")
_NUMBER = r"(?<![-\u2212\ufe63\uff0d])(\d+(?:\.\d+)?)(?!\.?\d)"
_NOT_OF_THIS_SCALE = r"(?!\s*\(?\s*(?:/|(?:out\s+)?of)\s*(?!5(?!\d))\d|\s*[-\u2013]\s*\d)"
_SCORE = re.compile(r"score(?:\s*\([^)]*\))?\W{0,6}?" + _NUMBER + _NOT_OF_THIS_SCALE, re.I)
# a line that gives the score ("**Score:** 4", "- Score: 4"; a JSON key, "score": 4, is read as JSON)
_SCORE_LINE = re.compile(r'^[^\w\n{"]*' + _SCORE.pattern, re.I | re.M)
_REASON = re.compile(r"reason[^\w\n]{0,6}(.+)", re.I)


def content_text(content) -> str:
    """A chat message's text. Some models (gpt-oss) give the content as a list of blocks, the text in
    those of type "text", whether the client hands them over as dicts or as objects."""
    if isinstance(content, list):

        def field(block, name: str):
            return block.get(name) if isinstance(block, dict) else getattr(block, name, None)

        return "".join(str(field(b, "text") or "") for b in content if field(b, "type") == "text")
    return content or ""


# Reasoning models (Qwen3, DeepSeek-R1, served by vLLM, SGLang or Ollama) think aloud before they
# answer, in a block that opens the reply. Some chat templates put the opening tag in the prompt, so
# the reply starts with the reasoning and only its closing tag shows, alone at the end of a line.
_REASONING_TAGS = "think|thinking|reasoning"
_REASONING_OPEN = re.compile(rf"\s*<({_REASONING_TAGS})>", re.I)
_REASONING_ANY_OPEN = re.compile(rf"<(?:{_REASONING_TAGS})>", re.I)
_REASONING_CLOSE_LINE = re.compile(rf"</(?:{_REASONING_TAGS})>[ \t]*(?:\n|$)", re.I)


def reasoning_split(text: str | None) -> str | None:
    """The reply without the reasoning block that opens it; None when the reply ends inside that block
    (max_tokens ran out while the model was still thinking: it gave no answer). A tag further on (an
    answer or a grade's reason that mentions `<think>`) is text like any other."""
    text = text or ""
    opened = _REASONING_OPEN.match(text)
    if opened:
        closed = re.search(rf"</{opened.group(1)}>", text[opened.end() :], re.I)
        # open and never closed: max_tokens ran out while the model was thinking (an answer that begins
        # with the tag itself, unclosed, is read the same way: far rarer than a cut-off reply)
        return text[opened.end() + closed.end() :].strip() if closed else None
    closed = _REASONING_CLOSE_LINE.search(text)
    if closed and not _REASONING_ANY_OPEN.search(text, 0, closed.start()):
        return text[closed.end() :].strip()
    return text.strip()


def visible(text: str | None) -> str:
    """What a model answered, without its reasoning ("" when it gave no answer: see reasoning_split)."""
    return reasoning_split(text) or ""


@dataclass(frozen=True)
class Parsed:
    relevance: float | None  # None: unreadable
    status: str  # "ok" | "repaired" | "failed"
    rationale: str | None = None


def _word_to_bool(value) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        value = value.strip().strip(".!").lower()
        if value in _YES:
            return True
        if value in _NO:
            return False
    number = _number(value)
    return None if number is None else number >= 0.5  # 1 / 0, or a relevance such as 0.2


def _number(value) -> float | None:
    """A finite number, also when written as a string ("4", "0.8")."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _from_object(obj) -> tuple[bool | None, str | None]:
    if not isinstance(obj, dict):
        return None, None
    lowered = {str(k).lower(): v for k, v in obj.items()}
    reason = next((str(lowered[k]) for k in ("reason", "rationale", "explanation") if k in lowered), None)
    for key in BINARY_KEYS:
        if key in lowered:
            return _word_to_bool(lowered[key]), reason
    return None, reason


def _json_values(text: str) -> list:
    """Every JSON value in a reply's code fences, and every JSON object in its prose."""
    values = []
    for candidate in [m.group(1) for m in _FENCE.finditer(text)] + _OBJECT.findall(text):
        try:
            values.append(json.loads(candidate.strip()))
        except json.JSONDecodeError:
            continue
    return values


def _agreed(readings: list[tuple[float, str | None]]) -> Parsed:
    """The relevance all of a reply's readings of one kind give (repaired), or failed when they disagree
    (or one is out of range): a model may quote the document's own verdict ("it grades itself
    {"grade": "yes"}") beside its own, and which is which cannot be told."""
    relevances = {relevance for relevance, _ in readings}
    if len(relevances) != 1 or not 0 <= readings[0][0] <= 1:
        return Parsed(None, "failed")
    reason = next((reason for _, reason in readings if reason is not None), None)
    return Parsed(readings[0][0], "repaired", reason)


def parse_binary(text: str) -> Parsed:
    """{"grade": "yes"|"no"} as asked -> ok; inside prose or fences, other keys or case, or a bare
    "Yes." -> repaired; verdicts that disagree, or none -> failed. Reasoning before the answer is left
    out (`visible`)."""
    stripped = visible(text)
    try:
        obj = json.loads(stripped)
    except json.JSONDecodeError:
        obj = None
    if obj in ({"grade": "yes"}, {"grade": "no"}):
        return Parsed(1.0 if obj["grade"] == "yes" else 0.0, "ok")
    value, reason = _from_object(obj)
    if value is not None:
        return Parsed(1.0 if value else 0.0, "repaired", reason)
    verdicts = [(1.0 if v else 0.0, r) for v, r in map(_from_object, _json_values(stripped)) if v is not None]
    if verdicts:
        return _agreed(verdicts)
    word = _LEADING_WORD.match(stripped)
    if word:
        return Parsed(1.0 if _word_to_bool(word.group(1)) else 0.0, "repaired")
    return Parsed(None, "failed")


def parse_score(text: str) -> Parsed:
    """ "Score: N" (0-5) and "Reason: ..." lines as asked, or {"score": N, "reason": "..."} as
    structured output asks -> ok, relevance N/5; a score elsewhere -> repaired, read from the first of
    these that gives one: lines that start with a score, JSON, prose. None, scores of one kind that
    disagree, or one out of range -> failed."""
    stripped = visible(text)
    structured = _structured_score(stripped)
    if structured is not None:
        return structured
    lines = [line.strip() for line in stripped.splitlines() if line.strip()]
    if lines and re.fullmatch(r"Score:\s*[0-5]", lines[0]) and (len(lines) == 1 or lines[1].startswith("Reason:")):
        reason = lines[1][len("Reason:") :].strip() if len(lines) > 1 else None
        return Parsed(int(lines[0].split(":")[1]) / 5, "ok", reason)
    for readings in (_scores_in(_SCORE_LINE, stripped), _json_scores(stripped), _scores_in(_SCORE, stripped)):
        if readings:
            return _agreed(readings)
    return Parsed(None, "failed")


def _structured_score(text: str) -> Parsed | None:
    """The reply as the score format's JSON schema has it (crag.backends.llm_roles.SCORE_SCHEMA)."""
    try:
        obj = json.loads(text, strict=False)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or set(obj) != {"score", "reason"}:
        return None
    score = obj["score"]
    if isinstance(score, bool) or not isinstance(score, int) or not 0 <= score <= 5:
        return None
    return Parsed(score / 5, "ok", str(obj["reason"]))


def _scores_in(pattern: re.Pattern, text: str) -> list[tuple[float, str | None]]:
    """(relevance, the reply's "Reason:") for each score the pattern finds."""
    found = _REASON.search(text)
    reason = found.group(1).strip(" *_") if found else None
    return [(float(m.group(1)) / 5, reason) for m in pattern.finditer(text)]


def _json_scores(text: str) -> list[tuple[float, str | None]]:
    """(relevance, reason) for each JSON object in the reply that gives a score."""
    readings = []
    for obj in _json_values(text):
        lowered = {str(k).lower(): v for k, v in obj.items()} if isinstance(obj, dict) else {}
        score = _number(lowered.get("score"))
        if score is not None:
            reason = lowered.get("reason")
            readings.append((score / 5, None if reason is None else str(reason)))
    return readings


_CITATION = re.compile(r"\s*\[(\d+)\]")


def parse_answer(text: str, refusal: str, n_documents: int) -> tuple[str | None, list[int]]:
    """(answer without [n] markers, cited document positions). None when the model refused: the reply
    starts with the refusal sentence, or holds it and cites no document. A reply without [n] markers
    counts as citing every context document; markers that name none of them cite none. A reply that
    ended while the model was still reasoning is an error (ValueError), not a refusal."""
    stripped = reasoning_split(text)
    if stripped is None:
        raise ValueError("the model's reply ended while it was still reasoning: raise generator.max_tokens")
    markers = [int(n) for n in _CITATION.findall(stripped)]
    cited = sorted({n - 1 for n in markers if 0 < n <= n_documents})
    if not stripped or _refuses(stripped, refusal, cited):
        return None, []
    return _CITATION.sub("", stripped).strip(), cited if markers else list(range(n_documents))


def _refuses(reply: str, refusal: str, cited: list[int]) -> bool:
    """Whether a reply starts with the refusal sentence, or holds it and cites no document (a model may
    lead into it: "Based on the documents: I don't know...")."""
    said, refusal = _normalise(reply), _normalise(refusal)
    return said.startswith(refusal) or (not cited and f" {refusal} " in f" {said} ")


def parse_yes_no(text: str) -> bool | None:
    """A leading YES or NO, also as the one value of a JSON object ({"verdict": "YES"}, as structured
    output asks); None when the reply gives neither."""
    stripped = visible(text)
    try:
        obj = json.loads(stripped, strict=False)
    except json.JSONDecodeError:
        obj = None
    if isinstance(obj, dict) and len(obj) == 1:
        stripped = str(next(iter(obj.values())))
    word = _LEADING_WORD.match(stripped)
    return _word_to_bool(word.group(1)) if word else None


def clean_query(text: str) -> str:
    """A rewritten query without the reasoning, quotes, labels or JSON a model may wrap it in. A line
    that only introduces the query ("Here is the improved query:") is passed over."""
    stripped = visible(text)
    try:
        # strict=False: a raw line break inside the string, which some servers' JSON modes let through
        obj = json.loads(stripped, strict=False)
        if isinstance(obj, dict):
            stripped = str(next(iter(obj.values()), ""))
    except json.JSONDecodeError:
        pass
    lines = [line.strip() for line in stripped.splitlines() if line.strip()]
    while len(lines) > 1 and lines[0].endswith(":"):  # "Here is the improved query:" on a line of its own
        lines.pop(0)
    first = lines[0] if lines else ""
    first = re.sub(r"^(search query|query|improved query)\s*:\s*", "", first, flags=re.I)
    return first.strip().strip("\"'`").strip()


def _normalise(text: str) -> str:
    return re.sub(r"\W+", " ", text).strip().lower()
