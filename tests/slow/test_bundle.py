"""The Databricks bundle checked by other processes: the official JSON schema's validator, and each job's
script run as its task runs it, failing with crag's exit code."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import BUNDLE_FILES, BUNDLE_JOBS, REPO, local_task

SCHEMA = REPO.parent / "shared" / "schemas" / "databricks-bundle.schema.json"


@pytest.mark.skipif(not SCHEMA.exists(), reason=f"bundle schema not found at {SCHEMA}")
def test_bundle_validates_against_the_official_schema():
    checker = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent))
    done = subprocess.run(
        [checker, "--schemafile", str(SCHEMA), *map(str, BUNDLE_FILES)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    "name", sorted(n for n in BUNDLE_JOBS if "config" in {p["name"] for p in BUNDLE_JOBS[n]["parameters"]})
)
def test_a_failing_job_script_fails_its_task(name):
    """A Python script task's result is the script's exit code: crag's one-line error must end the
    process with a non-zero code, not a clean return. (A config that is not there fails before Spark
    starts; compare_variants, which takes no config, fails on an unknown run in tests/spark.)"""
    values = {p["name"]: "x" for p in BUNDLE_JOBS[name]["parameters"]} | {"config": "no-such-config.yaml"}
    script, params = local_task(name, values, {"warehouse": "w"})
    done = subprocess.run([sys.executable, str(script), *params], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 2 and done.stderr.startswith("crag: error: ") and "no-such-config.yaml" in done.stderr
