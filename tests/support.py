"""Paths and constants the tests share (fixtures are in conftest.py)."""

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
    """A table of a local warehouse (one run's rows, when given), read with delta-rs."""
    from deltalake import DeltaTable

    filters = [("run_id", "=", run_id)] if run_id else None
    return DeltaTable(str(Path(warehouse) / name)).to_pyarrow_table(filters=filters).to_pandas()


def staging_folder(warehouse, run_id: str, kind: str = "run_staging") -> Path:
    """Where an unfinished run keeps its committed batches (or, kind run_inputs, its validated input)."""
    from crag.warehouse import Warehouse

    return Path(warehouse) / Warehouse.staging(kind, run_id)


def staged_questions(warehouse, run_id: str) -> set[str]:
    """The questions an unfinished run has committed so far (none while its first commit is under way)."""
    from deltalake import DeltaTable

    folder = staging_folder(warehouse, run_id)
    if not any((folder / "_delta_log").glob("*.json")):
        return set()
    return set(DeltaTable(str(folder)).to_pandas()["question_id"])
