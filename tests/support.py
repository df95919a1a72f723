"""Paths and constants the tests share (fixtures are in conftest.py)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "sample"
LOCAL_CONF = REPO / "conf" / "local.yaml"
TOKEN = "test-token-4f9a"  # recognisable, so tests can search outputs for it
