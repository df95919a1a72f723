"""Embedded stand-in for the generator LLM: an extractive answerer. It composes nothing; it returns the
context sentences that cover the question best, with the documents they came from.

With `answer_from_best_document`, a context in which no sentence reaches `min_sentence_score` is still
answered, from the best sentences of its most relevant document: the context holds only documents the
grader judged relevant, and a paraphrased question (whose words its answer sentence does not repeat)
was otherwise refused although the document answers it."""

from __future__ import annotations

import re

from crag.backends.base import Answer, Document, Usage
from crag.backends.embedding import Embedder
from crag.backends.lexical import LexicalScorer
from crag.text import normalize, split_sentences

_HEADING = re.compile(r"^(#{1,6}\s|\|?\s*-{3})")  # Markdown headings and table rules
_BULLET = re.compile(r"^([-*+]|\d+[.)])\s+")


def _plain(text: str) -> str:
    """Text as a title line shows it: "Harvard_University" (a Wikipedia page name) is "harvard university"."""
    return " ".join(normalize(text).replace("_", " ").lower().split())


def _document_relevance(doc: Document, score: float) -> float:
    """The document's relevance in the units of a sentence's own `score` (the lexical relevance's): the
    grade's answer weight where the grader gives one (a probability squeezes the same evidence towards
    0 and 1), else its relevance; `score` for a document not graded."""
    weight = doc.get("answer_weight")
    return doc.get("relevance", score) if weight is None else weight


class ExtractiveGenerator:
    concurrency = 1

    def __init__(
        self,
        scorer: LexicalScorer,
        max_sentences: int,
        min_sentence_score: float,
        document_weight: float = 0.0,
        answer_from_best_document: bool = False,
        cosine: tuple[float, Embedder] | None = None,
    ):
        """`cosine`: (weight, model) to blend the cosine of the question and each sentence into its score."""
        self.scorer = scorer
        self.cosine_weight: float = cosine[0] if cosine else 0.0
        self.embedder: Embedder | None = cosine[1] if cosine else None
        self.answer_from_best_document = answer_from_best_document
        self.document_weight = document_weight
        self.max_sentences = max_sentences
        self.min_sentence_score = min_sentence_score
        self.name = "extractive"
        self.reads_relevance = document_weight > 0 or answer_from_best_document

    def generate(self, question: str, context: list[Document], usage: Usage) -> Answer:
        terms = self.scorer.terms(question)
        candidates: list[tuple[float, int, int, str]] = []  # (score, doc position, sentence position, sentence)
        below: list[tuple[float, int, int, str]] = []  # the same for sentences under min_sentence_score
        # A question the model gives no vector (a language it does not cover: the zero vector) is ranked
        # without the cosine, its share going back to the sentence's own coverage.
        embedded = self.embedder is not None and bool(self.embedder.query(question).any())
        lexical_weight = 1 - self.document_weight - (self.cosine_weight if embedded else 0.0)
        for d, doc in enumerate(context):
            for s, sentence in self._sentences(doc):
                score, _ = self.scorer.score(terms, sentence)
                # A sentence is as good as its own coverage and its document's: a partial match
                # inside the most relevant document beats a stray match elsewhere.
                combined = lexical_weight * score + self.document_weight * _document_relevance(doc, score)
                (candidates if score >= self.min_sentence_score else below).append((combined, d, s, sentence))
        if embedded:
            candidates = self._closer_in_meaning(question, candidates)
        if not candidates and self.answer_from_best_document and below:
            top = max(range(len(context)), key=lambda d: (_document_relevance(context[d], 0.0), -d))
            candidates = [c for c in below if c[1] == top]
            candidates = self._closer_in_meaning(question, candidates) if embedded else candidates
        if not candidates:
            return Answer(text=None)
        # Best first; ties go to the earlier document (higher rank) and the earlier sentence.
        best = sorted(candidates, key=lambda c: (-c[0], c[1], c[2]))[: self.max_sentences]
        chosen = sorted(best, key=lambda c: (c[1], c[2]))  # read in document order
        cited = sorted({c[1] for c in chosen})
        return Answer(text=" ".join(c[3] for c in chosen), cited=cited)

    @staticmethod
    def _sentences(doc: Document) -> list[tuple[int, str]]:
        """(position, sentence) of the document's answer candidates: a heading or the title line repeats
        the question's words but answers nothing."""
        title = _plain(doc.get("title") or "")
        return [
            (s, _BULLET.sub("", sentence))
            for s, sentence in enumerate(split_sentences(doc["text"]))
            if not (_HEADING.match(sentence) or _plain(sentence) == title)
        ]

    RERANKED = 10  # the best candidates by coverage and relevance whose cosine is added

    def _closer_in_meaning(
        self, question: str, scored: list[tuple[float, int, int, str]]
    ) -> list[tuple[float, int, int, str]]:
        """The best RERANKED of `scored` with the cosine of question and sentence added (weighted), the
        rest dropped: embedding every sentence of a context cost several times the whole chain. The
        sentences are embedded in one call and kept (the same documents answer many questions)."""
        if self.embedder is None or not scored:  # typing: generate() calls it only with a model
            return scored
        best = sorted(scored, key=lambda c: (-c[0], c[1], c[2]))[: self.RERANKED]
        cosines = self.embedder.kept_passages([c[3] for c in best]) @ self.embedder.query(question)
        return [(c[0] + self.cosine_weight * float(cos), *c[1:]) for c, cos in zip(best, cosines)]
