"""Answer quality of the embedded backends on the shared QA datasets.

For each dataset (SQuAD 2.0 dev, JSQuAD, JaQuAD from ../shared/data): the article titles, sorted, are
split alternately into a knowledge-base half and a web half (deterministic). The knowledge base is
indexed as the retriever's collection and the other half as the offline web collection. Questions are
drawn from both halves (seeded): expected_route is internal for knowledge-base articles and web for the
others, gold_doc_ids is the question's paragraph. The whole job then runs on Spark with the embedded
backends and `crag eval` scores it.

Two setups:
- the default: 1,000 questions per dataset, 500 from each half, unanswerable SQuAD questions included;
- `--setup actions` (issue 15's): 150 knowledge-base and 150 web questions per dataset, all answerable,
  scored on the CRAG action (`--set routing.policy=thresholds` for the paper's policy).
`--datasets popqa` adds PopQA (../shared/data/popqa: questions and gold answers, no corpus) over SQuAD
2.0's articles, the only English Wikipedia text there is offline, and prints the CRAG paper's PopQA
accuracy (gold answer contained) overall and on the long tail; docs/quality.md says what compares.
For each dataset it prints the metrics, the action confusion (expected route x action) and the costs:
index build time, job time per question, and the peak memory of the whole process tree (driver, JVM,
Python workers) during the dataset's index build and job; then whether each of the setup's targets
(TARGETS) is met.

Run:  python -m bench.quality [--setup default|actions] [--datasets squad_v2,jsquad,jaquad,popqa] [--per-dataset N]
                              [--answerable-only] [--variant semantic|semantic_use] [--set KEY=VALUE ...] [--calibrate]
                              [--reuse-indexes]
Writes the metrics to <out>/quality.json as well as printing them.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

from bench.datasets import REPO, read_jsonl, require_dataset, run_rows

CONF = REPO / "conf" / "local.yaml"
URL_BASE = {
    "squad_v2": "https://en.wikipedia.org/wiki/",
    "jsquad": "https://ja.wikipedia.org/wiki/",
    "jaquad": "https://ja.wikipedia.org/wiki/",
}
# The figures each target is checked against, per setup: (metric, slice, bound, "min" | "max").
TARGETS = {
    "default": {
        "squad_v2": [
            ("routing_accuracy", "answerable=yes", 0.95, "min"),
            ("recall_at_k", "all", 0.95, "min"),
            ("answer_contained", "all", 0.70, "min"),
        ],
        "jsquad": [
            ("routing_accuracy", "answerable=yes", 0.90, "min"),
            ("recall_at_k", "all", 0.90, "min"),
            ("answer_contained", "all", 0.60, "min"),
        ],
        "jaquad": [
            ("routing_accuracy", "answerable=yes", 0.90, "min"),
            ("recall_at_k", "all", 0.90, "min"),
            ("answer_contained", "all", 0.60, "min"),
        ],
    },
    # issue 15, with routing.policy=thresholds
    "actions": {
        dataset: [
            ("action_accuracy", "all", action, "min"),
            ("answerable_refused", "answerable=yes", 0.05, "max"),
            ("answer_contained", "all", 0.80, "min"),
        ]
        for dataset, action in (("squad_v2", 0.85), ("jsquad", 0.95), ("jaquad", 0.90))
    },
}
REPORTED = (
    "action_accuracy",
    "routing_accuracy",
    "route_exact",
    "web_search_rate",
    "recall_at_k",
    "web_recall",
    "answer_contained",
    "f1",
    "exact_match",
    "refusal_correct",
    "answerable_refused",
    "grader_precision",
    "grader_recall",
)


SETUPS = {
    "default": {"per_dataset": 1000, "answerable_only": False},
    "actions": {"per_dataset": 300, "answerable_only": True},
}


def write_collections(dataset: str, folder: Path) -> tuple[list[dict], set[str]]:
    """kb.jsonl and web.jsonl of one reading-comprehension dataset in `folder`: its article titles,
    sorted, assigned alternately to the knowledge base and the web. Returns the corpus and the
    knowledge base's titles."""
    corpus = read_jsonl(require_dataset(dataset) / "corpus.jsonl")
    kb_titles = set(sorted({d["title"] for d in corpus})[0::2])
    folder.mkdir(parents=True, exist_ok=True)
    for name, keep in (("kb", lambda t: t in kb_titles), ("web", lambda t: t not in kb_titles)):
        with (folder / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            for d in corpus:
                if keep(d["title"]):
                    # The article title heads its paragraph, as a page title heads a web result; some
                    # JSQuAD answers are only in the title.
                    text = f"{d['title'].replace('_', ' ')}\n{d['text']}"
                    row = {
                        "doc_id": d["doc_id"],
                        "title": d["title"],
                        "text": text,
                        "url": URL_BASE[dataset] + d["title"],
                    }
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return corpus, kb_titles


def write_questions(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def prepare(dataset: str, out: Path, per_dataset: int, seed: int, answerable_only: bool = False) -> dict:
    """Write kb.jsonl, web.jsonl and questions.jsonl for one dataset; return their paths and counts.
    `answerable_only`: draw only questions with a gold answer (SQuAD 2.0's unanswerable ones left out)."""
    if dataset == "popqa":
        return prepare_popqa(out, per_dataset, seed)
    questions = read_jsonl(require_dataset(dataset) / "questions.jsonl")
    folder = out / dataset
    corpus, kb_titles = write_collections(dataset, folder)
    if answerable_only:
        questions = [q for q in questions if not q["is_impossible"] and any(q["answers"])]
    rng = random.Random(seed)
    halves = {
        True: [q for q in questions if q["title"] in kb_titles],
        False: [q for q in questions if q["title"] not in kb_titles],
    }
    chosen = []
    for internal, pool in halves.items():
        chosen += rng.sample(pool, min(len(pool), per_dataset // 2))
    write_questions(
        folder / "questions.jsonl",
        [
            {
                "question_id": q["question_id"],
                "question": q["question"],
                "answers": q["answers"],
                "is_impossible": q["is_impossible"],
                "expected_route": "internal" if q["title"] in kb_titles else "web",
                "gold_doc_ids": [q["doc_id"]],
            }
            for q in chosen
        ],
    )
    return {
        "folder": folder,
        "questions": len(chosen),
        "kb_docs": sum(d["title"] in kb_titles for d in corpus),
        "web_docs": sum(d["title"] not in kb_titles for d in corpus),
    }


def prepare_popqa(out: Path, per_dataset: int, seed: int) -> dict:
    """PopQA's questions (../shared/data/popqa: questions and gold answers, no corpus) over the only
    English Wikipedia text there is offline: SQuAD 2.0's articles, split into knowledge base and web
    as for squad_v2. They are not about PopQA's subjects, so this measures what the embedded backends
    do without the right documents (see docs/quality.md, "PopQA"): no expected route, no gold document."""
    questions = read_jsonl(require_dataset("popqa") / "questions.jsonl")
    folder = out / "popqa"
    corpus, kb_titles = write_collections("squad_v2", folder)
    chosen = random.Random(seed).sample(questions, min(len(questions), per_dataset))
    write_questions(
        folder / "questions.jsonl",
        [
            {
                "question_id": q["question_id"],
                "question": q["question"],
                "answers": q["answers"],
                "is_impossible": False,
            }
            for q in chosen
        ],
    )
    (folder / "popularity.json").write_text(
        json.dumps({q["question_id"]: q["s_pop"] for q in chosen}), encoding="utf-8"
    )
    titles = {d["title"].replace("_", " ").casefold() for d in corpus}
    return {
        "folder": folder,
        "questions": len(chosen),
        "kb_docs": sum(d["title"] in kb_titles for d in corpus),
        "web_docs": sum(d["title"] not in kb_titles for d in corpus),
        "subjects_with_an_article": sum(q["s_wiki_title"].casefold() in titles for q in chosen),
        "answers_in_corpus": _answers_in_corpus(chosen, corpus),
    }


def _answers_in_corpus(questions: list[dict], corpus: list[dict]) -> int:
    """Questions any of whose gold answers occurs in some paragraph of the corpus (as `answer_contained`
    matches it): the most an extractive answerer could contain, right or by chance."""
    from crag.evaluation import holds, is_cjk, normalize_answer

    paragraphs = {cjk: [normalize_answer(d["text"], cjk) for d in corpus] for cjk in (False, True)}
    return sum(
        any(holds(p, normalize_answer(g, is_cjk(g))) for g in q["answers"] if g for p in paragraphs[is_cjk(g)])
        for q in questions
    )


def popqa_figures(answers: pd.DataFrame, gold: pd.DataFrame, popularity: dict[str, int]) -> dict:
    """Accuracy as the CRAG paper counts it on PopQA (a gold answer contained in the answer; a refusal
    is wrong), over all questions and over the long tail (subject popularity s_pop < 100, the
    definition behind the paper's 1,399-question subset)."""
    from crag.evaluation import best, contained

    rows = answers.merge(gold[["question_id", "answers"]], on="question_id")
    rows["correct"] = [
        best(contained, None if refused else answer, list(golds))
        for answer, refused, golds in zip(rows["answer"], rows["refused"], rows["answers"])
    ]
    tail = rows[rows["question_id"].map(popularity) < 100]
    return {
        "accuracy": round(float(rows["correct"].mean()), 4),
        "n": len(rows),
        "long_tail_accuracy": round(float(tail["correct"].mean()), 4) if len(tail) else None,
        "long_tail_n": len(tail),
        "refused": round(float(rows["refused"].mean()), 4),
    }


def render_popqa(figures: dict) -> str:
    n = figures["n"]
    return (
        f"PopQA accuracy (gold answer contained; a refusal is wrong): {figures['accuracy']:.3f} of {n} questions, "
        f"long tail (s_pop < 100) {figures['long_tail_accuracy']} of {figures['long_tail_n']}; refused {figures['refused']:.3f}\n"
        f"  subjects with an article in the corpus: {figures['subjects_with_an_article']} of {n}; "
        f"questions with a gold answer anywhere in the corpus: {figures['answers_in_corpus']} of {n}"
    )


def _index_matches(path: Path, indexing) -> bool:
    manifest = path / "manifest.json"
    if not manifest.is_file():
        return False
    built = json.loads(manifest.read_text(encoding="utf-8"))
    return built.get("tokenizer") == indexing.tokenizer and built.get("embedding", "none") == indexing.embedding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default="squad_v2,jsquad,jaquad", help="any of squad_v2, jsquad, jaquad, popqa")
    parser.add_argument(
        "--setup",
        choices=sorted(SETUPS),
        default="default",
        help="default: 1,000 questions per dataset; actions: 300, all answerable (issue 15)",
    )
    parser.add_argument(
        "--per-dataset", type=int, default=None, help="questions per dataset, half from each half (overrides the setup)"
    )
    parser.add_argument(
        "--answerable-only", action="store_true", default=None, help="only questions with a gold answer"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / ".crag" / "bench" / "quality"))
    parser.add_argument("--conf", default=str(CONF))
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="after the datasets, run crag calibrate over all their runs together (the semantic grader's "
        "weights per language, and one pair of routing thresholds for every language)",
    )
    parser.add_argument(
        "--reuse-indexes",
        action="store_true",
        help="keep indexes built by an earlier run with the same tokenizer and embedding (the corpus split is fixed)",
    )
    parser.add_argument("--variant", help="overlay conf/variants/NAME.yaml, e.g. semantic or semantic_use")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    setup = SETUPS[args.setup]
    per_dataset = args.per_dataset or setup["per_dataset"]
    answerable_only = setup["answerable_only"] if args.answerable_only is None else args.answerable_only

    from bench.scale import PeakMemory
    from crag.config import load_config
    from crag.console import render_metrics
    from crag.evaluation import action_confusion, question_scores
    from crag.indexing import build_index
    from crag.job import run
    from crag.spark import get_spark

    out = Path(args.out)
    cfg = load_config(args.conf, args.overrides, args.variant)
    spark = get_spark(cfg.spark)
    spark.sparkContext.setLogLevel("ERROR")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    report = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "commit": commit,
        "setup": args.setup,
        "per_dataset": per_dataset,
        "answerable_only": answerable_only,
        "variant": args.variant,
        "overrides": args.overrides,
        "datasets": {},
    }
    for dataset in args.datasets.split(","):
        t0 = time.perf_counter()
        prepared = prepare(dataset, out, per_dataset, args.seed, answerable_only)
        folder = prepared["folder"]
        with PeakMemory() as memory:
            t_index = time.perf_counter()
            for name in ("kb", "web"):
                if not (args.reuse_indexes and _index_matches(folder / f"{name}_index", cfg.indexing)):
                    build_index(folder / f"{name}.jsonl", folder / f"{name}_index", cfg.indexing)
            index_s = time.perf_counter() - t_index
            print(
                f"\n== {dataset}: {prepared['questions']} questions; knowledge base {prepared['kb_docs']} paragraphs, "
                f"web {prepared['web_docs']} paragraphs",
                flush=True,
            )
            t_run = time.perf_counter()
            result = run(
                args.conf,
                str(folder / "questions.jsonl"),
                str(out / "warehouse"),
                args.variant,
                run_id=f"quality-{dataset}",
                overrides=[
                    f"retriever.index={folder / 'kb_index'}",
                    f"web_search.index={folder / 'web_index'}",
                    "cache.enabled=false",
                    *args.overrides,
                ],
                spark=spark,
            )
            run_s = time.perf_counter() - t_run
        metrics = result.metrics
        slices = ["all", "answerable=yes", "expected_route=internal", "expected_route=web"]
        print(
            render_metrics(metrics[metrics["metric"].isin(REPORTED)], [s for s in slices if s in set(metrics["slice"])])
        )
        values = {f"{m}|{s}": v for m, s, v in metrics[["metric", "slice", "value"]].itertuples(index=False)}
        gold = pd.read_json(folder / "questions.jsonl", lines=True)
        answers = run_rows(result.warehouse, "answers", result.run_id)
        refused = int(answers["refused"].sum())
        extra: dict = {}
        if dataset == "popqa":
            popularity = json.loads((folder / "popularity.json").read_text(encoding="utf-8"))
            extra["popqa"] = popqa_figures(answers, gold, popularity) | {
                k: prepared[k] for k in ("subjects_with_an_article", "answers_in_corpus")
            }
            print(render_popqa(extra["popqa"]))
        else:
            no_grades = pd.DataFrame(columns=["question_id", "source", "doc_id"])  # the confusion needs no grades
            gold = gold[["question_id", "answers", "is_impossible", "expected_route", "gold_doc_ids"]]
            confusion = action_confusion(question_scores(answers, no_grades, gold))
            print(f"action confusion (expected route x action):\n{confusion.to_string()}")
            extra["confusion"] = confusion.to_dict(orient="index")
        answerable_refused = values.get("answerable_refused|answerable=yes")
        counts = {f"{m}|{s}": n for m, s, n in metrics[["metric", "slice", "n"]].itertuples(index=False)}
        n_answerable = int(counts.get("answerable_refused|answerable=yes", 0))
        costs = {
            "index_s": round(index_s, 2),
            "run_s": round(run_s, 2),
            "ms_per_question": round(1000 * run_s / prepared["questions"], 1),
            "peak_memory_gb": round(memory.peak / 2**30, 2),
        }
        print(
            f"answerable but refused: {round((answerable_refused or 0) * n_answerable)} / {n_answerable}; refused in all {refused}"
        )
        print(
            f"costs: index build {costs['index_s']} s (both collections), job {costs['run_s']} s = "
            f"{costs['ms_per_question']} ms per question, peak memory {costs['peak_memory_gb']} GB"
        )
        checks = []
        for metric, slice_, bound, kind in TARGETS[args.setup].get(dataset, []):
            got = values.get(f"{metric}|{slice_}")
            met = got is not None and (got >= bound if kind == "min" else got <= bound)
            checks.append({"metric": metric, "slice": slice_, "target": bound, "kind": kind, "value": got, "met": met})
            print(
                f"  target {metric} [{slice_}] {'>=' if kind == 'min' else '<='} {bound}: "
                f"{got if got is None else round(got, 3)} {'met' if met else 'NOT met'}"
            )
        report["datasets"][dataset] = {
            "questions": prepared["questions"],
            "seconds": round(time.perf_counter() - t0, 1),
            "costs": costs,
            "metrics": values,
            "targets": checks,
            **extra,
        }
    if args.calibrate:
        from crag.calibration import calibrate
        from crag.calibration import report as calibration_report

        runs = [
            {name: run_rows(out / "warehouse", name, f"quality-{dataset}") for name in ("grades", "gold")}
            for dataset in args.datasets.split(",")
            if dataset != "popqa"  # no gold documents or routes to fit on
        ]
        result = calibrate(
            pd.concat([r["grades"] for r in runs], ignore_index=True),
            pd.concat([r["gold"] for r in runs], ignore_index=True),
            cfg.routing.lower,
            cfg.routing.upper,
            cfg.grader.threshold,
            cfg.routing.policy,
            getattr(cfg.grader, "format", None) == "binary",
        )
        print(f"\ncalibration over {', '.join(args.datasets.split(','))} together:\n{calibration_report(result)}")
    (out / "quality.json").write_text(json.dumps(report, indent=2, ensure_ascii=False), encoding="utf-8")
    print(f"\nwritten: {out / 'quality.json'}")


if __name__ == "__main__":
    sys.exit(main())
