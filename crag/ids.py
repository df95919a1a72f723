"""Run ids: what a user may name a run."""

from __future__ import annotations

import re

from crag.errors import InputError

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise InputError(
            f"invalid run id {run_id!r}: use 1-128 letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    return run_id
