"""Which tokenizer should the embedded BM25 retriever use for Japanese?

Measures retrieval recall@k of BM25 (bm25s) over the JSQuAD paragraphs (title + text) for each
candidate tokenizer: the gold paragraph of each question must be among the top k. Also reports index
and query time. Run: python -m bench.tokenizers [--k 10] [--dataset jsquad]
"""

from __future__ import annotations

import argparse
import functools
import time

import bm25s
import numpy as np

from bench.datasets import read_jsonl, require_dataset
from crag import text

CANDIDATES = {
    "sudachi": functools.partial(text.tokenize, tokenizer="sudachi"),
    "cjk_ngram (default)": functools.partial(text.tokenize, tokenizer="cjk_ngram"),
    "cjk_bigram only": lambda s: [t for t in text.tokenize(s, "cjk_ngram") if len(t) != 1 or t.isascii()],
}


def measure(name, tokenize, corpus, questions, k):
    t0 = time.perf_counter()
    corpus_tokens = [tokenize(d["title"] + "\n" + d["text"]) for d in corpus]
    index = bm25s.BM25()
    index.index(corpus_tokens, show_progress=False)
    t_index = time.perf_counter() - t0
    vocab = index.vocab_dict
    t0 = time.perf_counter()
    queries = [[t for t in tokenize(q["question"]) if t in vocab] for q in questions]
    # bm25s cannot score an empty query: such a question simply retrieves nothing.
    answered = [i for i, q in enumerate(queries) if q]
    found, _ = index.retrieve([queries[i] for i in answered], k=k, show_progress=False)
    ids = np.full((len(queries), k), -1)
    ids[answered] = found
    t_query = time.perf_counter() - t0
    gold = np.array([doc_index[q["doc_id"]] for q in questions])
    recall = float(np.mean([g in row for g, row in zip(gold, ids)]))
    top1 = float(np.mean(ids[:, 0] == gold))
    print(
        f"{name:28s} recall@{k}={recall:.4f} top1={top1:.4f} index={t_index:.1f}s queries={t_query:.1f}s vocab={len(vocab)}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="jsquad")
    parser.add_argument("--k", type=int, default=10)
    args = parser.parse_args()
    path = require_dataset(args.dataset)
    corpus = read_jsonl(path / "corpus.jsonl")
    questions = [q for q in read_jsonl(path / "questions.jsonl") if not q["is_impossible"]]
    doc_index = {d["doc_id"]: i for i, d in enumerate(corpus)}
    print(f"{args.dataset}: {len(corpus)} paragraphs, {len(questions)} questions")
    for name, fn in CANDIDATES.items():
        measure(name, fn, corpus, questions, args.k)
