"""Hybrid retrieval over a `crag index` directory built with dense vectors: BM25 and embedding search
over the same child chunks, fused by reciprocal rank fusion, then expanded to parents as the BM25
retriever does. Exact dense search (a matrix product) is fast enough at the embedded world's sizes."""

from __future__ import annotations

from pathlib import Path

from crag.backends.base import Document
from crag.backends.bm25 import load_index
from crag.backends.embedding import load_embedder
from crag.config import HybridRetrieverConfig
from crag.errors import UnusableIndexError


class HybridRetriever:
    concurrency = 1  # in-process: the whole batch in one call

    def __init__(self, cfg: HybridRetrieverConfig, index_path: str):
        self.index = load_index(str(Path(index_path).resolve()))
        if self.index.embedding == "none":
            raise UnusableIndexError(
                f"retriever.backend hybrid needs dense vectors, and index {index_path} has none: "
                "rebuild it with --set indexing.embedding=use-multilingual-v3"
            )
        self.embedder = load_embedder(self.index.embedding)
        self.candidates, self.rrf_k = cfg.candidates, cfg.rrf_k
        self.name = "hybrid"

    def search(self, queries: list[str], k: int, usages=None) -> list[list[Document]]:
        for usage in usages or []:
            if usage is not None:
                usage.search_calls += 1
        vectors = self.embedder.queries(queries)  # the partition's new questions in one call
        ranked = self.index.hybrid_top_chunks(queries, vectors, k, max(k, self.candidates), self.rrf_k)
        return self.index.search(queries, k, source="internal", ranked=ranked)
