"""The small protocols every backend implements, and the records they exchange.

A document travels through the stages as a plain dict (so it crosses pandas and Arrow unchanged):
    source ("internal" | "web"), doc_id, parent_id, title, url, text, retrieval_score, rank
and, once graded, relevance (0..1), grade ("yes" | "no"), parse_status, rationale.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

Document = dict


@dataclass(frozen=True)
class Grade:
    relevance: float  # 0..1
    grade: str  # "yes" | "no"
    parse_status: str = "ok"  # "ok" | "repaired" | "failed"
    rationale: str | None = None


@dataclass(frozen=True)
class Answer:
    text: str | None  # None: the generator declined (nothing in the context answers the question)
    cited: list[int] = field(default_factory=list)  # positions in the context list


@dataclass
class Usage:
    """Calls and tokens one backend call cost, summed per question into the answers table."""

    llm_calls: int = 0
    search_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, other: "Usage") -> None:
        self.llm_calls += other.llm_calls
        self.search_calls += other.search_calls
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens


@runtime_checkable
class Retriever(Protocol):
    name: str

    def search(self, queries: list[str], k: int) -> list[list[Document]]:
        """Top documents for each query, parents de-duplicated, best first (one search call each)."""


@runtime_checkable
class Grader(Protocol):
    name: str
    prompt_hash: str | None

    def grade(self, question: str, documents: list[Document], usage: Usage) -> list[Grade]:
        """One grade per document, in order; model calls and tokens are added to `usage`."""


@runtime_checkable
class Rewriter(Protocol):
    name: str

    def rewrite(self, question: str, usage: Usage) -> str:
        """A web-search query for the question."""


@runtime_checkable
class WebSearch(Protocol):
    name: str

    def search(self, query: str, k: int) -> list[Document]:
        """Up to k results, each its own document (source "web")."""


@runtime_checkable
class Generator(Protocol):
    name: str

    def generate(self, question: str, context: list[Document], usage: Usage) -> Answer:
        """An answer grounded in the context, citing the documents it used."""
