"""The knowledge base on Databricks Vector Search: a Delta Sync index over the chunk table's child
chunks, embedded by a model-serving endpoint (reference flow 1 uses BGE-M3 for Japanese), created on
the first `crag index` and synced on later ones; and the retriever over it (databricks-vectorsearch):
the top-k children of each question, expanded to their parent chunks and de-duplicated by parent, as
the embedded BM25 retriever does. The client is thread-safe, so one index object serves every thread."""

from __future__ import annotations

from crag.backends.base import Document
from crag.backends.remote import Endpoint, http_status, workspace_credentials
from crag.config import VectorSearchRetrieverConfig
from crag.errors import ConfigError, describe
from crag.secrets import scrub

# Opening the index happens before any work starts (on the driver first): a wrong token, a wrong host or
# a service that does not answer should end the run in seconds with one line, not after the policy's
# full retries of a long per-call timeout. A Spark task opens it again after the driver did: there, the
# service has been shown to answer, and one that does not is retried as any call is (a task that failed
# over one hang would fail the run).
STARTUP_TIMEOUT_S = 20.0
STARTUP_ATTEMPTS = 2


def vector_search_client(cfg: VectorSearchRetrieverConfig, secrets: dict[str, str] | None):
    """A client with the configured host and token, or the runtime's own auth on Databricks."""
    from databricks.ai_search.client import AISearchClient  # noqa: PLC0415  # databricks-ai-search (the renamed databricks-vectorsearch): only this backend pays

    workspace = workspace_credentials(cfg, f"Vector Search index {cfg.index_name!r}", secrets)
    if workspace is not None:
        return AISearchClient(workspace_url=workspace[0], personal_access_token=workspace[1], disable_notice=True)
    return AISearchClient(disable_notice=True)


def _open_index(client, cfg: VectorSearchRetrieverConfig, opened_before: bool):
    """The index object, or a ConfigError that names the endpoint, the index and what went wrong. On
    the first open, a service that does not answer is given STARTUP_ATTEMPTS attempts of at most
    STARTUP_TIMEOUT_S (a wrong host fails in seconds, not minutes); `opened_before` (a Spark task, after
    the driver's open) gives it the policy's attempts. One that answers with a transient error (429,
    5xx) is retried as any call is: every Spark task opens the index, and one 500 must not fail the
    batch."""
    policy = cfg.policy.model_copy(update={"timeout_s": min(cfg.policy.timeout_s, STARTUP_TIMEOUT_S)})
    endpoint = Endpoint(f"vector_search:{cfg.index_name}", policy, hard_timeout=True)
    try:
        return endpoint.call(
            lambda: client.get_index(endpoint_name=cfg.endpoint, index_name=cfg.index_name),
            unanswered_attempts=None if opened_before else STARTUP_ATTEMPTS,
        )
    except Exception as exc:
        raise unusable(cfg, client, exc) from None


def unusable(cfg: VectorSearchRetrieverConfig, client, exc: Exception) -> ConfigError:
    """One line naming the endpoint, the index, the workspace and what went wrong."""
    status = http_status(exc)
    if status in (401, 403):
        reason = f"HTTP {status}: check the token ({cfg.token_env} or token_secret) and its permissions"
    elif status == 404:
        reason = "HTTP 404: no such endpoint or index"
    else:
        reason = describe(exc)
    where = getattr(client, "workspace_url", None) or "the workspace"
    return ConfigError(
        scrub(f"Vector Search endpoint {cfg.endpoint!r} (index {cfg.index_name!r}) at {where} is not usable: {reason}")
    )


def sync_vector_index(cfg: VectorSearchRetrieverConfig, secrets: dict[str, str] | None = None) -> str:
    """Create the Delta Sync index over cfg.source_table if it does not exist, else start a sync.
    Returns "created" or "synced"."""
    if not cfg.source_table:
        raise ConfigError(
            "config key 'retriever.source_table' is required to build a Vector Search index "
            "(the Unity Catalog chunk table it syncs from)"
        )
    client = vector_search_client(cfg, secrets)
    endpoint = Endpoint(f"vector_search:{cfg.index_name}", cfg.policy, hard_timeout=True)

    def opened():
        return endpoint.call(lambda: client.get_index(endpoint_name=cfg.endpoint, index_name=cfg.index_name))

    try:
        index = opened()
    except Exception as exc:
        if type(exc).__name__ != "NotFound":
            raise unusable(cfg, client, exc) from None
        try:
            endpoint.call(
                lambda: client.create_delta_sync_index(
                    endpoint_name=cfg.endpoint,
                    index_name=cfg.index_name,
                    source_table_name=cfg.source_table,
                    pipeline_type=cfg.pipeline_type,
                    primary_key="chunk_id",
                    embedding_source_column=cfg.columns.chunk_text,
                    embedding_model_endpoint_name=cfg.embedding_endpoint,
                )
            )
        except Exception as exc:
            if http_status(exc) != 409:
                raise unusable(cfg, client, exc) from None
            # 409: the index is there, made by a creation whose reply was lost (a timeout or a 5xx after
            # the service had created it, then retried) or by another build at the same moment, which
            # may have begun its first sync before this build wrote the chunk table: sync it.
            index = opened()
        else:
            return "created"
    endpoint.call(index.sync)
    return "synced"


class VectorSearchRetriever:
    def __init__(
        self,
        cfg: VectorSearchRetrieverConfig,
        secrets: dict[str, str] | None = None,
        concurrent_tasks: int = 1,
        opened_before: bool = False,
    ):
        self.cfg = cfg
        # The client has no request timeout of its own: the endpoint enforces one around each call.
        self._endpoint = Endpoint(f"vector_search:{cfg.index_name}", cfg.policy, concurrent_tasks, hard_timeout=True)
        self.concurrency = self._endpoint.concurrency
        client = vector_search_client(cfg, secrets)
        self._index = _open_index(client, cfg, opened_before)
        c = cfg.columns
        self._columns = list(dict.fromkeys([c.chunk_text, c.parent_id, c.parent_text, c.doc_id, c.title, c.url]))
        self.name = "databricks_vector_search"

    def _query(self, question: str, k: int, usage=None) -> list[Document]:
        reply = self._endpoint.call(
            lambda: self._index.similarity_search(
                columns=self._columns,
                query_text=question,
                num_results=k,
                filters=self.cfg.filters,
                query_type=self.cfg.query_type,
                total_retries=0,  # crag's policy retries instead
                disable_notice=True,
            ),
            usage,
        )
        if usage is not None:
            usage.search_calls += 1
        names = [col["name"] for col in reply.get("manifest", {}).get("columns", [])]
        c = self.cfg.columns
        docs: list[Document] = []
        seen: set[str] = set()
        for row in reply.get("result", {}).get("data_array") or []:
            values = dict(zip(names, row))
            parent_id = str(values.get(c.parent_id))
            if parent_id in seen:
                continue
            seen.add(parent_id)
            docs.append(
                {
                    "source": "internal",
                    "doc_id": values.get(c.doc_id) or parent_id,
                    "parent_id": parent_id,
                    "title": values.get(c.title),
                    "url": values.get(c.url),
                    "text": values.get(c.parent_text) or values.get(c.chunk_text) or "",
                    "retrieval_score": float(row[-1]),  # the score is always the last element
                    "rank": len(seen),
                }
            )
        return docs

    def search(self, queries: list[str], k: int, usages=None) -> list[list[Document]]:
        return [self._query(q, k, u) for q, u in zip(queries, usages or [None] * len(queries))]
