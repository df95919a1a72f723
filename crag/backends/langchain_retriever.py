"""Retriever over any LangChain retriever or vector store (Chroma as in reference flow 2, FAISS as in
reference flow 3, BM25Retriever, a hosted store, ...).

The store is not pickled from the driver: each Spark worker process calls the factory named in the
config (`retriever.factory: "package.module:function"`, with `retriever.kwargs`) once, so the factory
loads or connects to the store where it runs. The factory returns a LangChain `BaseRetriever` or
`VectorStore`. Results become crag documents through the metadata keys in `retriever.metadata`, and,
as with the other retrievers, the results are de-duplicated by parent: a store of child chunks that
carry their parent's id and text returns parents.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import warnings
from collections.abc import Callable

from langchain_core.documents import Document as LCDocument
from langchain_core.retrievers import BaseRetriever
from langchain_core.vectorstores import VectorStore

from crag.backends.base import Document, Usage
from crag.backends.remote import Endpoint
from crag.config import LangChainRetrieverConfig
from crag.errors import ConfigError, describe


def load_factory(path: str) -> Callable:
    """The function that `package.module:function` names."""
    module_name, _, function_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"retriever.factory {path!r}: cannot import {module_name} ({describe(exc)})") from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise ConfigError(f"retriever.factory {path!r}: {module_name} has no function {function_name!r}")
    return factory


def build_store(cfg: LangChainRetrieverConfig) -> BaseRetriever | VectorStore:
    factory = load_factory(cfg.factory)
    try:
        store = factory(**cfg.kwargs)
    except Exception as exc:  # the user's code, fed from the config: report it on one line
        raise ConfigError(f"retriever.factory {cfg.factory!r} failed: {describe(exc)}") from None
    if not isinstance(store, (BaseRetriever, VectorStore)):
        raise ConfigError(
            f"retriever.factory {cfg.factory!r} returned a {type(store).__name__}, "
            "expected a LangChain BaseRetriever or VectorStore"
        )
    return store


def _score(value) -> float | None:
    try:
        score = float(value)
    except (TypeError, ValueError):
        return None
    return score if math.isfinite(score) else None


class LangChainRetriever:
    def __init__(self, cfg: LangChainRetrieverConfig, concurrent_tasks: int = 1):
        self.cfg = cfg
        self.store = build_store(cfg)
        self.name = f"langchain:{type(self.store).__name__}"
        if cfg.scores == "relevance":
            # LangChain warns of a relevance outside 0..1 (a rounding 1.0000001 will do) with the text of
            # every result in the message: document text in the worker logs, on each query.
            warnings.filterwarnings("ignore", message="Relevance scores must be between 0 and 1", category=UserWarning)
        self._endpoint = None
        self.concurrency = 1
        if cfg.policy is not None:
            # A client of unknown make may have no timeout of its own: the endpoint enforces one.
            self._endpoint = Endpoint(f"langchain:{cfg.factory}", cfg.policy, concurrent_tasks, hard_timeout=True)
            self.concurrency = self._endpoint.concurrency

    def _query_vectors(self, queries: list[str]) -> list[list[float]] | None:
        """The partition's questions embedded before searching, in one call when the store's embeddings
        offer `embed_queries` (crag.backends.langchain_embeddings.PackagedEmbeddings does), for a store
        searched by vector (FAISS: `similarity_search_with_score_by_vector`) under `scores: raw`. None:
        each question goes to the store as text (any other store, relevance scores, a remote store)."""
        store = self.store
        if (
            self._endpoint is not None
            or self.cfg.scores != "raw"
            or not isinstance(store, VectorStore)
            or not hasattr(store, "similarity_search_with_score_by_vector")
            or store.embeddings is None
            or not queries
        ):
            return None
        embeddings = store.embeddings
        batch = getattr(embeddings, "embed_queries", None)
        # LangChain's Embeddings has no batch call for queries: embed_documents may embed a query
        # differently (an "instruction" or "query: " prefix), so without embed_queries each is embedded alone.
        return batch(queries) if callable(batch) else [embeddings.embed_query(q) for q in queries]

    def _found(self, query: str, k: int, vector: list[float] | None = None) -> list[tuple[LCDocument, float | None]]:
        if vector is not None:
            found = self.store.similarity_search_with_score_by_vector(vector, k=k)  # type: ignore[union-attr]
            return [(doc, _score(score)) for doc, score in found]
        if isinstance(self.store, VectorStore):
            if self.cfg.scores == "relevance":
                found = self.store.similarity_search_with_relevance_scores(query, k=k)
            else:
                found = self.store.similarity_search_with_score(query, k=k)
            return [(doc, _score(score)) for doc, score in found]
        key = self.cfg.metadata.score
        return [(doc, _score(doc.metadata.get(key)) if key else None) for doc in self.store.invoke(query)[:k]]

    def _query(self, query: str, k: int, usage: Usage | None, vector: list[float] | None = None) -> list[Document]:
        found = (
            self._endpoint.call(lambda: self._found(query, k), usage)
            if self._endpoint
            else self._found(query, k, vector)
        )
        if usage is not None:
            usage.search_calls += 1
        keys = self.cfg.metadata
        docs: list[Document] = []
        seen: set[str] = set()
        for doc, score in found:
            meta = doc.metadata or {}
            doc_id = (
                _field(meta, keys.doc_id)
                or doc.id
                or "sha256:" + hashlib.sha256(doc.page_content.encode()).hexdigest()[:16]
            )
            parent_id = str(_field(meta, keys.parent_id) or doc_id)
            if parent_id in seen:
                continue
            seen.add(parent_id)
            docs.append(
                {
                    "source": "internal",
                    "doc_id": str(doc_id),
                    "parent_id": parent_id,
                    "title": _text(_field(meta, keys.title)),
                    "url": _text(_field(meta, keys.url)),
                    "text": _field(meta, keys.parent_text) or doc.page_content,
                    "retrieval_score": score,
                    "rank": len(seen),
                }
            )
        return docs

    def search(self, queries: list[str], k: int, usages=None) -> list[list[Document]]:
        embedded = self._query_vectors(queries)
        vectors: list[list[float] | None] = list(embedded) if embedded is not None else [None] * len(queries)
        return [self._query(q, k, u, v) for q, u, v in zip(queries, usages or [None] * len(queries), vectors)]


def _field(metadata: dict, key: str | None):
    """A document's metadata field, by the name the config gives it (None: the config names none)."""
    return metadata.get(key) if key else None


def _text(value) -> str | None:
    return None if value is None else str(value)
