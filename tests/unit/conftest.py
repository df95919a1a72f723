"""The fast tier: no JVM, and nothing slow to wait for (a child process, a browser, the embedding model or a
time limit: those tests are in tests/slow). A test here that asks for a Spark session belongs in tests/spark."""

import pytest


@pytest.fixture(scope="session")
def spark():
    pytest.fail("tests/unit runs without a JVM: move a test that needs Spark to tests/spark")


@pytest.fixture
def jars_dir(tmp_path):
    """A folder of (empty) Delta Lake jars, as `make install` fetches them: what crag.spark needs of them
    to name the session's jars and the class-data archive, without a JVM."""
    folder = tmp_path / "jars"
    folder.mkdir()
    for name in ("delta-spark_4.2_2.13-4.4.0.jar", "delta-storage-4.4.0.jar"):
        (folder / name).write_bytes(b"jar")
    return folder
