"""Choosing backends is configuration: `build_backends(cfg)` reads the backend names from the config
and constructs one object per role. Each provider lives in its own module and is imported only when
configured, so the embedded default never loads a cloud client."""

from __future__ import annotations

import gc

from crag.backends.base import Backends
from crag.config import CragConfig, EndpointPolicy, LLMConfig, stable_hash
from crag.errors import ConfigError


def _require(value: str | None, key: str) -> str:
    if not value:
        raise ConfigError(f"config key {key!r} is required for this backend (the path of a crag index directory)")
    return value


def credentials(cfg: CragConfig) -> list[tuple[str, str | None, str, bool]]:
    """(environment variable, secret scope reference, what it is for, optional on Databricks) of every
    credential the config needs, so the driver can check and resolve them all before any work starts."""
    needed: list[tuple[str, str | None, str, bool]] = []
    for name, role in cfg.llm_roles().items():
        what = f"{name} ({role.backend} model {role.endpoint!r})"
        if role.backend == "databricks":  # on a Databricks cluster the runtime's own auth serves
            needed += [(role.host_env, None, f"{what}, workspace URL", True), (role.token_env, role.token_secret, what, True)]
        else:
            needed.append((role.api_key_env, role.api_key_secret, what, False))
    if cfg.retriever.backend == "databricks_vector_search":
        r = cfg.retriever
        needed += [(r.host_env, None, "retriever (workspace URL)", True), (r.token_env, r.token_secret, "retriever", True)]
    if cfg.web_search.backend == "tavily":
        needed.append((cfg.web_search.api_key_env, cfg.web_search.api_key_secret, "web_search (Tavily)", False))
    return needed


def resolve_credentials(cfg: CragConfig) -> dict[str, str]:
    """Every credential the config needs, by environment-variable name. A missing one is a ConfigError
    naming it. The values travel to Spark workers in memory only: never logged, never stored."""
    from crag.backends.remote import secret

    found = {env: secret(env, ref, what, optional_on_databricks=optional) for env, ref, what, optional in credentials(cfg)}
    return {env: value for env, value in found.items() if value is not None}


def _endpoint_key(role: LLMConfig) -> tuple:
    """What makes two roles' endpoint the same one: the service, where it is, and whose credentials."""
    return (role.backend, role.endpoint, role.base_url, role.host_env, role.token_env, role.api_key_env)


def shared_policies(cfg: CragConfig) -> dict[tuple, EndpointPolicy]:
    """The policy of each chat endpoint. Roles that name the same endpoint share one client, and so one
    policy, since the endpoint's capacity is one: each of its values is the largest any of those roles
    sets (the generator's longer timeout holds for the rewriter that shares its endpoint), whatever
    the order of the roles."""
    policies: dict[tuple, list[EndpointPolicy]] = {}
    for role in cfg.llm_roles().values():
        policies.setdefault(_endpoint_key(role), []).append(role.policy)
    return {key: EndpointPolicy(**{name: max(getattr(p, name) for p in group) for name in EndpointPolicy.model_fields})
            for key, group in policies.items()}


def _chat_model(role: LLMConfig, secrets, concurrent_tasks: int, shared: dict | None = None,
                policies: dict[tuple, EndpointPolicy] | None = None):
    """One client per endpoint: roles that name the same endpoint share it, with the policy
    `shared_policies` merged for them."""
    key = _endpoint_key(role)
    if shared is not None and key in shared:
        return shared[key]
    if policies is not None and key in policies:
        role = role.model_copy(update={"policy": policies[key]})
    model = _new_chat_model(role, secrets, concurrent_tasks)
    if shared is not None:
        shared[key] = model
    return model


def _new_chat_model(role: LLMConfig, secrets, concurrent_tasks: int):
    if role.backend == "databricks":
        from crag.backends.databricks_serving import DatabricksServing

        return DatabricksServing(role, secrets, concurrent_tasks)
    from crag.backends.openai_compat import OpenAICompatible

    return OpenAICompatible(role, secrets, concurrent_tasks, getattr(role, "guided_regex_key", "guided_regex"))


def build_backends(cfg: CragConfig, secrets: dict[str, str] | None = None, concurrent_tasks: int = 1) -> Backends:
    """`concurrent_tasks`: how many Spark tasks run at once, each in its own process; every remote
    endpoint's max_concurrency is shared out among them."""
    from crag.text import TermWeights

    shared: dict = {}
    policies = shared_policies(cfg)
    weights, tokenizer = TermWeights({}, 1), cfg.indexing.tokenizer
    r = cfg.retriever
    local_indexes = {}  # loaded local indexes by document source, for the semantic grader's dense vectors
    if r.backend == "bm25":
        from crag.backends.bm25 import BM25Retriever

        retriever = BM25Retriever(_require(r.index, "retriever.index"))
        weights, tokenizer = retriever.index.term_weights, retriever.index.tokenizer
        local_indexes["internal"] = retriever.index
    elif r.backend == "hybrid":
        from crag.backends.hybrid import HybridRetriever

        retriever = HybridRetriever(r, _require(r.index, "retriever.index"))
        weights, tokenizer = retriever.index.term_weights, retriever.index.tokenizer
        local_indexes["internal"] = retriever.index
    elif r.backend == "langchain":
        from crag.backends.langchain_retriever import LangChainRetriever

        retriever = LangChainRetriever(r, concurrent_tasks)
    else:
        from crag.backends.vector_search import VectorSearchRetriever

        retriever = VectorSearchRetriever(r, secrets, concurrent_tasks)

    w = cfg.web_search
    web_search = None
    if w.backend == "offline_corpus":
        from crag.backends.bm25 import OfflineCorpusSearch

        web_search = OfflineCorpusSearch(_require(w.index, "web_search.index"))
        local_indexes["web"] = web_search.index
        if r.backend in ("bm25", "hybrid") and web_search.index.tokenizer != tokenizer:
            raise ConfigError(
                f"retriever.index uses tokenizer {tokenizer!r} but web_search.index uses "
                f"{web_search.index.tokenizer!r}: rebuild one of them with the same indexing.tokenizer"
            )
        # The lexical grader and extractive generator weigh terms by IDF over every local collection:
        # with the knowledge base alone, all words it lacks would weigh the same, however common.
        weights = weights.merged(web_search.index.term_weights)
    elif w.backend == "tavily":
        from crag.backends.tavily_search import TavilySearch

        web_search = TavilySearch(w, secrets, concurrent_tasks)

    from crag.backends.lexical import KeywordRewriter, LexicalGrader, LexicalScorer

    # Without a local index (Vector Search, Tavily) every term weighs the same.
    scorer = LexicalScorer(weights, tokenizer)
    if cfg.grader.backend == "lexical":
        grader = LexicalGrader(scorer, cfg.grader.threshold)
    elif cfg.grader.backend == "semantic":
        from crag.backends.semantic import SemanticGrader

        grader = SemanticGrader(scorer, cfg.grader, local_indexes)
    else:
        from crag.backends.llm_roles import LLMGrader

        grader = LLMGrader(_chat_model(cfg.grader, secrets, concurrent_tasks, shared, policies), cfg.grader)

    if cfg.rewriter.backend == "keywords":
        rewriter = KeywordRewriter(cfg.rewriter.policy_keywords)
    else:
        from crag.backends.llm_roles import LLMRewriter

        rewriter = LLMRewriter(_chat_model(cfg.rewriter, secrets, concurrent_tasks, shared, policies), cfg.rewriter)

    g = cfg.generator
    if g.backend == "extractive":
        from crag.backends.extractive import ExtractiveGenerator

        generator = ExtractiveGenerator(scorer, g.max_sentences, g.min_sentence_score, g.document_weight,
                                        g.answer_from_best_document)
    else:
        from crag.backends.llm_roles import LLMGenerator

        generator = LLMGenerator(_chat_model(g, secrets, concurrent_tasks, shared, policies), g)

    source_check = None
    if w.verify is not None:
        from crag.backends.llm_roles import LLMSourceCheck

        source_check = LLMSourceCheck(_chat_model(w.verify, secrets, concurrent_tasks, shared, policies), w.verify)
    return Backends(retriever, grader, rewriter, web_search, generator, source_check)


_CACHE: dict[tuple, Backends] = {}
# The credentials each config's backends were last built with in this process. They name the
# workspace, which the stage cache's key needs (crag.cache.role_slices); the process environment does
# not do, since every DatabricksServing built here rewrites DATABRICKS_HOST in it.
_SECRETS: dict[str, dict[str, str]] = {}


def secrets_for(cfg: CragConfig) -> dict[str, str] | None:
    return _SECRETS.get(cfg.hash())


def cached_backends(cfg: CragConfig, secrets: dict[str, str] | None = None, concurrent_tasks: int = 1) -> Backends:
    """One set of backends per config per Python process: Spark reuses its Python workers across
    tasks, so indexes and clients are built once per executor process, not once per partition."""
    # The credentials are part of the key: they name the workspace (DATABRICKS_HOST), which the config
    # does not, so a run pointed at another workspace in the same worker process gets new clients.
    key = (cfg.hash(), concurrent_tasks, stable_hash(sorted((secrets or {}).items())))
    _SECRETS[cfg.hash()] = dict(secrets or {})
    if key not in _CACHE:
        _CACHE[key] = build_backends(cfg, secrets, concurrent_tasks)
        # The backends, and the modules and indexes loaded for them, live as long as the process: out
        # of the collector's sight, full collections stop pausing every pipeline thread (dips of ~10%
        # in the busiest endpoint's use were measured without this). Garbage is collected first, so
        # none of it is kept for good.
        gc.collect()
        gc.freeze()
    return _CACHE[key]
