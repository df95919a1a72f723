"""The fast tier: no JVM, and nothing slow to wait for (a child process, a browser, the embedding model or a
time limit: those tests are in tests/slow). A test here that asks for a Spark session belongs in tests/spark."""

import pytest


@pytest.fixture(scope="session")
def spark():
    pytest.fail("tests/unit runs without a JVM: move a test that needs Spark to tests/spark")
