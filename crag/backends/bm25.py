"""Embedded lexical search: BM25 (bm25s) over the child chunks of an index directory.

Index directory layout (written by `crag index`):
    manifest.json   format, version, tokenizer, counts, and `data`: the build folder it describes
    build-<id>/     one complete build:
      chunks/       the chunk table (Delta), one row per child chunk with its parent's text
      bm25/         the bm25s index over the child chunks
      dense.npy     only with indexing.embedding: one unit vector per child chunk, in chunk-table order
A build is written aside and switched to by replacing manifest.json in one rename, so a reader sees
the old build or the new one, never half of each; a build killed midway leaves the index as it was,
and two builds into one folder at once each stay whole (the last switch wins). A loaded index checks
that its chunk table, BM25 index and vectors agree with the manifest, and names what does not.
Serves both the `bm25` retriever (the knowledge base) and the `offline_corpus` web search (a second
collection standing in for the web).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import bm25s
import numpy as np
import pyarrow as pa

from crag import tables
from crag.backends.base import Document
from crag.backends.embedding import embed_passages, load_embedder
from crag.config import usable_cores
from crag.errors import InputError, UnusableIndexError
from crag.text import TermWeights, tokenize

INDEX_FORMAT = "crag-bm25"
INDEX_VERSION = 2  # 2: builds written aside and switched by the manifest
DENSE_FILE = "dense.npy"
# A build folder no manifest names is removed once it is this old: a complete one may be another
# process's build about to be switched to, an incomplete one another process's build in progress.
STALE_COMPLETE_BUILD_S = 120
STALE_BUILD_S = 3600


def write_index(
    chunks: pa.Table, out: Path, tokenizer: str, embedding: str = "none", embedding_cache: str | None = None
) -> dict:
    """`embedding`: a model name from crag.backends.embedding to store dense vectors of the child chunks
    too (the hybrid retriever and the semantic grader read them), or "none"; `embedding_cache`: a
    folder where vectors are kept by text hash across builds (crag.backends.embedding.embed_passages)."""
    corpus_tokens = [tokenize(t, tokenizer) for t in chunks.column("chunk_text").to_pylist()]
    if not any(corpus_tokens):
        raise InputError(
            "nothing to search in these documents: every chunk is empty once tokenised "
            "(only punctuation or stop words such as 'the', 'of', 'and')"
        )
    # the model is checked before anything is written: a missing package leaves no build folder behind
    # (`crag index` has the machine to itself: the model's runtime gets every core)
    embedder = None if embedding == "none" else load_embedder(embedding, threads=usable_cores())
    out.mkdir(parents=True, exist_ok=True)
    data = f"build-{datetime.now(UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
    build = out / data
    build.mkdir()
    tables.write_table(build / "chunks", chunks)
    index = bm25s.BM25()
    index.index(corpus_tokens, show_progress=False)
    index.save(str(build / "bm25"), show_progress=False)
    if embedder is not None:
        np.save(build / DENSE_FILE, embed_passages(embedder, chunks.column("chunk_text").to_pylist(), embedding_cache))
    previous = _read_manifest(out).get("data") if (out / "manifest.json").is_file() else None
    manifest = {
        "data": data,
        "format": INDEX_FORMAT,
        "version": INDEX_VERSION,
        "tokenizer": tokenizer,
        "embedding": embedding,
        "n_chunks": chunks.num_rows,
        "n_parents": len(set(chunks.column("parent_id").to_pylist())),
        "n_documents": len(set(chunks.column("doc_id").to_pylist())),
        "built_at": datetime.now(UTC).isoformat(),
    }
    staged = out / f".manifest-{uuid.uuid4().hex}.json"
    staged.write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    os.replace(staged, out / "manifest.json")  # the switch: one rename
    _remove_old_builds(out, keep={data, previous})
    return manifest


def _read_manifest(path: Path) -> dict:
    try:
        return json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}


def _remove_old_builds(out: Path, keep: set) -> None:
    """Builds no manifest names any more: the one before the previous (a reader that loaded the previous
    build keeps it), and those of builds that died, once they are old enough not to be another
    process's build in progress."""
    now = time.time()
    for folder in out.glob("build-*"):
        if folder.name not in keep and now - folder.stat().st_mtime > (
            STALE_COMPLETE_BUILD_S if _is_complete(folder) else STALE_BUILD_S
        ):
            shutil.rmtree(folder, ignore_errors=True)


def _is_complete(folder: Path) -> bool:
    return (folder / "bm25").is_dir() and (folder / "chunks" / "_delta_log").is_dir()


def build_command(path: str | Path) -> str:
    """The command that (re)builds the index directory `path`: the config matters (its indexing
    section sets the tokenizer and chunking the retriever must match), so the hint names it."""
    return f"crag index --conf CONF --docs PATH --out {path}"


def index_data(path: str | Path) -> Path:
    """The build folder an index directory's manifest names (its chunk table, BM25 index, vectors)."""
    path = Path(path)
    data = _read_manifest(path).get("data")
    if not data:
        raise UnusableIndexError(f"no crag index at {path} (build one with: {build_command(path)})")
    return path / data


class LexicalIndex:
    """A loaded index directory: search children, return parents."""

    def __init__(self, path: str | Path):
        path = Path(path)
        manifest_path = path / "manifest.json"
        if not manifest_path.is_file():
            raise UnusableIndexError(f"no crag index at {path} (build one with: {build_command(path)})")
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UnusableIndexError(
                f"index manifest {manifest_path} is not valid JSON: rebuild the index with {build_command(path)}"
            ) from None
        if manifest.get("format") != INDEX_FORMAT or manifest.get("version") != INDEX_VERSION:
            raise UnusableIndexError(
                f"index {path} is {manifest.get('format')} version {manifest.get('version')}; this crag reads "
                f"{INDEX_FORMAT} version {INDEX_VERSION}: rebuild it with {build_command(path)}"
            )
        self.path = path
        self.data = path / manifest["data"]
        self.tokenizer = manifest["tokenizer"]
        self.embedding = manifest.get("embedding", "none")
        rebuild = f"rebuild it with {build_command(path)}"
        if not _is_complete(self.data):
            raise UnusableIndexError(
                f"index {path}: its manifest names build {manifest['data']}, which is missing or incomplete: {rebuild}"
            )
        chunks = self._chunks = tables.read_whole_table(self.data / "chunks")
        self._bm25 = bm25s.BM25.load(str(self.data / "bm25"), show_progress=False)
        n_bm25 = int(self._bm25.scores["num_docs"])
        if not chunks.num_rows == n_bm25 == manifest["n_chunks"]:
            raise UnusableIndexError(
                f"index {path} does not agree with itself: {chunks.num_rows} chunks in the table, "
                f"{n_bm25} in the BM25 index, {manifest['n_chunks']} in the manifest: {rebuild}"
            )
        self._vocab = self._bm25.vocab_dict
        self._chunk_parent = np.asarray(chunks.column("parent_id").to_pylist(), dtype=object)
        parents = chunks.select(["parent_id", "doc_id", "title", "url", "parent_text"]).to_pylist()
        self._parents = {p["parent_id"]: p for p in parents}

    @functools.cached_property
    def dense(self) -> np.ndarray:
        """The child chunks' unit vectors (n_chunks, dim), loaded on first use."""
        if self.embedding == "none":
            raise UnusableIndexError(
                f"index {self.path} has no dense vectors: rebuild it with indexing.embedding set "
                "(e.g. --set indexing.embedding=use-multilingual-v3)"
            )
        vectors = np.load(self.data / DENSE_FILE)
        if len(vectors) != len(self._chunk_parent):
            raise UnusableIndexError(
                f"index {self.path}: {len(vectors)} dense vectors for {len(self._chunk_parent)} chunks: rebuild it"
            )
        return vectors

    @functools.cached_property
    def _parent_chunks(self) -> dict[str, np.ndarray]:
        """Chunk positions of each parent."""
        positions: dict[str, list[int]] = {}
        for i, parent_id in enumerate(self._chunk_parent):
            positions.setdefault(parent_id, []).append(i)
        return {p: np.asarray(ix) for p, ix in positions.items()}

    def parent_similarity(self, query_vector: np.ndarray, parent_id: str, text: str) -> float | None:
        """Cosine of the query to the parent's best-matching child chunk; None when the parent is not
        in this index or `text` is no longer the parent's text (a refined strip)."""
        parent = self._parents.get(parent_id)
        if parent is None or parent["parent_text"] != text:
            return None
        return float((self.dense[self._parent_chunks[parent_id]] @ query_vector).max())

    @functools.cached_property
    def term_weights(self) -> TermWeights:
        """Document frequencies straight from the BM25 matrix: one column per token, one entry per chunk
        that contains it."""
        indptr = self._bm25.scores["indptr"]
        df = np.diff(indptr)
        vocab = {token: int(df[i]) for token, i in self._vocab.items() if i < len(df)}
        return TermWeights(vocab, int(self._bm25.scores["num_docs"]))

    def _top_chunks(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
        """(chunk position, BM25 score) of the top-k child chunks of each query, best first (ties: the
        earlier chunk); chunks that share no token with the query are left out.

        bm25s scores each query; the top k are chosen here, among the chunks that score above 0, rather
        than by bm25s.retrieve: its np.argpartition over every chunk's score is slow when most of them
        are equal (0: they share no token with the query). Over the scale benchmark's 69,222 chunks it
        took 9.1 ms per query, this 0.35 ms, for the same chunks and scores."""
        results: list[list[tuple[int, float]]] = []
        k = min(k, len(self._chunk_parent))
        for query in queries:
            tokens = [t for t in tokenize(query, self.tokenizer) if t in self._vocab]
            if not tokens or k <= 0:  # bm25s cannot score an empty query
                results.append([])
                continue
            scores = self._bm25.get_scores(tokens)
            hits = np.flatnonzero(scores > 0)
            if len(hits) > k:
                hits = hits[np.argpartition(-scores[hits], k - 1)[:k]]
            best = hits[np.lexsort((hits, -scores[hits]))]
            results.append([(int(c), float(scores[c])) for c in best])
        return results

    def dense_top_chunks(self, query_vectors: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
        """(chunk position, cosine) of the top-k child chunks of each query vector, best first (exact
        search: one matrix product)."""
        scores = query_vectors @ self.dense.T
        k = min(k, scores.shape[1])
        results = []
        for row in scores:
            top = np.argpartition(-row, k - 1)[:k]
            results.append([(int(c), float(row[c])) for c in sorted(top, key=lambda c: (-row[c], c))])
        return results

    def hybrid_top_chunks(
        self, queries: list[str], query_vectors: np.ndarray, k: int, candidates: int, rrf_k: int
    ) -> list[list[tuple[int, float]]]:
        """Reciprocal rank fusion of the BM25 and the dense top `candidates` child chunks: each chunk
        scores the sum of 1 / (rrf_k + rank) over the lists it is in; the top k, best first."""
        fused = []
        for lexical, dense in zip(
            self._top_chunks(queries, candidates), self.dense_top_chunks(query_vectors, candidates)
        ):
            score: dict[int, float] = {}
            for ranked in (lexical, dense):
                for rank, (chunk, _) in enumerate(ranked, start=1):
                    score[chunk] = score.get(chunk, 0.0) + 1.0 / (rrf_k + rank)
            fused.append(sorted(score.items(), key=lambda cs: (-cs[1], cs[0]))[:k])
        return fused

    def search(
        self,
        queries: list[str],
        k: int,
        source: str,
        max_parents: int | None = None,
        ranked: list[list[tuple[int, float]]] | None = None,
    ) -> list[list[Document]]:
        """The top-k child chunks of each query (BM25, or `ranked` when given), replaced by their
        parents, de-duplicated by parent (at most `max_parents` of them)."""
        results: list[list[Document]] = []
        for chunks in ranked if ranked is not None else self._top_chunks(queries, k):
            docs: list[Document] = []
            seen: set[str] = set()
            for chunk, score in chunks:
                parent_id = self._chunk_parent[chunk]
                if parent_id in seen:
                    continue
                if max_parents is not None and len(seen) == max_parents:
                    break
                seen.add(parent_id)
                parent = self._parents[parent_id]
                docs.append(
                    {
                        "source": source,
                        "doc_id": parent["doc_id"],
                        "parent_id": parent_id,
                        "title": parent["title"],
                        "url": parent["url"],
                        "text": parent["parent_text"],
                        "retrieval_score": score,
                        "rank": len(seen),
                    }
                )
            results.append(docs)
        return results

    def search_chunks(self, query: str, k: int) -> list[tuple[dict, float]]:
        """The top-k child chunk rows (every chunk-table column) with their scores: what a vector index
        over the chunk table returns."""
        return [(self._chunks.slice(c, 1).to_pylist()[0], s) for c, s in self._top_chunks([query], k)[0]]


def build_identity(path: str | None) -> str | None:
    """Which build of a local index a folder holds now (its manifest's build time and folder), None
    for no index there: what a cache of anything read from the index must be keyed on."""
    built = _read_manifest(Path(path)) if path else {}  # an unreadable one: loading the index names the problem
    return f"{built.get('built_at')}/{built.get('data')}" if isinstance(built, dict) and built else None


def load_index(path: str) -> LexicalIndex:
    """One load per build of an index per Python process: Spark reuses its Python workers across
    tasks and runs, and an index rebuilt in the same folder is loaded again."""
    return _load_build(path, build_identity(path))


@functools.lru_cache(maxsize=8)
def _load_build(path: str, build: str | None) -> LexicalIndex:
    return LexicalIndex(path)


class BM25Retriever:
    concurrency = 1  # in-process: the whole batch in one call

    def __init__(self, index_path: str):
        self.index = load_index(str(Path(index_path).resolve()))
        self.name = "bm25"

    def search(self, queries: list[str], k: int, usages=None) -> list[list[Document]]:
        for usage in usages or []:
            if usage is not None:
                usage.search_calls += 1
        return self.index.search(queries, k, source="internal")


class OfflineCorpusSearch:
    """Stands in for a web search API: BM25 over a separate collection, results shaped like Tavily's
    (title, url, content as the document text, score)."""

    concurrency = 1

    def __init__(self, index_path: str):
        self.index = load_index(str(Path(index_path).resolve()))
        self.name = "offline_corpus"

    # Several children of one page may match; look deeper so that k distinct pages come back, as a web
    # search API returns k distinct results.
    CHILDREN_PER_RESULT = 4

    def search(self, query: str, k: int, usage=None, *, question: str | None = None) -> list[Document]:
        if usage is not None:
            usage.search_calls += 1
        return self.index.search([query], k * self.CHILDREN_PER_RESULT, source="web", max_parents=k)[0]
