"""The slow tier: no JVM either, but each test here waits on something the fast tier should not: a child
process (`crag sql` runs each query in one), headless Chromium, the embedding model, or a service that
hangs until a time limit. A test that asks for a Spark session belongs in tests/spark."""

import pytest


@pytest.fixture(scope="session")
def spark():
    pytest.fail("tests/slow runs without a JVM: move a test that needs Spark to tests/spark")
