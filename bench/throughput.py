"""Throughput: the batch job next to the endpoints' physical limit and next to a per-question graph.

Starts the loopback emulators of model serving, Vector Search and Tavily with a latency per call and a
capacity per endpoint (concurrent requests it serves; 429 beyond). Then runs N questions through
(a) the Spark job with conf/databricks.yaml (budgets = capacities), and
(b) a re-implementation of reference flow 1: a LangGraph StateGraph retrieve -> grade_documents ->
    decide -> transform_query -> web_search -> generate, invoked one question at a time, against the
    same emulators with the same prompts and routing (any irrelevant document -> web search).
The graph runs on a sample of the questions (it is sequential: a full run would take N x its latency);
its time for N questions is that sample's time per question times N.

Lower bound: for each endpoint, calls x latency / capacity; the bound is the largest of them (no
schedule can finish before its busiest endpoint has served its calls).

Besides the wall times it reports, from the emulator's record of every request: when each endpoint got
its first request, when the last reply went out, and how busy the busiest endpoint was, overall and
second by second (requests in flight on average): where a run falls short of the bound shows there.

Ours runs twice: into a new warehouse (every table created), then the same questions under another run
id into the same warehouse (a scheduled job's usual run: its tables exist).

Run:  python -m bench.throughput [--questions 2000] [--graph-questions 40] [--capacity 32]
                                 [--pipelines N] [--per-pipeline N] [--partitions N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.datasets import REPO, run_rows
from crag.spark_warm import warm_up

LLM_LATENCY_S = 0.2
SEARCH_LATENCY_S = 0.08


def _questions(n: int, path: Path) -> list[dict]:
    """n questions cycled from the sample (the stage cache is off, so repeats are real work)."""
    sample = [json.loads(line) for line in (REPO / "data" / "sample" / "questions.jsonl").read_text().splitlines()]
    sample = [q for q in sample if isinstance(q["question"], str) and q["question"].strip()]
    rows = [{"question_id": f"t{i:06d}", "question": sample[i % len(sample)]["question"]} for i in range(n)]
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8")
    return rows


def _endpoint_calls(emulator) -> Counter:
    """Calls per endpoint, describe requests (client set-up) left out."""
    from crag.emulators import endpoint_of

    calls: Counter = Counter()
    for r in emulator.requests:
        if r.method == "GET" and not r.path.endswith("/query"):
            continue
        calls[endpoint_of(r.service, r.path, r.body)] += 1
    return calls


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def busy_profile(
    spans: list[tuple[str, float, float]], endpoint: str, start: float, seconds: float
) -> tuple[float, list[float]]:
    """(seconds of requests served, requests in flight on average in each second from `start`) for
    one endpoint, from (endpoint, admitted, released) spans."""
    timeline = [0.0] * (int(seconds) + 1)
    busy = 0.0
    for name, admitted, released in spans:
        if name != endpoint:
            continue
        busy += released - admitted
        a, b = admitted - start, released - start
        for second in range(max(0, int(a)), min(len(timeline), int(b) + 1)):
            timeline[second] += max(0.0, min(b, second + 1) - max(a, second))
    return busy, timeline


def lower_bound(calls: Counter, capacity: int) -> tuple[float, str]:
    """(seconds, busiest endpoint): calls x latency / capacity, the largest over endpoints."""

    def latency(endpoint: str) -> float:
        return LLM_LATENCY_S if endpoint.startswith("serving:") else SEARCH_LATENCY_S

    per_endpoint = {e: n * latency(e) / capacity for e, n in calls.items()}
    busiest = max(per_endpoint, key=per_endpoint.get)
    return per_endpoint[busiest], busiest


def load_client_libraries() -> float:
    """Import what crag's Databricks backends use; the seconds it took (about 0 once loaded)."""
    t0 = time.perf_counter()
    import databricks.ai_search.client  # noqa: F401
    import mlflow.deployments  # noqa: F401

    import crag.backends.databricks_serving  # noqa: F401
    import crag.backends.tavily_search  # noqa: F401
    import crag.backends.vector_search  # noqa: F401
    import crag.stages  # noqa: F401

    return time.perf_counter() - t0


def warm_up_workers(spark) -> dict:
    """Before timing: the JVM, one Python worker per task slot, and the client libraries imported in
    the driver and every worker, as on a warm cluster (Spark reuses its Python workers; a notebook's
    driver keeps its imports). A cold process pays the import once; its seconds are reported."""
    import pyarrow as pa

    driver = load_client_libraries()

    def load(batches):
        seconds = load_client_libraries()
        time.sleep(0.5)  # hold the slot, so that every slot starts a worker of its own
        for _ in batches:
            pass
        yield pa.RecordBatch.from_pydict({"seconds": [seconds]})

    slots = spark.sparkContext.defaultParallelism
    workers = spark.range(slots, numPartitions=slots).mapInArrow(load, "seconds double").collect()
    return {"driver_s": round(driver, 2), "worker_s": round(max(r.seconds for r in workers), 2)}


# ------------------------------------------------------------------ reference flow 1 as a graph


def build_graph(cfg):
    """Reference flow 1 as its write-up describes it, with the clients it uses (mlflow deployments,
    databricks-vectorsearch, tavily-python) and crag's prompt templates."""
    from typing import TypedDict

    from langgraph.graph import END, START, StateGraph
    from mlflow.deployments import get_deploy_client
    from tavily import TavilyClient

    from crag.backends.llm_roles import GRADE_SCHEMA, Prompt, render_context
    from crag.backends.parsing import clean_query, parse_answer, parse_binary
    from crag.backends.vector_search import vector_search_client

    serving = get_deploy_client("databricks")
    index = vector_search_client(cfg.retriever, None).get_index(
        endpoint_name=cfg.retriever.endpoint, index_name=cfg.retriever.index_name
    )
    tavily = TavilyClient(api_key=os.environ["TAVILY_API_KEY"], api_base_url=cfg.web_search.api_base_url)
    grade_prompt, rewrite_prompt, answer_prompt = (
        Prompt(c.prompt_text, "p", role)
        for c, role in ((cfg.grader, "grader"), (cfg.rewriter, "rewriter"), (cfg.generator, "generator"))
    )

    class State(TypedDict, total=False):
        question: str
        documents: list
        web_search: str
        query: str
        generation: str

    def chat(endpoint: str, messages: list, **params) -> str:
        reply = serving.predict(endpoint=endpoint, inputs={"messages": messages, **params})
        return reply["choices"][0]["message"]["content"]

    def retrieve(state):
        reply = index.similarity_search(
            columns=["parent_id", "parent_text", "url"],
            query_text=state["question"],
            num_results=10,
            disable_notice=True,
        )
        seen, docs = set(), []
        for parent_id, text, url, _score in reply["result"]["data_array"]:
            if parent_id not in seen:
                seen.add(parent_id)
                docs.append({"source": "internal", "text": text, "url": url})
        return {"documents": docs}

    def grade_documents(state):
        docs = state["documents"]
        if not docs:
            return {"documents": [], "web_search": "Yes"}
        system = grade_prompt.messages(question=state["question"])[0]["content"]
        reply = serving.predict(
            endpoint=cfg.grader.endpoint,
            inputs={
                "inputs": [{"prompt": grade_prompt.user.safe_substitute(document=d["text"])} for d in docs],
                "params": {
                    "system_prompt": system,
                    "json_schema": json.dumps(GRADE_SCHEMA["schema"]),
                    "temperature": 0.001,
                    "max_tokens": 512,
                },
            },
        )
        relevant = [d for d, p in zip(docs, reply["predictions"]) if parse_binary(p["output"]).relevance == 1.0]
        return {"documents": relevant[:5], "web_search": "Yes" if len(relevant) != len(docs) else "No"}

    def transform_query(state):
        messages = rewrite_prompt.messages(question=state["question"])
        return {"query": clean_query(chat(cfg.rewriter.endpoint, messages, max_tokens=100))}

    def web_search(state):
        results = tavily.search(state["query"], max_results=3)["results"]
        joined = "\n".join(r["content"] for r in results)
        return {"documents": state["documents"] + ([{"source": "web", "text": joined}] if joined else [])}

    def generate(state):
        if not state["documents"]:
            return {"generation": cfg.generator.refusal_message}
        messages = answer_prompt.messages(
            question=state["question"],
            context=render_context(state["documents"], 6000),
            refusal=cfg.generator.refusal_message,
            language_line="",
        )
        text, _ = parse_answer(
            chat(cfg.generator.endpoint, messages, temperature=0.1, max_tokens=300),
            cfg.generator.refusal_message,
            len(state["documents"]),
        )
        return {"generation": text or cfg.generator.refusal_message}

    graph = StateGraph(State)
    for name, node in (
        ("retrieve", retrieve),
        ("grade_documents", grade_documents),
        ("transform_query", transform_query),
        ("web_search", web_search),
        ("generate", generate),
    ):
        graph.add_node(name, node)
    graph.add_edge(START, "retrieve")
    graph.add_edge("retrieve", "grade_documents")
    graph.add_conditional_edges(
        "grade_documents",
        lambda s: "transform_query" if s["web_search"] == "Yes" else "generate",
        {"transform_query": "transform_query", "generate": "generate"},
    )
    graph.add_edge("transform_query", "web_search")
    graph.add_edge("web_search", "generate")
    graph.add_edge("generate", END)
    return graph.compile()


# ------------------------------------------------------------------ the benchmark


def run_benchmark(
    n: int,
    graph_n: int,
    capacity: int,
    workdir: Path,
    spark=None,
    pipelines: int | None = None,
    per_pipeline: int | None = None,
    partitions: int | None = None,
) -> dict:
    """`spark`: a warm session to run on (the tests'); None: one of its own, whose start-up and warm-up
    are reported apart. `pipelines`, `per_pipeline`, `partitions`: spark.pipelines_per_task,
    spark.questions_per_pipeline and spark.partitions (None: conf/databricks.yaml's)."""
    from crag.config import SparkConfig, load_config
    from crag.emulators import Emulator
    from crag.indexing import build_index
    from crag.job import run

    local = load_config(REPO / "conf" / "local.yaml")
    build_index(REPO / "data" / "sample" / "kb", workdir / "kb", local.indexing)
    build_index(REPO / "data" / "sample" / "web.jsonl", workdir / "web", local.indexing)
    questions = _questions(n, workdir / "questions.jsonl")
    report: dict = {
        "questions": n,
        "capacity_per_endpoint": capacity,
        "llm_latency_s": LLM_LATENCY_S,
        "search_latency_s": SEARCH_LATENCY_S,
    }
    token = "bench-token"
    with Emulator(str(workdir / "kb"), str(workdir / "web"), token=token, retry_after_s=1) as emulator:
        emulator.behaviour["serving"].latency_s = LLM_LATENCY_S
        emulator.behaviour["vector_search"].latency_s = SEARCH_LATENCY_S
        emulator.behaviour["tavily"].latency_s = SEARCH_LATENCY_S
        for b in emulator.behaviour.values():
            b.capacity = capacity
        os.environ.update(
            DATABRICKS_HOST=emulator.url, DATABRICKS_TOKEN=token, TAVILY_API_KEY=token, TAVILY_API_BASE_URL=emulator.url
        )
        overrides = [
            "cache.enabled=false",
            "mlflow.enabled=false",
            *([f"spark.pipelines_per_task={pipelines}"] if pipelines else []),
            *([f"spark.questions_per_pipeline={per_pipeline}"] if per_pipeline else []),
            *([f"spark.partitions={partitions}"] if partitions else []),
            *[
                f"{role}.policy.max_concurrency={capacity}"
                for role in ("retriever", "grader", "rewriter", "generator", "web_search")
            ],
            *[
                f"{role}.policy.backoff_initial_s=0.05"
                for role in ("retriever", "grader", "rewriter", "generator", "web_search")
            ],
        ]
        conf = str(REPO / "conf" / "databricks.yaml")
        if spark is None:  # a session of its own, started and warmed up as a job's would be
            from crag.spark import get_spark

            t0 = time.perf_counter()
            spark = get_spark(SparkConfig())
            spark.sparkContext.setLogLevel("ERROR")
            report["client_library_imports_s"] = warm_up_workers(spark)
            report["spark_startup_s"] = round(time.perf_counter() - t0, 2)
            report["delta_warm_up_s"] = round(warm_up(spark, workdir / "warm_up"), 2)

        def timed_run(run_id: str):
            """One run of ours into the benchmark's warehouse, the emulator's record cleared first:
            (its result, when it started, its seconds)."""
            emulator.reset()
            start = time.perf_counter()
            result = run(
                conf,
                str(workdir / "questions.jsonl"),
                str(workdir / "warehouse"),
                run_id=run_id,
                overrides=overrides,
                spark=spark,
            )
            return result, start, time.perf_counter() - start

        busy0, total0 = cpu_times()
        result, t0, ours = timed_run("throughput")
        busy1, total1 = cpu_times()
        calls = _endpoint_calls(emulator)
        bound, busiest = lower_bound(calls, capacity)
        batch_requests = sum(1 for r in emulator.of("serving") if isinstance(r.body, dict) and "inputs" in r.body)
        answers = run_rows(result.warehouse, "answers", result.run_id)
        report["ours"] = {
            "wall_s": round(ours, 2),
            "questions_per_s": round(n / ours, 1),
            "calls": dict(calls),
            "errors": result.counts.errors,
            "retries": result.counts.retries,
            "capacity_429": emulator.faults_injected.get("capacity_429", 0),
            "grading_requests_per_question": round(batch_requests / max(1, int((answers["n_retrieved"] > 0).sum())), 3),
            "peak_in_flight": {e: v for e, v in emulator.peak_in_flight.items() if ":" in e or e == "tavily"},
            # connections the clients opened to the endpoints (a TLS handshake each on real services)
            "connections": emulator.connections,
            # share of the machine's CPU busy during the run (clients, Spark and the emulators together)
            "machine_cpu_busy": round((busy1 - busy0) / max(total1 - total0, 1), 3),
        }
        first: dict = {}
        for e, a, _ in emulator.spans:
            first[e] = min(first.get(e, a), a)
        report["ours"]["first_request_s"] = {e: round(a - t0, 2) for e, a in first.items()}
        report["ours"]["last_reply_s"] = round(max(b for _, _, b in emulator.spans) - t0, 2)
        report["lower_bound_s"] = round(bound, 2)
        report["busiest_endpoint"] = busiest
        busy, timeline = busy_profile(emulator.spans, busiest, t0, ours)
        report["busiest_endpoint_utilisation"] = round(busy / (capacity * ours), 3)  # of its capacity, over the run
        report["busiest_in_flight_per_second"] = [round(x, 1) for x in timeline]
        report["ours_over_bound"] = round(ours / bound, 3)

        # The same questions again into the same warehouse, under another run id: a scheduled job's
        # usual run, whose tables (runs, answers, grades, ...) exist already and need no creation.
        again, _, next_s = timed_run("throughput-next")
        report["ours_next_run"] = {
            "wall_s": round(next_s, 2),
            "calls": dict(_endpoint_calls(emulator)),
            "errors": again.counts.errors,
            "connections": emulator.connections,
            "ours_over_bound": round(next_s / bound, 3),
        }

        if graph_n:
            cfg = load_config(conf, [])
            graph = build_graph(cfg)
            emulator.reset()
            t0 = time.perf_counter()
            for q in questions[:graph_n]:
                graph.invoke({"question": q["question"]})
            per_question = (time.perf_counter() - t0) / graph_n
            graph_calls = _endpoint_calls(emulator)
            report["graph"] = {
                "questions_run": graph_n,
                "seconds_per_question": round(per_question, 3),
                "extrapolated_wall_s": round(per_question * n, 1),
                "questions_per_s": round(1 / per_question, 2),
                "calls_per_question": {e: round(c / graph_n, 2) for e, c in graph_calls.items()},
            }
            report["graph_over_ours"] = round(per_question * n / ours, 1)
            report["graph_over_ours_next_run"] = round(per_question * n / next_s, 1)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=2000)
    parser.add_argument("--graph-questions", type=int, default=40, help="questions the sequential graph runs (0: skip)")
    parser.add_argument("--capacity", type=int, default=32, help="concurrent requests each endpoint serves")
    parser.add_argument("--pipelines", type=int, default=None, help="spark.pipelines_per_task (default: the config's)")
    parser.add_argument(
        "--per-pipeline", type=int, default=None, help="spark.questions_per_pipeline (default: the config's)"
    )
    parser.add_argument(
        "--partitions", type=int, default=None, help="spark.partitions (default: every task slot but one)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = run_benchmark(
            args.questions,
            args.graph_questions,
            args.capacity,
            Path(tmp),
            pipelines=args.pipelines,
            per_pipeline=args.per_pipeline,
            partitions=args.partitions,
        )
    print(json.dumps(report, indent=2))
    print(
        f"\nours {report['ours']['wall_s']} s ({report['ours']['questions_per_s']} q/s); lower bound {report['lower_bound_s']} s "
        f"({report['busiest_endpoint']}); ours/bound {report['ours_over_bound']}; Spark start-up {report['spark_startup_s']} s "
        f"and Delta warm-up {report['delta_warm_up_s']} s apart"
    )
    again = report["ours_next_run"]
    print(
        f"next run into the same warehouse (its tables exist): {again['wall_s']} s; ours/bound {again['ours_over_bound']}"
    )
    if "client_library_imports_s" in report:
        imports = report["client_library_imports_s"]
        print(
            f"start-up includes importing the client libraries: {imports['driver_s']} s in the driver, "
            f"{imports['worker_s']} s in each Python worker (paid once per cold process)"
        )
    if "graph" in report:
        print(
            f"graph {report['graph']['seconds_per_question']} s/question -> {report['graph']['extrapolated_wall_s']} s for "
            f"{args.questions}; graph/ours {report['graph_over_ours']}x (next run: {report['graph_over_ours_next_run']}x)"
        )


if __name__ == "__main__":
    sys.exit(main())
