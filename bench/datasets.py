"""Locating and loading the shared QA datasets (../shared/data) for benchmarks.

Nothing from them is copied into the repository; a benchmark that needs them stops with a clear
message when they are absent.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    """CRAG_SHARED_DATA, else ../shared/data next to the repository."""
    return Path(os.environ.get("CRAG_SHARED_DATA", REPO.parent / "shared" / "data"))


def require_dataset(name: str) -> Path:
    path = shared_data_dir() / name
    if not (path / "questions.jsonl").exists():
        sys.exit(f"skipped: shared dataset {name!r} not found at {path} (set CRAG_SHARED_DATA to its parent folder)")
    return path


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def run_rows(warehouse: str | Path, name: str, run_id: str):
    """One run's rows of a table or view in a local warehouse, read without a JVM (crag.sql)."""
    from crag.sql import read_table

    rows = read_table(warehouse, name).to_pandas()
    return rows[rows["run_id"] == run_id].reset_index(drop=True)
