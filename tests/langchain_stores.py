"""Real LangChain stores over a few documents, for the `langchain` retriever's tests: the factories
that `retriever.factory` names, and what writes the stores they load. Everything runs offline: the
embedding is a hashed bag of words (deterministic, and close for texts that share words, so rankings
mean something), not a model from a hub."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings

DIMENSIONS = 256
_TOKEN = re.compile(r"[a-z0-9]+|[^\W\d_a-z]")  # Latin words, and single characters of other scripts


class HashedBagOfWords(Embeddings):
    def _embed(self, text: str) -> list[float]:
        vector = [0.0] * DIMENSIONS
        for token in _TOKEN.findall(text.lower()):
            vector[int(hashlib.md5(token.encode()).hexdigest(), 16) % DIMENSIONS] += 1.0
        norm = math.sqrt(sum(v * v for v in vector)) or 1.0
        return [v / norm for v in vector]

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self._embed(t) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self._embed(text)


class BatchedHashedBagOfWords(HashedBagOfWords):
    """The same vectors, with the batch call for questions that crag's retriever uses when offered
    (as crag.backends.langchain_embeddings.PackagedEmbeddings offers it); each call's texts are kept."""

    calls: list[list[str]] = []

    def embed_queries(self, texts: list[str]) -> list[list[float]]:
        self.calls.append(list(texts))
        return [self._embed(t) for t in texts]


# Child chunks, each carrying its parent's id and text (the small/large scheme crag index writes).
PARENTS = {
    "filter#p0": (
        "filter",
        "Filter care",
        "https://example.test/filter",
        "Replace the HEPA-13 main filter every twelve months. Vacuum the pre-filter every two weeks.",
    ),
    "noise#p0": (
        "noise",
        "Noise levels",
        "https://example.test/noise",
        "The purifier runs at 24 decibels in sleep mode and 52 decibels on the turbo setting.",
    ),
    "warranty#p0": (
        "warranty",
        "保証",
        "https://example.test/warranty",
        "保証期間は購入日から三年間です。フィルターは保証の対象外です。",
    ),
}
CHILDREN = [
    ("filter#p0", "Replace the HEPA-13 main filter every twelve months."),
    ("filter#p0", "Vacuum the pre-filter every two weeks."),
    ("noise#p0", "The purifier runs at 24 decibels in sleep mode"),
    ("noise#p0", "and 52 decibels on the turbo setting."),
    ("warranty#p0", "保証期間は購入日から三年間です。"),
    ("warranty#p0", "フィルターは保証の対象外です。"),
]


def child_documents() -> list[Document]:
    docs = []
    for i, (parent_id, text) in enumerate(CHILDREN):
        doc_id, title, url, parent_text = PARENTS[parent_id]
        docs.append(
            Document(
                page_content=text,
                id=f"{parent_id}#c{i}",
                metadata={
                    "doc_id": doc_id,
                    "parent_id": parent_id,
                    "parent_text": parent_text,
                    "title": title,
                    "source": url,
                },
            )
        )
    return docs


def write_documents(path: Path) -> Path:
    path.write_text(
        "\n".join(
            json.dumps({"id": d.id, "text": d.page_content, "metadata": d.metadata}, ensure_ascii=False)
            for d in child_documents()
        ),
        encoding="utf-8",
    )
    return path


def read_documents(path: str) -> list[Document]:
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return [Document(page_content=r["text"], id=r["id"], metadata=r["metadata"]) for r in rows]


def write_faiss(path: Path) -> Path:
    from langchain_community.vectorstores import FAISS

    FAISS.from_documents(child_documents(), HashedBagOfWords()).save_local(str(path))
    return path


def write_chroma(path: Path, collection: str = "crag-test") -> Path:
    from langchain_chroma import Chroma

    store = Chroma(
        collection_name=collection,
        embedding_function=HashedBagOfWords(),
        persist_directory=str(path),
        client_settings=_chroma_settings(),
        collection_metadata={"hnsw:space": "cosine"},
    )
    docs = child_documents()
    store.add_documents(docs, ids=[d.id for d in docs])
    return path


def _chroma_settings():
    from chromadb.config import Settings

    return Settings(anonymized_telemetry=False, is_persistent=True)


# ---------------------------------------------------------------- factories named in the config


def faiss_store(path: str):
    from langchain_community.vectorstores import FAISS

    # The docstore is a pickle this test wrote itself.
    return FAISS.load_local(path, HashedBagOfWords(), allow_dangerous_deserialization=True)


def faiss_store_batched(path: str):
    from langchain_community.vectorstores import FAISS

    return FAISS.load_local(path, BatchedHashedBagOfWords(), allow_dangerous_deserialization=True)


def chroma_store(path: str, collection: str = "crag-test"):
    from langchain_chroma import Chroma

    return Chroma(
        collection_name=collection,
        embedding_function=HashedBagOfWords(),
        persist_directory=path,
        client_settings=_chroma_settings(),
    )


def bm25_retriever(documents: str, k: int = 4):
    from langchain_community.retrievers import BM25Retriever

    return BM25Retriever.from_documents(
        read_documents(documents), k=k, preprocess_func=lambda text: _TOKEN.findall(text.lower())
    )


def not_a_store():
    return ["a list, not a retriever"]


def broken_store(path: str):
    raise FileNotFoundError(f"no store at {path}\nsecond line")
