"""Tavily web search, emulated: BM25 over the emulator's web index, with Tavily's domain filters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from crag.backends.bm25 import load_index

if TYPE_CHECKING:
    from crag.emulators.server import Emulator


def tavily(emulator: Emulator, method: str, path: str, body: Any, fault: str):
    if not emulator.web_index:
        return 200, {"query": body.get("query"), "answer": None, "images": [], "results": [], "response_time": 0.0}

    k = int(body.get("max_results") or 5)
    docs = load_index(emulator.web_index).search([body.get("query") or ""], k * 4, source="web", max_parents=k)[0]
    include, exclude = body.get("include_domains") or [], body.get("exclude_domains") or []
    docs = [
        d
        for d in docs
        if (not include or any(dom in (d["url"] or "") for dom in include))
        and not any(dom in (d["url"] or "") for dom in exclude)
    ]
    scores = [d["retrieval_score"] or 0.0 for d in docs]  # BM25 results always carry a score
    top = max(scores, default=1.0) or 1.0
    return 200, {
        "query": body.get("query"),
        "answer": None,
        "images": [],
        "results": [
            {
                "title": d["title"],
                "url": d["url"],
                "content": d["text"],
                "score": round((d["retrieval_score"] or 0.0) / top, 4),
                "raw_content": None,
            }
            for d in docs
        ],
        "response_time": 0.01,
        "request_id": f"req-{len(emulator.requests)}",
    }
