"""The semantic grader: lexical relevance (the lexical grader's, crag.backends.lexical: its three
signals, with `exponents` and `signals` of its own) and the embedding cosine of the question and the
document, combined per language into the probability that the document is relevant:

    relevance = sigmoid(bias + lexical * lexical_relevance + semantic * cosine
                        + best_cosine * (best - best_cosine_center))

with one set of weights per language, fitted by `crag calibrate` against gold_doc_ids (cosines of one
model differ by language: Japanese pairs sit higher than English ones). `best` is the best cosine among
the knowledge base's documents graded with this one: a question-level term, for knowledge-base documents
only, fitted on the expected routes rather than on gold documents (docs/quality.md), as `crag
calibrate` refits it. A document found in a local index with dense vectors is compared through
its best-matching child chunk; any other text (a Tavily result, a refined strip) is embedded when
graded.

Each grade's answer weight is 0.5 + z / lexical: the same evidence in lexical-relevance units, 0.5 where
the probability is 0.5, as the lexical grader's cut is. The extractive answerer adds it to a sentence's
own coverage, where a probability near 0 or 1 would squeeze the documents' differences (docs/quality.md).
Where the cosine and the question-level term weigh nothing and the bias is -lexical / 2 (Japanese under
all-MiniLM-L6-v2) it is the lexical relevance itself."""

from __future__ import annotations

import math
import re

from crag.backends.base import Document, Grade, Usage
from crag.backends.embedding import load_embedder
from crag.backends.lexical import LexicalGrader, LexicalScorer, is_relevant, language
from crag.config import SemanticGraderConfig

# The rationale is also the record `crag calibrate` refits the weights from.
RATIONALE = re.compile(
    r"lexical (?P<lexical>[0-9.]+), cosine (?P<cosine>-?[0-9.]+), language (?P<language>\w+)"
    r"(?:, best cosine -?[0-9.]+ \((?P<term>[-+][0-9.]+)\))?"
)


class SemanticGrader:
    prompt_hash = None  # no prompt: the grader is not a chat model
    concurrency = 1

    def __init__(self, scorer: LexicalScorer, cfg: SemanticGraderConfig, indexes: dict):
        """`indexes`: the loaded local indexes by document source ("internal", "web") whose dense
        vectors can be used."""
        self.scorer = scorer
        self.lexical = LexicalGrader(scorer, cfg.threshold, None, cfg.exponents.model_dump(), cfg.signals.model_dump())
        self.cfg = cfg
        self.embedder = load_embedder(cfg.embedding)
        self.indexes = {source: index for source, index in indexes.items() if index.embedding == cfg.embedding}
        self.name = "semantic"

    def cosine(self, question: str, doc: Document) -> float:
        vector = self.embedder.query(question)
        index = self.indexes.get(doc.get("source"))
        if index is not None:
            similarity = index.parent_similarity(vector, doc.get("parent_id"), doc["text"])
            if similarity is not None:
                return similarity
        return float(self.embedder.kept_passages([doc["text"]])[0] @ vector)

    def grade(self, question: str, documents: list[Document], usage: Usage) -> list[Grade]:
        lang = language(question)
        weights = getattr(self.cfg.languages, lang)
        cosines = [self.cosine(question, doc) for doc in documents]
        # the question-level term's input: web results were found by a search for this very question
        best = max((c for c, doc in zip(cosines, documents) if doc.get("source") != "web"), default=0.0)
        term = weights.best_cosine * (best - weights.best_cosine_center)
        grades = []
        for doc, cosine, (lexical, evidence, _) in zip(
            documents, cosines, self.lexical.relevances(question, documents)
        ):
            z = weights.bias + weights.lexical * lexical + weights.semantic * cosine
            rationale = f"lexical {lexical:.4f}, cosine {cosine:.4f}, language {lang}"
            if weights.best_cosine and doc.get("source") != "web":
                z += term
                rationale += f", best cosine {best:.4f} ({term:+.4f})"
            relevance = round(1 / (1 + math.exp(-z)), 4)  # the stored value is the one compared with the threshold
            grades.append(
                Grade(
                    relevance=relevance,
                    grade="yes"
                    if is_relevant(relevance, len(evidence.matched), doc, self.cfg.threshold, self.cfg.web_threshold)
                    else "no",
                    rationale=rationale,
                    answer_weight=round(0.5 + z / weights.lexical, 4),
                )
            )
        return grades
