"""Text handling shared by indexing, the lexical backends and evaluation, and the reading of JSON lines
and CSV records.

One tokenizer serves English and Japanese without language detection: runs of Latin letters and
digits become lower-cased words (English stop words dropped); runs of Japanese characters go either to
character unigrams + bigrams (the default: no dictionary needed) or to SudachiPy content words in their
normalised form (dictionary from PyPI's sudachidict-core). bench/tokenizers.py measures both on
JSQuAD/JaQuAD: equal recall, so the default is the one without a dictionary (figures in docs/configuration.md).
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import re
import threading
import unicodedata
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import sentencex
import Stemmer

from crag.errors import describe

# Kanji, hiragana, katakana (incl. half-width and the prolonged-sound mark), CJK compatibility ideographs.
_CJK = r"\u3005\u3041-\u3096\u309d-\u309f\u30a1-\u30fa\u30fc-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f"
# A word run must stop where Japanese starts: "5月" is the number 5 and the Japanese run 月.
_TOKEN_RE = re.compile(rf"[{_CJK}]+|(?:(?![{_CJK}])[^\W_])+", re.UNICODE)
_CJK_RUN_RE = re.compile(rf"[{_CJK}]+")
# For readable keywords, names like "Wi-Fi", "AQ-7" or "v2.1" stay whole.
_KEYWORD_RE = re.compile(rf"[{_CJK}]+|(?:(?![{_CJK}])[^\W_])+(?:[-.](?:(?![{_CJK}])[^\W_])+)*", re.UNICODE)
_HIRAGANA_RUN_RE = re.compile(r"^[\u3041-\u309f\u30fc]+$")
# Part of the stage cache's key for the roles computed here rather than by a model (crag.cache.role_slices):
# raise it when the embedded backends give other results for the same input (2: the sentences of
# sentencex; 3: the semantic grader's answer weight), so that results made the old way are not reused.
TEXT_VERSION = 3

# Where a sentence surely ends: a line break (Markdown lines, table rows) or a Japanese full stop (no
# space follows one). Western punctuation is left to sentencex, which knows initials and abbreviations.
_LINE_OR_FULL_STOP_RE = re.compile(r"(?<=[。！？])|\n+")

# English function words and question words. Japanese needs no list: bigrams of particles carry little
# IDF weight, and the keyword extractor below drops hiragana runs altogether.
ENGLISH_STOP_WORDS = frozenset(
    """a about above after again against all am an and any are as at be because been before being below
    between both but by can could did do does doing down during each few for from further had has have having
    he her here hers herself him himself his how i if in into is it its itself just me more most my myself no
    nor not now of off on once only or other our ours ourselves out over own same she should so some such
    than that the their theirs them themselves then there these they this those through to too under until
    up very was we were what when where which while who whom why will with would you your yours yourself
    yourselves also many much may might must shall whose s t""".split()
)
# Words that ask rather than describe: removed from web queries and from the terms a grader looks for.
QUESTION_WORDS = frozenset("what when where which who whom whose why how name named called kind type".split())
_QUESTION_STEMS = frozenset(Stemmer.Stemmer("english").stemWords(sorted(QUESTION_WORDS)))
JAPANESE_QUESTION_WORDS = (
    "何",
    "なに",
    "なん",
    "どこ",
    "いつ",
    "だれ",
    "誰",
    "どの",
    "どれ",
    "どう",
    "なぜ",
    "どんな",
    "いくつ",
    "いくら",
)


_ACCENTED = re.compile(r"[\u00c0-\u024f\u1e00-\u1eff]+")  # Latin letters with diacritics


def _strip_accents(match: re.Match) -> str:
    return "".join(ch for ch in unicodedata.normalize("NFKD", match.group(0)) if not unicodedata.combining(ch))


def encodable(text: str) -> bool:
    """Whether `text` is valid Unicode text: "\\ud800" is valid JSON, but a lone surrogate cannot be
    encoded (nor stored in a Delta table)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def normalize(text: str) -> str:
    """NFKC folds full-width Latin and half-width katakana, so both spellings match; Latin diacritics
    are dropped ("Möngke" matches "Mongke"). Only Latin letters are decomposed: decomposing kana would
    split their voicing marks (が -> か + ゛)."""
    return _ACCENTED.sub(_strip_accents, unicodedata.normalize("NFKC", text))


def _cjk_ngrams(run: str) -> list[str]:
    return list(run) + [run[i : i + 2] for i in range(len(run) - 1)]


# Parts of speech that carry no topic: particles, auxiliary verbs, symbols, blanks.
_SUDACHI_SKIP = frozenset(("助詞", "助動詞", "補助記号", "記号", "空白"))


@functools.lru_cache(maxsize=1)
def _sudachi():
    # Imported lazily: loading the dictionary costs ~0.1 s and is needed only for Japanese text.
    from sudachipy import Dictionary, SplitMode  # noqa: PLC0415  # sudachi extra

    tokenizer = Dictionary(dict="core").tokenizer()
    return tokenizer, SplitMode.A


def _sudachi_words(run: str) -> list[str]:
    tokenizer, mode = _sudachi()
    return [m.normalized_form() for m in tokenizer.tokenize(run, mode) if m.part_of_speech()[0] not in _SUDACHI_SKIP]


TOKENIZERS = ("cjk_ngram", "sudachi")


_stemmers = threading.local()  # PyStemmer objects must not be shared between threads


@functools.lru_cache(maxsize=200_000)
def stem(word: str) -> str:
    """Snowball English stem, so "replaced" matches "replace" and "filters" matches "filter"."""
    stemmer = getattr(_stemmers, "english", None)
    if stemmer is None:
        stemmer = _stemmers.english = Stemmer.Stemmer("english")
    return stemmer.stemWord(word)


def tokenize(text: str, tokenizer: str = "cjk_ngram") -> list[str]:
    """Search tokens: English word stems (lower-cased, stop words removed) and Japanese words or n-grams."""
    split_cjk = _sudachi_words if tokenizer == "sudachi" else _cjk_ngrams
    tokens: list[str] = []
    for match in _TOKEN_RE.finditer(normalize(text).lower()):
        run = match.group(0)
        if _CJK_RUN_RE.fullmatch(run):
            tokens.extend(split_cjk(run))
        elif run not in ENGLISH_STOP_WORDS:
            tokens.append(stem(run))
    return tokens


def content_terms(question: str, tokenizer: str = "cjk_ngram") -> list[str]:
    """The distinct search tokens of a question that say what it is about (question words removed)."""
    text = normalize(question)
    for word in JAPANESE_QUESTION_WORDS:
        text = text.replace(word, " ")
    seen: dict[str, None] = {}
    for token in tokenize(text, tokenizer):
        if token not in _QUESTION_STEMS:
            seen.setdefault(token, None)
    return list(seen)


def keywords(question: str) -> list[str]:
    """Readable keywords for a web query: English content words, and the kanji/katakana/Latin runs of
    Japanese text (hiragana runs there are mostly particles and inflections)."""
    text = normalize(question)
    for word in JAPANESE_QUESTION_WORDS:
        text = text.replace(word, " ")
    out: dict[str, None] = {}
    for match in _KEYWORD_RE.finditer(text):
        run = match.group(0)
        if _CJK_RUN_RE.fullmatch(run):
            for part in re.split(r"[\u3041-\u309f]+", run):
                if part and not _HIRAGANA_RUN_RE.match(part):
                    out.setdefault(part, None)
        elif run.lower() not in ENGLISH_STOP_WORDS and run.lower() not in QUESTION_WORDS:
            out.setdefault(run, None)
    return list(out)


def split_sentences(text: str) -> list[str]:
    """Sentences of English or Japanese text, stripped, empties dropped. A period after an initial or
    an abbreviation ("J. F. D. Shrewsbury", "the U.S. Army", "Dr. Smith") ends no sentence: cut there,
    an extractive answer lost the name it was asked for."""
    return [
        stripped
        for piece in _LINE_OR_FULL_STOP_RE.split(text)
        if piece and not piece.isspace()
        for sentence in _spaced(sentencex.segment("en", piece))
        if (stripped := sentence.strip())
    ]


def _spaced(segments: Iterator[str]) -> Iterator[str]:
    """sentencex's sentences, joined again where no space follows the mark: "ASP.NET", "page?ID=3" and
    "３．５" (a full-width decimal point) are not sentence ends."""
    pending = ""
    for segment in segments:
        pending += segment
        if pending[-1:].isspace():
            yield pending
            pending = ""
    if pending:
        yield pending


def word_windows(text: str, size: int = 50) -> list[str]:
    """~`size`-word windows (CJK: 2*size characters), the CRAG paper's alternative strip unit."""
    words = text.split()
    if len(words) > 1:
        return [" ".join(words[i : i + size]) for i in range(0, len(words), size)]
    width = 2 * size
    return [text[i : i + width] for i in range(0, len(text), width)] if text else []


class TermWeights:
    """Inverse document frequencies from a corpus, used to weigh question terms by how telling they are.

    Terms never seen in the corpus get the largest IDF: a rare word the corpus lacks is strong evidence
    that a document which does contain it is on topic.
    """

    def __init__(self, document_frequency: dict[str, int], n_documents: int):
        self.document_frequency = document_frequency
        self.n_documents = max(n_documents, 1)
        self._unseen = self.idf_of(0)

    def idf_of(self, df: int) -> float:
        return math.log(1.0 + (self.n_documents - df + 0.5) / (df + 0.5))

    def idf(self, term: str) -> float:
        df = self.document_frequency.get(term)
        return self._unseen if df is None else self.idf_of(df)

    def merged(self, other: TermWeights) -> TermWeights:
        """Statistics of both corpora together, as if they were one."""
        df = dict(self.document_frequency)
        for term, count in other.document_frequency.items():
            df[term] = df.get(term, 0) + count
        return TermWeights(df, self.n_documents + other.n_documents)

    @classmethod
    def from_tokens(cls, corpus_tokens: Sequence[Sequence[str]]) -> TermWeights:
        df: Counter[str] = Counter()
        for tokens in corpus_tokens:
            df.update(set(tokens))
        return cls(dict(df), len(corpus_tokens))


def parse_json_line(raw: bytes | str) -> tuple[dict | None, str | None]:
    """One JSON Lines line read as an object: (the object, None), or (None, what is wrong with the line)."""
    try:
        line = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
    except UnicodeDecodeError:
        return None, "line is not valid UTF-8"
    try:
        row = json.loads(line, object_pairs_hook=_object_without_repeated_keys)
    except RepeatedKey as exc:
        return None, f"line repeats the key {exc.key} (JSON would keep only its last value)"
    except json.JSONDecodeError as exc:
        return None, f"line is not valid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})"
    except RecursionError:
        return None, "line is not readable JSON: it is nested too deeply"
    except ValueError as exc:  # valid JSON Python will not convert, such as an integer of over 4300 digits
        return None, f"line is not readable JSON ({describe(exc, limit=200, with_type=False)})"
    if not isinstance(row, dict):
        return None, f"line is not a JSON object (got {type(row).__name__})"
    return row, None


class RepeatedKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = json.dumps(key[:60] + ("…" if len(key) > 60 else ""))  # the user's text: quoted, escaped, short


def _object_without_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    """json.loads keeps the last of two equal keys and drops the first without a word."""
    row: dict = {}
    for key, value in pairs:
        if key in row:
            raise RepeatedKey(key)
        row[key] = value
    return row


@dataclass(frozen=True)
class CsvRecord:
    """One record of a CSV file: where it starts (1-based line), its fields, or what is wrong with it
    (`problem`, with the text of its first line as `line_text`)."""

    line: int
    fields: list[str] | None
    problem: str | None = None
    line_text: str = ""


def _csv_problem(error: csv.Error) -> str:
    text = str(error)
    if "unexpected end of data" in text:
        return "a quoted field is not closed (an unterminated quote)"
    if "expected after" in text:
        return 'a quoted field goes on after its closing quote (a quote inside a field must be doubled: "")'
    if "field larger than field limit" in text:
        return f"a field is longer than {csv.field_size_limit()} characters (an unterminated quote?)"
    return f"not readable as CSV ({text})"


def csv_records(text: str) -> Iterator[CsvRecord]:
    """The records of a CSV file (RFC 4180: fields quoted with '"', a quote in one doubled), header
    first, blank lines skipped; strictly read. A record that is not well formed (a quote left open,
    text after a closing quote, more or fewer fields than the header) is a record of its own with its
    problem. When such a record spans lines, reading goes on from the line after the one it started
    on: the lines an open quote swallowed are read again as the records they are, not lost inside
    another's field."""
    lines = io.StringIO(text, newline="").readlines()  # \n, \r\n or \r: not the other line breaks splitlines knows
    start, width = 0, None
    while start < len(lines):
        consumed = first = start  # lines read so far; the line the record being read starts on

        def feed() -> Iterator[str]:
            nonlocal consumed
            while consumed < len(lines):
                consumed += 1
                yield lines[consumed - 1]

        def record(fields: list[str] | None, problem: str | None = None) -> CsvRecord:
            return CsvRecord(first + 1, fields, problem, lines[first].rstrip("\r\n"))

        try:
            for fields in csv.reader(feed(), strict=True):
                if not fields:  # a blank line
                    first = consumed
                    continue
                width = len(fields) if width is None else width
                if len(fields) != width:
                    count = f"{len(fields)} field" + ("s" if len(fields) != 1 else "")
                    yield record(None, f"it has {count}; the header has {width}")
                    if consumed - first > 1:
                        break  # read again from its second line
                else:
                    yield record(fields)
                first = consumed
            else:
                return
        except csv.Error as error:
            yield record(None, _csv_problem(error))
        start = first + 1


# Letters and symbols that show nothing: the default-ignorable Hangul fillers and the braille blank
_BLANK_CHARACTERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")


def invisible(char: str) -> bool:
    """A character that shows nothing on its own: format characters (zero-width spaces and joiners,
    bidi marks), marks (combining marks, the grapheme joiner, variation selectors: nothing to sit on),
    and blank letters (Hangul fillers)."""
    return unicodedata.category(char) in ("Cf", "Mn", "Me") or char in _BLANK_CHARACTERS
