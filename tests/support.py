"""Paths and constants the tests share (fixtures are in conftest.py)."""

import json
from html.parser import HTMLParser
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "sample"
LOCAL_CONF = REPO / "conf" / "local.yaml"
TOKEN = "test-token-4f9a"  # recognisable, so tests can search outputs for it
# Answers as the console shows them: English over two lines, and wide Japanese text.
ANSWER_EN = "Replace the HEPA-13 main filter every twelve months.\nVacuum the pre-filter every two weeks."
ANSWER_JA = "富士山は日本で一番高い山です。標高は3776メートルで、静岡県と山梨県にまたがっています。"


def set_args(overrides) -> list[str]:
    """`--set KEY=VALUE` for each override."""
    return [arg for override in overrides for arg in ("--set", override)]


def crag_run_args(
    warehouse, *extra: str, questions=SAMPLE / "questions.jsonl", conf=LOCAL_CONF, overrides=()
) -> list[str]:
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


def run_rows(warehouse, name: str, run_id: str | None = None):
    """A table or view of a local warehouse (one run's rows, when given), read without a JVM as `crag sql`
    reads it (crag.sql: delta-rs and DataFusion, with crag's views)."""
    from crag.sql import read_table

    rows = read_table(warehouse, name).to_pandas()
    return rows if run_id is None else rows[rows["run_id"] == run_id].reset_index(drop=True)


def committed_questions(warehouse, run_id: str) -> set[str]:
    """The questions a run has committed answers for so far, in any of its generations (none while its
    first commit is under way)."""
    from deltalake import DeltaTable

    folder = Path(warehouse) / "results"
    if not any((folder / "_delta_log").glob("*.json")):
        return set()
    rows = DeltaTable(str(folder)).to_pyarrow_table(columns=["question_id"], filters=[("run_id", "=", run_id)])
    return set(rows.column("question_id").to_pylist())


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


def uniform_questions(path: Path, n: int) -> Path:
    """n copies of one question under n ids, as JSONL: each takes the same route and the same calls,
    so every task of a batch ends at about the same time (a task that ended early would free its slot)."""
    path.write_text(
        "".join(
            json.dumps({"question_id": f"u{i:03d}", "question": "How high is Mount Fuji?"}) + "\n" for i in range(n)
        )
    )
    return path
