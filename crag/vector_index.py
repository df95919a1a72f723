"""The knowledge base on Databricks: a Delta Sync Vector Search index over the chunk table's child
chunks, embedded by a model-serving endpoint (reference flow 1 uses BGE-M3 for Japanese). Created on
the first `crag index`, synced on later ones."""

from __future__ import annotations

from crag.backends.remote import Endpoint, secret
from crag.config import VectorSearchRetrieverConfig
from crag.errors import ConfigError


def vector_search_client(cfg: VectorSearchRetrieverConfig, secrets: dict[str, str] | None):
    """A client with the configured host and token, or the runtime's own auth on Databricks."""
    from databricks.ai_search.client import AISearchClient  # databricks-ai-search: the renamed databricks-vectorsearch

    what = f"Vector Search index {cfg.index_name!r}"
    host = secret(cfg.host_env, None, f"{what} (workspace URL)", secrets, optional_on_databricks=True)
    token = secret(cfg.token_env, cfg.token_secret, what, secrets, optional_on_databricks=True)
    if host and token:
        return AISearchClient(workspace_url=host, personal_access_token=token, disable_notice=True)
    return AISearchClient(disable_notice=True)


def sync_vector_index(cfg: VectorSearchRetrieverConfig, secrets: dict[str, str] | None = None) -> str:
    """Create the Delta Sync index over cfg.source_table if it does not exist, else start a sync.
    Returns "created" or "synced"."""
    if not cfg.source_table:
        raise ConfigError("config key 'retriever.source_table' is required to build a Vector Search index "
                          "(the Unity Catalog chunk table it syncs from)")
    client = vector_search_client(cfg, secrets)
    endpoint = Endpoint(f"vector_search:{cfg.index_name}", cfg.policy, hard_timeout=True)
    try:
        index = endpoint.call(lambda: client.get_index(endpoint_name=cfg.endpoint, index_name=cfg.index_name))
    except Exception as exc:
        if type(exc).__name__ != "NotFound":
            from crag.backends.vector_search import unusable

            raise unusable(cfg, client, exc) from None
        endpoint.call(lambda: client.create_delta_sync_index(
            endpoint_name=cfg.endpoint, index_name=cfg.index_name, source_table_name=cfg.source_table,
            pipeline_type=cfg.pipeline_type, primary_key="chunk_id", embedding_source_column=cfg.columns.chunk_text,
            embedding_model_endpoint_name=cfg.embedding_endpoint,
        ))
        return "created"
    endpoint.call(index.sync)
    return "synced"
