"""Web search with Tavily (tavily-python). Each result is its own document: title, url, the page
content as text, and Tavily's score."""

from __future__ import annotations

from crag.backends.base import Document
from crag.backends.remote import Endpoint, pooled_session, secret
from crag.config import TavilyConfig


class TavilySearch:
    def __init__(self, cfg: TavilyConfig, secrets: dict[str, str] | None = None, concurrent_tasks: int = 1):
        from tavily import TavilyClient  # noqa: PLC0415  # a cloud client: only this backend pays

        key = secret(cfg.api_key_env, cfg.api_key_secret, "Tavily web search", secrets)
        self.cfg = cfg
        self._endpoint = Endpoint("tavily", cfg.policy, concurrent_tasks)
        self.concurrency = self._endpoint.concurrency
        self._client = TavilyClient(
            api_key=key, api_base_url=cfg.api_base_url, session=pooled_session(self.concurrency)
        )
        self.name = "tavily"

    def search(self, query: str, k: int, usage=None, *, question: str | None = None) -> list[Document]:
        cfg = self.cfg
        reply = self._endpoint.call(
            lambda: self._client.search(
                query,
                search_depth=cfg.search_depth,
                topic=cfg.topic,
                max_results=k,
                include_domains=cfg.include_domains or None,
                exclude_domains=cfg.exclude_domains or None,
                timeout=cfg.policy.timeout_s,
            ),
            usage,
        )
        if usage is not None:
            usage.search_calls += 1
        return [
            {
                "source": "web",
                "doc_id": r.get("url") or f"tavily-{i}",
                "parent_id": r.get("url") or f"tavily-{i}",
                "title": r.get("title"),
                "url": r.get("url"),
                "text": r.get("content") or "",
                "retrieval_score": float(r.get("score") or 0.0),
                "rank": i + 1,
            }
            for i, r in enumerate(reply.get("results") or [])
        ]
