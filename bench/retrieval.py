"""Dense indexing and retrieval costs, side by side in one process (no Spark): what the embedding path
adds to `crag index`, and each retriever's time per question.

1. Index build of one corpus without dense vectors and with them (`indexing.embedding`, no embedding
   cache, so every distinct chunk is embedded): seconds, and ms per child chunk.
2. Per-question retrieval time over the built index, the partition's questions in one call as a Spark
   task makes it: BM25, the hybrid retriever (BM25 + dense, fused), and `retriever.backend: langchain`
   over a FAISS store of the same child chunks embedded with crag's packaged model
   (crag.backends.langchain_embeddings.PackagedEmbeddings; docs/backends-retrieval.md).

Corpora: `sample` (data/sample/kb and its questions), `squad_v2` / `jsquad` / `jaquad` (the knowledge-base
half of bench/quality.py's split, with 300 of its questions), `scale` (bench/scale.py's 69,222 child
chunks of 100 characters: three copies of the shared corpora; index costs only). The shared sets are
read from ../shared/data, and skipped with a message when absent.

Run:  python -m bench.retrieval [--corpus sample|squad_v2|jsquad|jaquad|scale] [--embedding use-multilingual-v3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.datasets import REPO

CONF = REPO / "conf" / "local.yaml"


def corpus_files(corpus: str, workdir: Path) -> tuple[Path, list[str], list[str]]:
    """The documents to index, the questions to retrieve for, and --set items for the index."""
    if corpus == "sample":
        questions = [json.loads(line)["question"] for line in (REPO / "data" / "sample" / "questions.jsonl").open()]
        return REPO / "data" / "sample" / "kb", questions, []
    if corpus == "scale":
        from bench.scale import prepare

        kb, _, _ = prepare(workdir, n_questions=1)
        return kb, [], ["indexing.child_chars=100", "indexing.child_overlap=50"]
    from bench.quality import prepare

    prepared = prepare(corpus, workdir, per_dataset=300, seed=0, answerable_only=True)
    questions = [json.loads(line)["question"] for line in (prepared["folder"] / "questions.jsonl").open()]
    return prepared["folder"] / "kb.jsonl", questions, []


def timed(function, *args):
    t0 = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default="sample", choices=["sample", "squad_v2", "jsquad", "jaquad", "scale"])
    parser.add_argument("--embedding", default="use-multilingual-v3")
    args = parser.parse_args()

    from crag.backends.embedding import load_embedder
    from crag.config import load_config
    from crag.indexing import build_index

    with tempfile.TemporaryDirectory(prefix="crag-retrieval-") as tmp:
        workdir = Path(tmp)
        docs, questions, sets = corpus_files(args.corpus, workdir)
        lexical = load_config(CONF, [*sets, "indexing.embedding=none", "indexing.embedding_cache=null"])
        dense = load_config(CONF, [*sets, f"indexing.embedding={args.embedding}", "indexing.embedding_cache=null"])
        # once per process, as a Spark worker loads it (the package reads its weights on first use)
        _, load_s = timed(lambda name: load_embedder(name).passages(["warm-up"]), args.embedding)
        manifest, lexical_s = timed(build_index, docs, workdir / "lexical", lexical.indexing)
        _, dense_s = timed(build_index, docs, workdir / "dense", dense.indexing)
        n = manifest["n_chunks"]
        print(
            f"{args.corpus}: {n} child chunks; index build without vectors {lexical_s:.2f} s "
            f"({1000 * lexical_s / n:.2f} ms per chunk), with {args.embedding} {dense_s:.2f} s "
            f"({1000 * dense_s / n:.2f} ms per chunk; the model loaded before, in {load_s:.1f} s)",
            flush=True,
        )
        if questions:
            for name, seconds in retrieval_times(workdir, questions, args.embedding).items():
                print(
                    f"  {name:28s} {1000 * seconds / len(questions):7.2f} ms per question ({len(questions)} questions)"
                )


def retrieval_times(workdir: Path, questions: list[str], embedding: str) -> dict[str, float]:
    """Seconds each retriever took for all `questions` in one call, after a warm-up question (models and
    stores loaded, as in a Spark worker that served a task before)."""
    from crag.backends.bm25 import BM25Retriever
    from crag.backends.hybrid import HybridRetriever
    from crag.backends.langchain_retriever import LangChainRetriever
    from crag.config import load_config

    index = str(workdir / "dense")
    faiss = build_faiss_store(index, workdir / "faiss", embedding)
    hybrid = load_config(CONF, ["retriever.backend=hybrid", f"retriever.index={index}"])
    langchain = load_config(
        CONF,
        [
            "retriever.backend=langchain",
            "retriever.factory=bench.retrieval:faiss_store",
            f"retriever.kwargs={{path: '{faiss}', embedding: {embedding}}}",
        ],
    )
    retrievers = {
        "bm25": BM25Retriever(index),
        f"hybrid ({embedding})": HybridRetriever(hybrid.retriever, index),
        "langchain FAISS (batched)": LangChainRetriever(langchain.retriever),
    }
    from crag.backends.embedding import load_embedder

    times = {}
    for name, retriever in retrievers.items():
        retriever.search(["warm-up question"], 10)
        load_embedder(embedding).forget()  # each retriever embeds the questions itself
        _, times[name] = timed(retriever.search, questions, 10)
    return times


def build_faiss_store(index: str, out: Path, embedding: str) -> Path:
    """A FAISS store over the index's child chunks, with their parents' ids and texts in the metadata."""
    from langchain_community.vectorstores import FAISS

    from crag.backends.langchain_embeddings import PackagedEmbeddings, index_documents

    FAISS.from_documents(index_documents(index), PackagedEmbeddings(embedding)).save_local(str(out))
    return out


def faiss_store(path: str, embedding: str):
    """The factory `retriever.factory` names (the docstore is the pickle build_faiss_store wrote)."""
    from langchain_community.vectorstores import FAISS

    from crag.backends.langchain_embeddings import PackagedEmbeddings

    return FAISS.load_local(path, PackagedEmbeddings(embedding), allow_dangerous_deserialization=True)


if __name__ == "__main__":
    sys.exit(main())
