"""Embedded, model-free stand-ins for the grader and rewriter LLM roles. They are lexical methods, not
language models: the grader measures how much of the question's vocabulary a document contains."""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

from crag.backends.base import Document, Grade, Usage
from crag.evaluation import is_cjk
from crag.text import TermWeights, content_terms, keywords, normalize, tokenize


class QuestionTerms(NamedTuple):
    """What the lexical grader looks for in a document, taken from the question once."""

    terms: list[str]  # distinct content terms (search tokens, question words removed)
    idf: list[float]  # their IDF weights, in the same order
    phrases: list[str]  # keywords as written (normalised, lower-cased): names, kanji and katakana runs
    tokens: frozenset[str]  # every search token of the question, for the title signal


class Evidence(NamedTuple):
    """The lexical grader's three signals for one document, each in [0, 1] (None: does not apply)."""

    terms: float  # IDF-weighted share of the question's content terms in the document's title and text
    matched: list[str]  # those content terms
    phrases: float | None  # share of the question's keyword characters found verbatim (None: no keywords)
    title: float | None  # IDF-weighted share of the document title's terms the question contains (None: no title)


def _folded(text: str) -> str:
    return normalize(text).lower()


class LexicalScorer:
    """What the lexical backends measure: IDF-weighted coverage of a question's content terms by a text,
    in [0, 1], and the lexical grader's other signals (`evidence`)."""

    def __init__(self, weights: TermWeights, tokenizer: str):
        self.weights = weights
        self.tokenizer = tokenizer
        # Documents recur across questions (the same parents rank for many of them): tokenize each once.
        self._tokens = functools.lru_cache(maxsize=100_000)(self._token_set)
        self._folded = functools.lru_cache(maxsize=100_000)(_folded)
        self._title_terms = functools.lru_cache(maxsize=100_000)(self._weighted_terms)

    def _weighted_terms(self, title: str) -> tuple[tuple[tuple[str, float], ...], float]:
        weighted = tuple((t, self.weights.idf(t)) for t in self._tokens(title))
        return weighted, sum(w for _, w in weighted)

    def _token_set(self, text: str) -> frozenset[str]:
        return frozenset(tokenize(text, self.tokenizer))

    def terms(self, question: str) -> list[str]:
        return content_terms(question, self.tokenizer)

    def question_terms(self, question: str) -> QuestionTerms:
        terms = self.terms(question)
        return QuestionTerms(
            terms,
            [self.weights.idf(t) for t in terms],
            [_folded(k) for k in keywords(question)],
            # uncached: a question is tokenized here once, and caching them grew each worker with the run
            self._token_set(question),
        )

    def evidence(self, question: QuestionTerms, title: str | None, text: str) -> Evidence:
        """The three signals for a document of this `title` and `text` (see LexicalGrader); the terms'
        coverage as `score` measures it, with the question's weights looked up once, not per document."""
        document = f"{title or ''}\n{text}"
        terms, matched = self._coverage(question.terms, question.idf, document)
        phrases = None
        if question.phrases:
            folded = self._folded(document)
            phrases = sum(len(p) for p in question.phrases if p in folded) / sum(len(p) for p in question.phrases)
        named = None
        if title:
            weighted, title_total = self._title_terms(title)
            if weighted:
                hit = sum(w for t, w in weighted if t in question.tokens)
                named = hit / title_total if title_total > 0 else 0.0
        return Evidence(terms, matched, phrases, named)

    def score(self, terms: list[str], text: str) -> tuple[float, list[str]]:
        """IDF-weighted coverage of `terms` by `text`, and the terms it contains."""
        return self._coverage(terms, [self.weights.idf(t) for t in terms], text)

    def _coverage(self, terms: list[str], idf: list[float], text: str) -> tuple[float, list[str]]:
        present = self._tokens(text)
        found = [(t, w) for t, w in zip(terms, idf) if t in present]
        total = sum(idf)
        return (sum(w for _, w in found) / total if total > 0 else 0.0), [t for t, _ in found]


# The rationale is also the record `crag calibrate` refits the exponents from.
RATIONALE = re.compile(r"score (?P<score>[0-9.]+), language (?P<language>\w+)$")


def combined_score(evidence: Evidence, signal_weights: dict[str, float]) -> float:
    """The weighted mean of the signals that apply to this question and document."""
    parts = [(signal_weights["terms"], evidence.terms)]
    parts += [
        (signal_weights[name], value) for name in ("phrases", "title") if (value := getattr(evidence, name)) is not None
    ]
    total = sum(w for w, _ in parts)
    return sum(w * v for w, v in parts) / total if total > 0 else 0.0


def language(question: str) -> str:
    return "ja" if is_cjk(question) else "en"


def is_relevant(relevance: float, n_matched: int, doc: Document, threshold: float, web_threshold: float | None) -> bool:
    """Graded "yes": at or above `threshold`; a web result sharing at least two terms with the question
    also at or above `web_threshold` (None: no lower cut). Why, in LexicalGrader."""
    if relevance >= threshold:
        return True
    return web_threshold is not None and doc.get("source") == "web" and relevance >= web_threshold and n_matched >= 2


class LexicalGrader:
    """Three lexical signals per document, each in [0, 1]:
    - terms: the IDF-weighted share of the question's content terms found in the document's title and
      text (stems of English words, character n-grams or words of Japanese);
    - phrases: the share of the question's keyword characters (names, kanji and katakana runs: what
      the keyword rewriter sends to the web) found verbatim, so "東京大学" counts only where it is
      written whole, not where its characters are scattered over a page;
    - title: the IDF-weighted share of the document title's terms that the question contains: a
      question that names a page's subject is about that page, wherever its other words are.
    The score is their weighted mean (`signal_weights`) over the signals that apply (a question without
    keywords has no phrase signal, a document without a title no title signal); relevance = score **
    the exponent of the question's language; grade "yes" at or above `threshold`, or for a web result
    at or above `web_threshold`. On bench/quality.py's development sample the three together told
    knowledge-base from web questions apart at 0.926 / 0.977 / 0.937 (SQuAD 2.0 / JSQuAD / JaQuAD, each
    language's best cut), term coverage alone at 0.875 / 0.950 / 0.913 (docs/quality.md).

    The two cuts answer different questions. On the knowledge base the grade decides whether the
    question needs the web at all, so it must be strict. A web result was found by a search for this
    very question and is the last source before a refusal: a paraphrase that shares a third of the
    question's words with the page that answers it is better answered from that page than refused. The
    lower cut needs at least two of the question's terms on the page: one shared word ("capital" in a
    page about another country's cities) is a coincidence, and must pass `threshold` alone.

    The score does not mean the same in both languages: a Japanese question's character n-grams include
    particles and inflections a relevant paragraph need not repeat, so the best cut between
    knowledge-base and web questions lies lower for Japanese than for English. `exponents` maps the
    score onto one scale, relevance = score ** exponent[language], so that one threshold and one pair
    of routing thresholds serve both (`crag calibrate` fits them)."""

    prompt_hash = None  # no prompt: the grader is not a model
    concurrency = 1

    def __init__(
        self,
        scorer: LexicalScorer,
        threshold: float,
        web_threshold: float | None = None,
        exponents: dict[str, float] | None = None,
        signal_weights: dict[str, float] | None = None,
    ):
        self.scorer = scorer
        self.threshold = threshold
        self.web_threshold = web_threshold
        self.exponents = exponents or {}
        self.signal_weights = signal_weights or {"terms": 1.0, "phrases": 0.0, "title": 0.0}
        self.name = "lexical"

    def relevances(self, question: str, documents: list[Document]) -> list[tuple[float, Evidence, str]]:
        """Each document's (relevance, evidence, rationale): the score of the three signals raised to
        the exponent of the question's language (the semantic grader combines it with a cosine)."""
        asked = self.scorer.question_terms(question)
        lang = language(question)
        exponent = self.exponents.get(lang, 1.0)
        found = []
        for doc in documents:
            evidence = self.scorer.evidence(asked, doc.get("title"), doc["text"])
            score = combined_score(evidence, self.signal_weights)
            relevance = round(score**exponent, 4)  # the stored value is the one compared with the threshold
            signals = ", ".join(
                f"{name} {value:.4f}"
                for name in ("terms", "phrases", "title")
                if (value := getattr(evidence, name)) is not None
            )
            rationale = (
                f"{len(evidence.matched)} of {len(asked.terms)} question terms present; {signals}; "
                f"score {score:.4f}, language {lang}"
            )
            found.append((relevance, evidence, rationale))
        return found

    def grade(self, question: str, documents: list[Document], usage: Usage) -> list[Grade]:
        return [
            Grade(
                relevance=relevance,
                grade="yes"
                if is_relevant(relevance, len(evidence.matched), doc, self.threshold, self.web_threshold)
                else "no",
                rationale=rationale,
            )
            for doc, (relevance, evidence, rationale) in zip(documents, self.relevances(question, documents))
        ]


class KeywordRewriter:
    """The question's keywords (question words and stop words removed), plus configured policy keywords
    (reference flow 3 appends the policy's name and insurer)."""

    concurrency = 1

    def __init__(self, policy_keywords: list[str]):
        self.policy_keywords = policy_keywords
        self.name = "keywords"

    def rewrite(self, question: str, usage: Usage) -> str:
        words = keywords(question)
        extra = [k for k in self.policy_keywords if k not in words]
        return " ".join(words + extra) or question.strip()
