"""Paths, constants and helpers the tests share (fixtures are in conftest.py)."""

import importlib.util
import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "sample"
SAMPLE_QUESTIONS = SAMPLE / "questions.jsonl"
LOCAL_CONF = REPO / "conf" / "local.yaml"
TOKEN = "test-token-4f9a"  # recognisable, so tests can search outputs for it
PASSWORD = "pw-Zq81-secret"  # a credential the secret tests put in URLs and settings, and search for
# The run ids of the Spark tier's shared runs (tests/spark/conftest.py): the sample's, and the variant
# pair's as the bundle's crag_batch job names them ({variant}-{job run id}, the job run being local1).
SAMPLE_RUN = "sample-1"
BASE_RUN, CANDIDATE_RUN = "base-local1", "paper_thresholds-local1"
# Answers as the console shows them: English over two lines, and wide Japanese text.
ANSWER_EN = "Replace the HEPA-13 main filter every twelve months.\nVacuum the pre-filter every two weeks."
ANSWER_JA = "富士山は日本で一番高い山です。標高は3776メートルで、静岡県と山梨県にまたがっています。"


# The Databricks bundle: databricks.yml, then the resources it includes.
BUNDLE_FILES = [REPO / "databricks.yml", *sorted((REPO / "resources").glob("*.yml"))]
BUNDLE = yaml.safe_load(BUNDLE_FILES[0].read_text())
BUNDLE_RESOURCES = {
    kind: items for f in BUNDLE_FILES[1:] for kind, items in yaml.safe_load(f.read_text())["resources"].items()
}
BUNDLE_JOBS = BUNDLE_RESOURCES["jobs"]


def set_args(overrides) -> list[str]:
    """`--set KEY=VALUE` for each override."""
    return [arg for override in overrides for arg in ("--set", override)]


def crag_run_args(warehouse, *extra: str, questions=SAMPLE_QUESTIONS, conf=LOCAL_CONF, overrides=()) -> list[str]:
    """The arguments of `crag run`: a config (the embedded one unless given) with its `--set` overrides
    (a test's `index_overrides` point it at the sample indexes), the questions (the sample's unless given),
    the warehouse, then `extra` (`--run-id`, `--resume`, ...)."""
    return [
        "run",
        "--conf",
        str(conf),
        *set_args(overrides),
        "--questions",
        str(questions),
        "--warehouse",
        str(warehouse),
        *extra,
    ]


def databricks_grader(kb: str, web: str) -> list[str]:
    """Overrides of the embedded config (the sample indexes `kb` and `web`, MLflow off) whose grader is a
    Databricks model serving endpoint, given up on quickly."""
    return [
        f"retriever.index={kb}",
        f"web_search.index={web}",
        "mlflow.enabled=false",
        "grader.backend=databricks",
        "grader.endpoint=grader-x",
        "grader.prompt=prompts/grade_binary.yaml",
        "grader.policy.max_attempts=2",
        "grader.policy.backoff_initial_s=0.01",
        "grader.policy.timeout_s=5",
    ]


def copy_warehouse(warehouse, to: Path) -> Path:
    """A copy of a shared run's warehouse (tests/spark/conftest.py), for a test that writes to it: its
    tables are plain Delta folders, and crag names each table by its path, so the copy is a warehouse
    apart."""
    shutil.copytree(warehouse, to)
    return to


def crag_command(*args: str, home: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """A `crag` command in a process of its own, run from the checkout, its output captured; `home`:
    its CRAG_HOME (where the warm Spark server's state is)."""
    env = None if home is None else {**os.environ, "CRAG_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "crag.cli", *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout
    )


def crag_on(url: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """A `crag` command on the Spark Connect server at `url`, in a process of its own; it must succeed
    unless `check` is false."""
    done = crag_command(*args, "--set", f"spark.remote={url}")
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def start_crag(*args: str) -> subprocess.Popen:
    """A `crag` command in a process (and session) of its own, its output piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "crag.cli", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def ended(process: subprocess.Popen, within_s: float) -> tuple[int, str]:
    """The process's exit code and stderr, once it ends; the test fails (and the process's session is
    killed) when it has not ended within `within_s`."""
    try:
        _, err = process.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"the command did not end within {within_s:g} s")
    return process.returncode, err


def write_bytes(folder: Path, name: str, content: bytes) -> str:
    """A file of `content` in `folder`; its path."""
    path = folder / name
    path.write_bytes(content)
    return str(path)


def assert_run_refused(extra: list[str], message: str, warehouse: Path, overrides, capsys) -> None:
    """`crag run` with the `extra` arguments (a case's own --conf or --questions in place of the
    defaults) ends with exit code 2 and one line that says `message`, before anything is written."""
    from crag.cli import main

    chosen = {}
    for flag in ("--conf", "--questions"):
        if flag in extra:
            i = extra.index(flag)
            chosen[flag.removeprefix("--")] = extra[i + 1]
            extra = extra[:i] + extra[i + 2 :]
    assert main(crag_run_args(warehouse, *extra, overrides=overrides, **chosen)) == 2
    err = capsys.readouterr().err
    assert err.startswith("crag: error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not (warehouse / "results").exists() and not (warehouse / "inputs").exists()


def run_rows(warehouse, name: str, run_id: str | None = None):
    """A table or view of a local warehouse (one run's rows, when given), read without a JVM as `crag sql`
    reads it (crag.sql: delta-rs and DataFusion, with crag's views)."""
    from crag.sql import read_table

    rows = read_table(warehouse, name).to_pandas()
    return rows if run_id is None else rows[rows["run_id"] == run_id].reset_index(drop=True)


def killed_once_committed(
    process: subprocess.Popen, warehouse, run_id: str, at_least: int, within_s: float
) -> set[str]:
    """SIGKILL to the process group of a `crag run` (started in a session of its own, its stderr piped)
    once it has committed answers to `at_least` questions: the questions committed by then. The test
    fails if the run ends first."""
    deadline = time.time() + within_s
    while time.time() < deadline and process.poll() is None:
        if len(committed_questions(warehouse, run_id)) >= at_least:
            break
        time.sleep(0.2)
    assert process.poll() is None, "the run ended before it could be killed: " + process.stderr.read().decode()[-1500:]
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    return committed_questions(warehouse, run_id)


def committed_questions(warehouse, run_id: str) -> set[str]:
    """The questions a run has committed answers for so far, in any of its generations (none while its
    first commit is under way)."""
    from deltalake import DeltaTable

    folder = Path(warehouse) / "results"
    if not any((folder / "_delta_log").glob("*.json")):
        return set()
    rows = DeltaTable(str(folder)).to_pyarrow_table(columns=["question_id"], filters=[("run_id", "=", run_id)])
    return set(rows.column("question_id").to_pylist())


def job_script(job: str) -> Path:
    """The script the bundle job's task runs (its python_file is relative to resources/, where it is declared)."""
    return (REPO / "resources" / BUNDLE_JOBS[job]["tasks"][0]["spark_python_task"]["python_file"]).resolve()


def local_task(job: str, values: dict[str, str], variables: dict[str, str]) -> tuple[Path, list[str]]:
    """The bundle job's script and its parameter list, with the bundle's substitutions made for a laptop:
    `values` for the job's parameters, `variables` for the bundle's, and local1 for the job run's id."""
    out = []
    for p in BUNDLE_JOBS[job]["tasks"][0]["spark_python_task"]["parameters"]:
        p = p.replace("${workspace.file_path}", str(REPO))
        p = re.sub(r"\$\{var\.(\w+)\}", lambda m: variables[m.group(1)], p)
        p = re.sub(r"\{\{job\.parameters\.(\w+)\}\}", lambda m: values[m.group(1)], p)
        out.append(p.replace("{{job.run_id}}", "local1"))
    return job_script(job), out


def run_job_task(job: str, values: dict[str, str], variables: dict[str, str]) -> int:
    """Runs the bundle job's script as a Python script task does (as __main__, its parameters in sys.argv),
    in this process, so that it shares the test session's Spark; the code it exits with."""
    script, params = local_task(job, values, variables)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [str(script), *params])
        with pytest.raises(SystemExit) as exit_:
            runpy.run_path(str(script), run_name="__main__")
    return exit_.value.code


def write_pdf(path, lines: list[str], title: str = "Hoshi AQ-7 Policy") -> None:
    """A minimal one-page PDF with Helvetica text, written by hand (no PDF library needed)."""
    text = " ".join(f"({line}) Tj 0 -16 Td" for line in lines)
    content = f"BT /F1 12 Tf 72 720 Td {text} ET"
    objects = [
        "<< /Type /Catalog /Pages 2 0 R >>",
        "<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> >> >>",
        f"<< /Length {len(content)} >>\nstream\n{content}\nendstream",
        "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        f"<< /Title ({title}) >>",
    ]
    out, offsets = b"%PDF-1.4\n", []
    for i, obj in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n{obj}\nendobj\n".encode()
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += "".join(f"{o:010d} 00000 n \n" for o in offsets).encode()
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R /Info 6 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    path.write_bytes(out)


# The library of each LangChain store the tests build (installed with the dev dependencies).
LANGCHAIN_LIBRARIES = {"faiss": "faiss", "chroma": "langchain_chroma", "bm25": "rank_bm25"}


def needs(*stores: str):
    """Skips a test when a store's library is not installed."""
    missing = [LANGCHAIN_LIBRARIES[s] for s in stores if importlib.util.find_spec(LANGCHAIN_LIBRARIES[s]) is None]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {', '.join(missing)}")


# Three short passages, two English and one Japanese, each answering other questions: what the
# embedding models' tests embed and index.
EMBEDDING_DOCS = [
    {"doc_id": "cat", "title": "Pets", "text": "The cat sleeps on the sofa all afternoon."},
    {
        "doc_id": "market",
        "title": "Finance",
        "text": "Stock prices fell sharply after the central bank raised interest rates.",
    },
    {"doc_id": "volcano", "title": "Geology", "text": "富士山は日本で最も高い山で、標高は3776メートルです。"},
]


def write_embedding_docs(path: Path) -> Path:
    """EMBEDDING_DOCS as a JSONL file for crag index."""
    path.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in EMBEDDING_DOCS), encoding="utf-8")
    return path


def assert_nearest_passages(model: str, questions: list[tuple[str, int]]) -> None:
    """The model embeds EMBEDDING_DOCS as unit vectors, and each question's nearest passage is the one
    given (its index in EMBEDDING_DOCS)."""
    import numpy as np

    from crag.backends.embedding import load_embedder

    embedder = load_embedder(model)
    passages = embedder.passages([d["text"] for d in EMBEDDING_DOCS])
    assert passages.shape == (3, embedder.dim) and np.allclose(np.linalg.norm(passages, axis=1), 1, atol=1e-3)
    for question, best in questions:
        assert int(np.argmax(passages @ embedder.query(question))) == best, question


class ReportMarkup(HTMLParser):
    """What the tests check in `crag compare`'s HTML report: every tag, the sections' ids, anything
    loaded from elsewhere (src, a linked file) and inline event handlers."""

    def __init__(self):
        super().__init__()
        self.sections, self.tags, self.external, self.inline_events = [], [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if tag == "section":
            self.sections.append(attrs.get("id"))
        if attrs.get("src") or (tag == "link" and attrs.get("href")):
            self.external.append((tag, attrs))
        self.inline_events += [name for name in attrs if name.startswith("on")]


def first_questions(path: Path, n: int) -> Path:
    """The sample's first n questions, as JSONL: a run that takes seconds, not a minute."""
    lines = [line for line in SAMPLE_QUESTIONS.read_text(encoding="utf-8").splitlines() if line.strip()]
    path.write_text("\n".join(lines[:n]) + "\n", encoding="utf-8")
    return path


def uniform_questions(path: Path, n: int) -> Path:
    """n copies of one question under n ids, as JSONL: each takes the same route and the same calls,
    so every task of a batch ends at about the same time (a task that ended early would free its slot)."""
    path.write_text(
        "".join(
            json.dumps({"question_id": f"u{i:03d}", "question": "How high is Mount Fuji?"}) + "\n" for i in range(n)
        )
    )
    return path
