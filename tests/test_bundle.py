import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO.parent / "shared" / "schemas" / "databricks-bundle.schema.json"


@pytest.mark.skipif(not SCHEMA.exists(), reason=f"bundle schema not found at {SCHEMA}")
def test_bundle_validates_against_the_official_schema():
    checker = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent))
    done = subprocess.run([checker, "--schemafile", str(SCHEMA), str(REPO / "databricks.yml")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_bundle_job_calls_the_installed_entry_point():
    import tomllib

    import yaml

    bundle = yaml.safe_load((REPO / "databricks.yml").read_text())
    task = bundle["resources"]["jobs"]["crag_batch"]["tasks"][0]["python_wheel_task"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[task["entry_point"]] == "crag.cli:main"
    assert task["parameters"][0] == "run"
