"""crag.errors.describe: an exception as one line for a message, without its secrets."""

from __future__ import annotations

import pytest

from crag import secrets
from crag.errors import describe

SECRET = "tok-Vq93-abcdefghijklmnop"


pytestmark = pytest.mark.usefixtures("fresh_registry")


def test_the_first_line_with_the_type():
    exc = ValueError("  bad value\n  Traceback-like detail\nmore")
    assert describe(exc) == "ValueError: bad value"
    assert describe(exc, with_type=False) == "bad value"


def test_an_exception_without_text_is_named_by_its_type():
    assert describe(KeyError()) == "KeyError"
    assert describe(RuntimeError("   \n "), with_type=False) == "RuntimeError"


def test_a_known_secret_is_masked_even_where_the_line_is_cut_through_it():
    secrets.remember([SECRET])
    exc = ConnectionError(f"POST https://user:{SECRET}@host/x failed; token {SECRET} refused")
    for limit in range(10, 90):
        text = describe(exc, limit=limit)
        assert len(text) <= limit
        # Not even a prefix of the secret long enough to matter survives the cut.
        assert SECRET[:8] not in text, (limit, text)
    assert secrets.MASK in describe(exc)


def test_a_first_line_that_only_introduces_the_cause_comes_with_it():
    datafusion = RuntimeError(
        "Optimizer rule 'simplify_expressions' failed\ncaused by\nArrow error: Cannot cast string 'x' to value of Int32 type"
    )
    assert describe(datafusion, with_type=False) == (
        "Optimizer rule 'simplify_expressions' failed: Arrow error: Cannot cast string 'x' to value of Int32 type"
    )
    grpc = RuntimeError(
        "<_InactiveRpcError of RPC that terminated with:\n\tstatus = StatusCode.UNAVAILABLE\n"
        '\tdetails = "failed to connect to all addresses"\n>'
    )
    assert 'status = StatusCode.UNAVAILABLE details = "failed to connect to all addresses"' in describe(grpc)
    assert (
        describe(RuntimeError("Table not found\n'Project [*]\n+- 'UnresolvedRelation"))
        == "RuntimeError: Table not found"
    )
