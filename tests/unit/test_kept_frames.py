"""crag.spark.kept: a frame read several times (crag compare, crag calibrate) is cached where the session
can cache, and read uncached where it cannot; neither way does the block's own error get lost."""

from __future__ import annotations

import logging

import pytest

from crag.spark import kept


class Frame:
    """The two calls kept() makes of a DataFrame, and what became of them."""

    def __init__(self, refuses: Exception | None = None, release_fails: bool = False):
        self.refuses, self.release_fails, self.released = refuses, release_fails, False

    def persist(self):
        if self.refuses:
            raise self.refuses
        return self

    def unpersist(self):
        if self.release_fails:
            raise ConnectionError("the server has gone")
        self.released = True


def test_a_frame_is_cached_for_the_block_and_released_after_it():
    frame = Frame()
    with kept(frame) as parts:
        assert parts is frame and not frame.released
    assert frame.released


def test_a_session_that_refuses_to_cache_gets_the_frame_itself(caplog):
    """As Databricks serverless before environment version 5 does."""
    frame = Frame(refuses=RuntimeError("[CACHE_REQUIRES_NEWER_CLIENT_ON_SERVERLESS_GC] caching needs a newer client"))
    with caplog.at_level(logging.INFO, logger="crag"), kept(frame) as parts:
        assert parts is frame
    assert not frame.released
    assert "not cached (RuntimeError: [CACHE_REQUIRES_NEWER_CLIENT_ON_SERVERLESS_GC]" in caplog.text


def test_the_blocks_own_error_is_the_one_raised_when_release_fails_too():
    with pytest.raises(ValueError, match="the block's"), kept(Frame(release_fails=True)):
        raise ValueError("the block's")
