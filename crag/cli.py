"""The `crag` command: index, run, ask, eval, calibrate, compare, sql, emulate."""

from __future__ import annotations

import argparse
import errno
import functools
import gc
import logging
import os
import shlex
import signal
import sys
import textwrap
import threading
import traceback
import unicodedata
from collections.abc import Mapping

from crag.errors import CragError, describe, interrupt_in
from crag.secrets import MASK, is_secret_key, scrub


def _conf_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--conf",
        required=True,
        help="YAML config file, e.g. conf/local.yaml, or the name of a config shipped "
        "with crag (local, databricks, openai) when no such file exists",
    )
    p.add_argument("--variant", help="overlay variants/NAME.yaml (next to the --conf file) on the config; base: none")
    _set_args(p, "routing.policy=thresholds")


def _set_args(p: argparse.ArgumentParser, example: str) -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override one config key, e.g. --set {example} (repeatable)",
    )
    p.add_argument(
        "--overrides",
        dest="override_list",
        default="",
        metavar="'K=V;K=V'",
        help="several --set in one argument, separated by ';' (for job schedulers that pass one string)",
    )


def _overrides(args) -> list[str]:
    return [*args.overrides, *(item.strip() for item in args.override_list.split(";") if item.strip())]


class _Parser(argparse.ArgumentParser):
    """A usage error is one line, like every error crag can name (argparse prints the usage first)."""

    commands: Mapping[str, argparse.ArgumentParser] = {}

    def error(self, message: str):
        self.exit(2, f"crag: error: {self.prog}: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        # arguments no parser took are reported by the command's own parser (argparse: by the root's)
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            self.commands.get(getattr(parsed, "command", None), self).error(
                f"unrecognized arguments: {' '.join(extra)}"
            )
        return parsed


def parser() -> argparse.ArgumentParser:
    root = _Parser(prog="crag", description="Batch Corrective RAG on Spark and Delta Lake.")
    sub = root.add_subparsers(dest="command", required=True)
    root.commands = sub.choices
    for add in (_index_parser, _run_parser, _eval_parser, _calibrate_parser, _compare_parser):
        add(sub)
    for add in (_sql_parser, _emulate_parser, _ask_parser, _spark_parser):
        add(sub)
    return root


def _index_parser(sub) -> None:
    p = sub.add_parser("index", help="build a chunk table and BM25 index from documents")
    p.set_defaults(func=_index)
    _conf_args(p)
    p.add_argument(
        "--docs",
        required=True,
        help="a JSONL file of {doc_id, title, text, url?}, or a file or folder of "
        ".md/.txt/.html/.pdf (and .docx/.pptx/.csv/.tsv with the langchain extra)",
    )
    p.add_argument("--out", required=True, help="index directory to write")


def _run_parser(sub) -> None:
    p = sub.add_parser(
        "run",
        help="answer a table of questions; write the run's rows (inputs, results, metrics) and its outcome in runs",
    )
    p.set_defaults(func=_run)
    _conf_args(p)
    p.add_argument(
        "--questions",
        required=True,
        help="Delta table folder, a catalog table (catalog.schema.table), or .jsonl/.parquet/.csv with question_id, question",
    )
    p.add_argument(
        "--warehouse", required=True, help="folder that holds the output Delta tables (catalog.schema on Databricks)"
    )
    p.add_argument("--run-id", help="id for this run (default: time-stamped); re-using one replaces that run's rows")
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="call every backend again instead of reusing stored results (sets cache.enabled=false)",
    )
    p.add_argument(
        "--progress",
        action="store_true",
        default=None,
        help="report progress after each batch even when stderr is not a terminal",
    )
    p.add_argument(
        "--resume",
        metavar="RUN_ID",
        help="continue a killed or failed run: answered questions are kept and not sent to any backend again",
    )


def _eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="score a run against its gold columns; writes the metrics table")
    p.set_defaults(func=_eval)
    _run_arg(p, "the run_id to evaluate")
    p.add_argument(
        "--slices",
        help="slices to show, e.g. language=en,language=ja or language (all of its slices); "
        "default: all, then every slice",
    )
    _unfinished_arg(p, "evaluate a run that has not succeeded (still running or failed) from the rows it has")
    _format_arg(p)
    _session_args(p)


def _calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="propose routing and grading thresholds from a run's stored scores")
    p.set_defaults(func=_calibrate)
    _run_arg(p, "a run whose questions have gold columns")
    _unfinished_arg(p, "calibrate from a run that has not succeeded (still running or failed) with the rows it has")
    _session_args(p)


def _compare_parser(sub) -> None:
    p = sub.add_parser(
        "compare", help="compare two runs question by question; writes the comparisons table and an HTML report"
    )
    p.set_defaults(func=_compare)
    p.add_argument("--warehouse", required=True, help="folder of Delta tables (catalog.schema on Databricks)")
    p.add_argument("--base", required=True, help="run_id of the baseline")
    p.add_argument("--candidate", required=True, help="run_id of the variant under test")
    p.add_argument("--report", help="HTML report path (default: compare_BASE_vs_CANDIDATE.html here)")
    p.add_argument("--no-mlflow", action="store_true", help="do not attach the report to the candidate's MLflow run")
    _unfinished_arg(p, "compare runs that have not succeeded (still running or failed) with the rows they have")
    _session_args(p)


def _sql_parser(sub) -> None:
    p = sub.add_parser("sql", help="query a local warehouse's tables with SQL (read-only, no JVM)")
    p.set_defaults(func=_sql)
    p.add_argument("--warehouse", required=True, help="folder of Delta tables written by crag run")
    _format_arg(p)
    p.add_argument("sql", help='one read-only statement, e.g. "SELECT route, count(*) FROM answers GROUP BY route"')
    p.add_argument(
        "--timeout", type=float, default=60.0, metavar="SECONDS", help="stop the query after this long (default 60)"
    )


def _emulate_parser(sub) -> None:
    p = sub.add_parser(
        "emulate", help="serve local emulators of model serving, the OpenAI chat API, Vector Search and Tavily"
    )
    p.set_defaults(func=_emulate)
    p.add_argument("--kb-index", help="crag index directory the Vector Search emulator searches")
    p.add_argument("--web-index", help="crag index directory the Tavily emulator searches")
    p.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 to serve on (default 8765)")
    p.add_argument("--token", help="require this bearer token / API key (default: accept any)")


def _ask_parser(sub) -> None:
    p = sub.add_parser("ask", help="answer one question without Spark, printing every stage")
    p.set_defaults(func=_ask)
    _conf_args(p)
    p.add_argument("question")


def _spark_parser(sub) -> None:
    p = sub.add_parser(
        "spark", help="a warm local Spark (a Spark Connect server) that every command uses while it runs"
    )
    p.set_defaults(func=_spark)
    p.add_argument(
        "action",
        choices=("start", "status", "stop"),
        help="start: start it (once it answers, return); status: say whether one runs; stop: end it",
    )
    p.add_argument("--port", type=int, help="port on 127.0.0.1 to serve on (default: a free one)")
    p.add_argument("--conf", help="YAML config whose spark section to use (default: built-in: local[2])")
    _set_args(p, "spark.conf.spark.driver.memory=4g")


def _run_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--warehouse", required=True, help="folder of Delta tables (catalog.schema on Databricks)")
    p.add_argument("--run", required=True, dest="run_id", help=what)


def _unfinished_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--allow-unfinished", action="store_true", help=what)


class _StagePrinter:
    """`crag ask`'s screen, called after each stage: a failure shows at the stage that raised it (the
    later stages pass the failed question by, its error unchanged)."""

    def __init__(self) -> None:
        self.error: str | None = None

    def __call__(self, name: str, df) -> None:
        row = df.iloc[0]
        raised = row["error"] if row["error"] != self.error else None
        self.error = row["error"]
        _print_stage(name, row, raised)


def _print_stage(name: str, row, raised: str | None) -> None:
    """One stage's results for the question in `row`, or `raised`: the error this stage failed it with."""
    # Error texts and reasons are scrubbed where they are made; the whole screen output is too, since
    # it also shows what the services sent back, and so are the terminal's control codes in it.
    print = _print_untrusted  # noqa: A001
    if row["error"] is not None and name != "generate":
        if raised is not None:
            print(f"[{name}] error: {raised}")
        return
    if name == "retrieve":
        print(f"[retrieve] {row['n_retrieved']} documents")
        for d in row["retrieved"]:
            # a LangChain retriever may give no score
            score = "" if d["retrieval_score"] is None else f"  score {d['retrieval_score']:.2f}"
            print(f"    {d['rank']:>2}. {d['parent_id']}{score}  {d['title']}")
    elif name == "grade":
        print(f"[grade] {row['n_relevant']} of {row['n_retrieved']} relevant")
        for d in row["graded"]:
            print(f"    {_grade_shown(d)}  {d['parent_id']}")
    elif name == "decide":
        print(f"[decide] {row['decisions'][-1]['decision']}: {row['decisions'][-1]['reason']}")
    elif name == "rewrite" and row["web_query"] is not None:
        print(f"[rewrite] web query: {row['web_query']}")
    elif name == "web_search" and row["web_query"] is not None:
        print(f"[web_search] {row['n_web']} results for {row['web_query']!r}")
        for d in row["web_results"]:
            grade = f"{_grade_shown(d)}  " if "grade" in d else ""
            print(f"    {grade}{d['title']}  {d.get('url') or ''}")
    elif name == "refine":
        for entry in row["decisions"]:
            if entry["step"] == "last_resort":  # an answer from a document graded irrelevant: say so
                print(f"[last_resort] {entry['decision']}: {entry['reason']}")
        print(f"[context] {len(row['context'])} documents")
    elif name == "generate":
        print(f"[generate] route {row['route']}" + (f", error: {raised}" if raised else ""))
        if row["answer"] is not None:
            for line in textwrap.wrap(row["answer"], 100):  # its line breaks and tabs become spaces
                print(f"    {line}")
        for s in row["sources"]:
            print(f"    source: {s['source']} {s['doc_id']} {s['title']} {s['url'] or ''}".rstrip())


def _grade_shown(doc) -> str:
    """A document's grade and relevance, or that the grader's output could not be read (it counts as
    "no", and must not look like a model's "no")."""
    if doc.get("parse_status") == "failed":
        return "unreadable"
    return f"{doc['grade']:>3}  {doc['relevance']:.2f}"


def _backends_line(cfg) -> str:
    """What answers: each stage's backend by its config name (bm25, lexical, extractive: no model),
    and the model endpoint of each stage that calls one."""
    models = cfg.llm_roles()
    stages = ("retriever", "grader", "rewriter", "web_search", "generator")
    return "[backends] " + ", ".join(
        f"{name} {getattr(cfg, name).backend}" + (f" ({models[name].endpoint})" if name in models else "")
        for name in stages
    )


def _print_untrusted(*values, **kwargs) -> None:
    """Print a line that holds what documents, web pages and services said: without secrets (scrub),
    and with their control and format characters shown as escapes ("\\x1b"), so that none clears the
    screen, sets the terminal's title, rings its bell, reorders the text or starts a line of its own."""
    print(*(_escaped(scrub(str(v))) for v in values), **kwargs)


def _escaped(text: str) -> str:
    return "".join(
        c.encode("unicode_escape").decode("ascii") if unicodedata.category(c) in ("Cc", "Cf") else c for c in text
    )


def _warehouse(args):
    """The Warehouse of --warehouse, on the session of --conf's spark section (Spark Connect with
    spark.remote), or the defaults."""
    from crag.config import load_config
    from crag.spark import get_spark
    from crag.warehouse import Warehouse

    cfg = load_config(args.conf, _overrides(args))  # without --conf: the defaults, with --set on top
    return Warehouse(get_spark(cfg.spark), args.warehouse, cfg.tables)


def _session_args(p: argparse.ArgumentParser) -> None:
    """For commands that only read and write tables: which Spark session (e.g. --set spark.remote=...)."""
    p.add_argument(
        "--conf",
        help="YAML config file (or the name of a shipped one) whose spark and tables sections to use "
        "(default: built-in)",
    )
    _set_args(p, "spark.remote=sc://localhost:15002")


def _format_arg(p: argparse.ArgumentParser) -> None:
    from crag.console import FORMATS

    p.add_argument(
        "--format",
        choices=FORMATS,
        default="table",
        help="table (fits the terminal), csv, json (one object per line) or markdown",
    )


class _EscapedFormatter(logging.Formatter):
    """A log line quotes what crag was given (an id, a path, a service's reply): its control and
    format characters are escapes, as on the rest of the screen (a traceback, with CRAG_DEBUG=1,
    keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return _escaped(super().formatMessage(record))


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a line is logged (a test, or a caller, may replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def _setup_logging() -> None:
    """crag's progress on stderr as `crag: ...` lines (set up once per process); other libraries'
    notices stay quiet."""
    logger = logging.getLogger("crag")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(_EscapedFormatter("crag: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for noisy in ("py4j", "pyspark", "mlflow", "alembic", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _emulate(args) -> int:
    import time

    from crag.emulators import Emulator

    for path in (args.kb_index, args.web_index):
        if path:
            from crag.backends.bm25 import load_index

            load_index(path)  # a missing index is a clear error now, not a 404 later
    try:
        emulator = Emulator(args.kb_index, args.web_index, token=args.token, port=args.port)
    except OverflowError:
        raise CragError(f"--port {args.port}: a port is a number from 0 to 65535") from None
    except OSError as exc:
        reason = (
            "is in use: stop what holds it or choose another with --port"
            if exc.errno == errno.EADDRINUSE
            else f"cannot be served: {exc.strerror or exc}"
        )
        raise CragError(f"port {args.port} {reason}") from None
    with emulator:
        token = args.token or "local-token"
        print(f"emulating Databricks serving + Vector Search, OpenAI chat and Tavily at {emulator.url}")
        print("use them with:")
        print(
            f"  export DATABRICKS_HOST={emulator.url} DATABRICKS_TOKEN={token} TAVILY_API_KEY={token} OPENAI_API_KEY={token}"
        )
        print(f"  export TAVILY_API_BASE_URL={emulator.url} OPENAI_BASE_URL={emulator.url}/v1")
        print("Ctrl-C stops.", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


def _index(args) -> int:
    from crag.config import load_config
    from crag.indexing import build_knowledge_base

    cfg = load_config(args.conf, _overrides(args), args.variant)
    manifest = build_knowledge_base(args.docs, args.out, cfg)
    print(
        f"indexed {manifest['n_documents']} documents -> {manifest['n_parents']} parents, "
        f"{manifest['n_chunks']} child chunks at {args.out}"
        + (f"; Vector Search index {manifest['vector_index']}" if "vector_index" in manifest else "")
    )
    return 0


def _run(args) -> int:
    from crag.job import run

    if args.resume and args.run_id and args.resume != args.run_id:
        raise CragError("give either --run-id or --resume, not two different ids")
    overrides = [*_overrides(args), "cache.enabled=false"] if args.no_cache else _overrides(args)
    result = run(
        args.conf,
        args.questions,
        args.warehouse,
        args.variant,
        args.resume or args.run_id,
        overrides,
        resume=bool(args.resume),
        progress=args.progress,
    )
    print(result.summary())
    if result.status == "failed":  # a scheduled job's task fails with it
        where = "its tables were left as they were" if result.kept_earlier_rows else "its answers table has each one"
        first = _escaped(result.first_error or "?")[:300]  # a service's text, on one line
        raise CragError(
            f"run {result.run_id} is recorded as failed: every one of its {result.counts.accepted} "
            f"accepted questions ended in an error ({where}; one of them: {first}): once that is mended, "
            f"answer it again with --run-id {result.run_id}"
        )
    return 0


def _eval(args) -> int:
    from crag.console import render_metrics, slice_names
    from crag.evaluation import evaluate_run, run_record

    if args.slices is not None:
        slice_names(args.slices)  # a wrong name is said before any metric is written
    warehouse = _warehouse(args)
    run_record(warehouse, args.run_id, args.allow_unfinished, "evaluate")
    metrics = evaluate_run(warehouse, args.run_id)
    print(f"crag: run {args.run_id}: {len(metrics)} metric values written to the metrics table", file=sys.stderr)
    print(render_metrics(metrics, args.slices, args.format))
    return 0


def _calibrate(args) -> int:
    import json

    from crag.calibration import calibrate_run, report
    from crag.evaluation import run_record

    wh = _warehouse(args)
    # a failed re-run's row holds its own config beside the earlier attempt's grades
    recorded = run_record(wh, args.run_id, args.allow_unfinished, "calibrate")
    for line in report(calibrate_run(wh, args.run_id, json.loads(recorded["config"]))).splitlines():
        _print_untrusted(line)
    return 0


def _compare(args) -> int:
    from crag.compare import compare

    _, lines, path = compare(
        _warehouse(args), args.base, args.candidate, args.report, not args.no_mlflow, args.allow_unfinished
    )
    for line in [*lines, f"report: {path}"]:  # config values and ids are the user's text
        _print_untrusted(line)
    return 0


def _sql(args) -> int:
    from crag.console import render
    from crag.sql import query

    if not 0 < args.timeout <= 86400:
        raise CragError(f"--timeout {args.timeout:g}: give seconds, more than 0 and at most 86400")
    print(render(query(args.warehouse, args.sql, args.timeout), args.format))
    return 0


def _ask(args) -> int:
    import pandas as pd

    from crag.backends import build_backends, resolve_credentials
    from crag.config import load_config, resolve_paths
    from crag.questions import check_one
    from crag.stages import run_pipeline

    cfg = resolve_paths(load_config(args.conf, _overrides(args), args.variant))
    check_one("ask", args.question, cfg.input.max_question_chars)
    question = pd.DataFrame({"question_id": ["ask"], "question": [args.question]})
    backends = build_backends(cfg, resolve_credentials(cfg))
    print(_backends_line(cfg))
    error = run_pipeline(question, backends, cfg, on_stage=_StagePrinter()).iloc[0]["error"]
    if error is not None:  # the question failed: one line and exit code 2, as for an error crag names
        _print_untrusted(f"crag: error: {error}", file=sys.stderr)
        return 2
    return 0


def _spark(args) -> int:
    from crag import spark_server
    from crag.config import load_config

    if args.action == "status":
        state = spark_server.ServerState.read()
        print(f"a Spark server runs at {state.url} (pid {state.pid})" if state else "no Spark server runs")
        return 0
    if args.action == "stop":
        state = spark_server.stop()
        print(f"stopped the Spark server at {state.url}" if state else "no Spark server ran")
        return 0
    cfg = load_config(args.conf, _overrides(args)).spark
    running = spark_server.ServerState.read()
    state = running or spark_server.start(cfg, args.port)
    print(
        f"a Spark server {'runs' if running else 'started'} at {state.url}: crag commands use it until crag spark stop"
    )
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM, taken the same way as Ctrl-C: the run records its failure and says how to resume."""


def _on_sigterm(signum, frame) -> None:
    # No call into Spark from here: the main thread may be inside a py4j call on the same connection.
    # The Spark jobs end with the process.
    _stop_retrying()
    raise Terminated()


def _on_sigint(previous, signum, frame) -> None:
    _stop_retrying()
    # then Ctrl-C as before: pyspark's handler (it cancels the session's jobs) or KeyboardInterrupt
    (previous if callable(previous) else signal.default_int_handler)(signum, frame)


def _stop_retrying() -> None:
    """A Spark Connect server that stopped answering is not waited for once the command is interrupted:
    the run's failure is recorded with one try (crag.connect)."""
    if "crag.connect" in sys.modules:
        sys.modules["crag.connect"].stop_retrying()


# py4j logs, traceback and all, through the root logger and its own, each failure it then raises,
# and the failures of pyspark's Ctrl-C handler calling into the JVM from inside a py4j call: crag
# reports what it is given in one line (or with CRAG_DEBUG=1, in full) instead.
_INTERRUPT_LOGGERS = ("", "py4j", "py4j.java_gateway", "py4j.clientserver")


class _NoInterruptTracebacks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info:
            return True
        from_py4j = record.name.startswith("py4j") or f"{os.sep}py4j{os.sep}" in (record.pathname or "")
        return not (from_py4j or interrupt_in(record.exc_info[1]) is not None)


def _resume_hint(args) -> str:
    """The command that continues an interrupted `crag run`."""
    run_id = args.resume or args.run_id
    words = [
        "crag",
        "run",
        "--resume",
        run_id,
        "--conf",
        args.conf,
        "--questions",
        args.questions,
        "--warehouse",
        args.warehouse,
    ]
    if args.variant:
        words += ["--variant", args.variant]
    for item in _overrides(args):
        key, sep, _ = item.partition("=")
        # a --set value may hold a credential: a secret-looking key's value is masked (as the stored
        # config masks it), and any known secret or URL credential elsewhere by scrub
        words += ["--set", f"{key}={MASK}" if sep and is_secret_key(key.rsplit(".", 1)[-1]) else item]
    if args.no_cache:
        words.append("--no-cache")
    return scrub(" ".join(shlex.quote(w) for w in words))


def _known_errors() -> tuple[type[BaseException], ...]:
    """Failures of the environment rather than bugs in crag, as one line each: the file system (a
    warehouse that is a file or read-only, a full disk), unreadable Arrow / Parquet / Delta data, and
    errors Spark reports. Only libraries already loaded are looked at, so none is imported for this."""
    classes: list[type[BaseException]] = [OSError]
    for module, name in (
        ("pyarrow", "ArrowException"),
        ("deltalake.exceptions", "DeltaError"),
        ("pyspark.errors", "PySparkException"),
        ("py4j.protocol", "Py4JError"),
    ):
        found = getattr(sys.modules.get(module), name, None)
        if isinstance(found, type) and issubclass(found, BaseException):
            classes.append(found)
    return tuple(classes)


def main(argv: list[str] | None = None) -> int:
    """The command, with every way it can end reduced to one line on stderr: an error crag names (exit
    2), a known failure of files, data or Spark (exit 2; CRAG_DEBUG=1 shows its traceback), or Ctrl-C /
    SIGTERM (exit 130 / 143, with the command that resumes an interrupted run)."""
    args = parser().parse_args(argv)
    _setup_logging()
    if args.command == "run" and not (args.run_id or args.resume):
        from crag.ids import run_id_or_new

        args.run_id = run_id_or_new(None)  # chosen here, so that an interrupted run can be named in the resume line
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main_thread else None
    previous_int = signal.getsignal(signal.SIGINT)
    if in_main_thread:
        signal.signal(signal.SIGINT, functools.partial(_on_sigint, previous_int))
    quiet = _NoInterruptTracebacks() if not os.environ.get("CRAG_DEBUG") else logging.Filter()
    interrupted = False
    for name in _INTERRUPT_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    try:
        return args.func(args)
    except CragError as exc:  # its text may quote the user's (a path, a key): shown escaped, as all text here
        print(f"crag: error: {_escaped(scrub(str(exc)))}", file=sys.stderr)
        return 2
    except BrokenPipeError as exc:
        if not _stdout_gone():  # another pipe or socket: a failure like any other
            print(f"crag: error: {describe(exc, limit=500)}", file=sys.stderr)
            return 2
        # the reader went away (crag sql ... | head): nothing more to say, to no one, nor at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a process ended by SIGPIPE
    except KeyboardInterrupt as exc:
        interrupted = True
        return _say_interrupted(args, exc)
    except Exception as exc:
        debug = bool(os.environ.get("CRAG_DEBUG"))
        interrupt, known = interrupt_in(exc), isinstance(exc, _known_errors())
        if debug or (interrupt is None and not known):  # CRAG_DEBUG=1, or a bug: the traceback
            _print_traceback(exc)
        if interrupt is not None:
            interrupted = True
            return _say_interrupted(args, interrupt)
        if not known:
            return 1  # as Python exits on an uncaught exception
        hint = "" if debug else " (CRAG_DEBUG=1 shows the traceback)"
        connect = sys.modules.get("crag.connect")  # loaded once a Spark Connect session is made
        line = (connect.lost_server(exc) if connect else None) or describe(exc, limit=500)
        print(f"crag: error: {_escaped(scrub(line))}{hint}", file=sys.stderr)
        return 2
    finally:
        for name in _INTERRUPT_LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)
        if "crag.connect" in sys.modules:  # no call at exit to a server that is gone, nor after Ctrl-C
            sys.modules["crag.connect"].release_sessions(interrupted)


def _print_traceback(exc: BaseException) -> None:
    """`exc`'s traceback on stderr as Python prints it, scrubbed: an exception's text may carry a
    secret (crag.secrets)."""
    print(scrub("".join(traceback.format_exception(exc))), end="", file=sys.stderr)


def _stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it (poll reports an error on it)."""
    import select  # noqa: PLC0415

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or no file behind stdout
        return False


def _say_interrupted(args, exc: KeyboardInterrupt) -> int:
    how = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
    if args.command == "run":
        run_id = args.resume or args.run_id
        print(f"crag: {how}: run {run_id} did not finish; continue it with: {_resume_hint(args)}", file=sys.stderr)
    else:
        print(f"crag: {how}", file=sys.stderr)
    return 143 if isinstance(exc, Terminated) else 130


def command() -> None:
    """The `crag` command (`python -m crag.cli`): main, then the process ends with its exit code. Every
    object the command leaves is frozen first: Python's last garbage collection at exit would otherwise
    walk all of them (pandas, pyarrow, the Spark Connect client), 0.6-0.7 s of a 7 s warm `crag run`,
    to free memory the exit frees anyway. Objects in reference cycles are then not finalised at exit:
    crag's files and connections are closed by the command itself, and atexit handlers (logging's
    flush among them) still run. (Not in `main`, which tests and the bundle's job scripts call in
    processes that go on.)"""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    command()
