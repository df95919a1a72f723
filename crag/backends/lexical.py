"""Embedded, model-free stand-ins for the grader and rewriter LLM roles. They are lexical methods, not
language models: the grader measures how much of the question's vocabulary a document contains."""

from __future__ import annotations

import functools
import re

from crag.backends.base import Document, Grade, Usage
from crag.evaluation import is_cjk
from crag.text import TermWeights, content_terms, keywords, tokenize


class LexicalScorer:
    """IDF-weighted coverage of a question's content terms by a text, in [0, 1]."""

    def __init__(self, weights: TermWeights, tokenizer: str):
        self.weights = weights
        self.tokenizer = tokenizer
        # Documents recur across questions (the same parents rank for many of them): tokenize each once.
        self._tokens = functools.lru_cache(maxsize=100_000)(self._token_set)

    def _token_set(self, text: str) -> frozenset[str]:
        return frozenset(tokenize(text, self.tokenizer))

    def terms(self, question: str) -> list[str]:
        return content_terms(question, self.tokenizer)

    def score(self, terms: list[str], text: str) -> tuple[float, list[str]]:
        present = self._tokens(text)
        matched = [t for t in terms if t in present]
        total = sum(self.weights.idf(t) for t in terms)
        if total <= 0:
            return 0.0, matched
        return sum(self.weights.idf(t) for t in matched) / total, matched


# The rationale is also the record `crag calibrate` refits the exponents from.
RATIONALE = re.compile(r"coverage (?P<coverage>[0-9.]+), language (?P<language>\w+)$")


def language(question: str) -> str:
    return "ja" if is_cjk(question) else "en"


def is_relevant(relevance: float, n_matched: int, doc: Document, threshold: float, web_threshold: float | None) -> bool:
    """Graded "yes": at or above `threshold`; a web result sharing at least two terms with the question
    also at or above `web_threshold` (None: no lower cut). Why, in LexicalGrader."""
    if relevance >= threshold:
        return True
    return web_threshold is not None and doc.get("source") == "web" and relevance >= web_threshold and n_matched >= 2


class LexicalGrader:
    """Coverage = IDF-weighted share of the question's content terms found in the document's title and
    text; relevance = coverage ** the exponent of the question's language; grade "yes" at or above
    `threshold`, or for a web result at or above `web_threshold`.

    The two cuts answer different questions. On the knowledge base the grade decides whether the
    question needs the web at all, so it must be strict. A web result was found by a search for this
    very question and is the last source before a refusal: a paraphrase that shares a third of the
    question's words with the page that answers it is better answered from that page than refused. The
    lower cut needs at least two of the question's terms on the page: one shared word ("capital" in a
    page about another country's cities) is a coincidence, and must pass `threshold` alone.

    Coverage does not mean the same in both languages: a Japanese question's character n-grams include
    particles and inflections a relevant paragraph need not repeat, so on the development sample the
    best cut between knowledge-base and web questions lies at 0.43 for Japanese and 0.58 for English.
    `exponents` maps coverage onto one scale, relevance = coverage ** exponent[language], so that one
    threshold and one pair of routing thresholds serve both (`crag calibrate` fits them)."""

    prompt_hash = None  # no prompt: the grader is not a model
    concurrency = 1

    def __init__(
        self,
        scorer: LexicalScorer,
        threshold: float,
        web_threshold: float | None = None,
        exponents: dict[str, float] | None = None,
    ):
        self.scorer = scorer
        self.threshold = threshold
        self.web_threshold = web_threshold
        self.exponents = exponents or {}
        self.name = "lexical"

    def grade(self, question: str, documents: list[Document], usage: Usage) -> list[Grade]:
        terms = self.scorer.terms(question)
        lang = language(question)
        exponent = self.exponents.get(lang, 1.0)
        grades = []
        for doc in documents:
            coverage, matched = self.scorer.score(terms, f"{doc.get('title') or ''}\n{doc['text']}")
            relevance = round(coverage**exponent, 4)  # the stored value is the one compared with the threshold
            grades.append(
                Grade(
                    relevance=relevance,
                    grade="yes"
                    if is_relevant(relevance, len(matched), doc, self.threshold, self.web_threshold)
                    else "no",
                    rationale=f"{len(matched)} of {len(terms)} question terms present, coverage {coverage:.4f}, language {lang}",
                )
            )
        return grades


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
