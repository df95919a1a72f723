"""Choosing backends is configuration: `build_backends(cfg)` reads the backend names from the config
and constructs one object per role. Each provider lives in its own module."""

from __future__ import annotations

from dataclasses import dataclass

from crag.backends.base import Generator, Grader, Retriever, Rewriter, WebSearch
from crag.config import CragConfig
from crag.errors import ConfigError


@dataclass
class Backends:
    retriever: Retriever
    grader: Grader
    rewriter: Rewriter
    web_search: WebSearch | None  # None: web search switched off (web_search.backend = none)
    generator: Generator


def _require(value: str | None, key: str) -> str:
    if not value:
        raise ConfigError(f"config key {key!r} is required for this backend (the path of a crag index directory)")
    return value


def build_backends(cfg: CragConfig) -> Backends:
    from crag.backends.bm25 import BM25Retriever, OfflineCorpusSearch
    from crag.backends.extractive import ExtractiveGenerator
    from crag.backends.lexical import KeywordRewriter, LexicalGrader, LexicalScorer

    retriever = BM25Retriever(_require(cfg.retriever.index, "retriever.index"))
    web_search = None
    if cfg.web_search.backend == "offline_corpus":
        web_search = OfflineCorpusSearch(_require(cfg.web_search.index, "web_search.index"))
    # The lexical grader and extractive generator weigh terms by IDF over every local collection: with
    # the knowledge base alone, all words it lacks would weigh the same, however common they are.
    weights = retriever.index.term_weights
    if web_search is not None:
        if web_search.index.tokenizer != retriever.index.tokenizer:
            raise ConfigError(
                f"retriever.index uses tokenizer {retriever.index.tokenizer!r} but web_search.index uses "
                f"{web_search.index.tokenizer!r}: rebuild one of them with the same indexing.tokenizer"
            )
        weights = weights.merged(web_search.index.term_weights)
    scorer = LexicalScorer(weights, retriever.index.tokenizer)
    return Backends(
        retriever=retriever,
        grader=LexicalGrader(scorer, cfg.grader.threshold),
        rewriter=KeywordRewriter(cfg.rewriter.policy_keywords),
        web_search=web_search,
        generator=ExtractiveGenerator(scorer, cfg.generator.max_sentences, cfg.generator.min_sentence_score),
    )


_CACHE: dict[str, Backends] = {}


def cached_backends(cfg: CragConfig) -> Backends:
    """One set of backends per config per Python process: Spark reuses its Python workers across
    tasks, so indexes and clients are built once per executor process, not once per partition."""
    key = cfg.hash()
    if key not in _CACHE:
        _CACHE[key] = build_backends(cfg)
    return _CACHE[key]
