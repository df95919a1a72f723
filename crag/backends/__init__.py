"""Choosing backends is configuration: `build_backends(cfg)` reads the backend names from the config
and constructs one object per role with the provider registered for that (role, name) in PROVIDERS.
Each backend lives in its own module; the cloud clients and optional extras they need are imported
only when such a backend is built, so the embedded default never loads one."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from crag.backends.base import Backends
from crag.backends.bm25 import BM25Retriever, OfflineCorpusSearch, build_identity
from crag.backends.databricks_serving import DatabricksServing
from crag.backends.embedding import load_embedder
from crag.backends.extractive import ExtractiveGenerator
from crag.backends.hybrid import HybridRetriever
from crag.backends.lexical import KeywordRewriter, LexicalGrader, LexicalScorer
from crag.backends.llm_roles import LLMGenerator, LLMGrader, LLMRewriter, LLMSourceCheck
from crag.backends.openai_compat import OpenAICompatible
from crag.backends.remote import credential_key, runtime_workspace, secret
from crag.backends.semantic import SemanticGrader
from crag.backends.tavily_search import TavilySearch
from crag.backends.vector_search import VectorSearchRetriever
from crag.config import (
    BM25RetrieverConfig,
    CragConfig,
    DatabricksAuth,
    EndpointPolicy,
    ExtractiveGeneratorConfig,
    HybridRetrieverConfig,
    KeywordRewriterConfig,
    LangChainRetrieverConfig,
    LexicalGraderConfig,
    LLMConfig,
    LLMGeneratorConfig,
    LLMGraderConfig,
    LLMRewriterConfig,
    NoWebSearchConfig,
    OfflineCorpusConfig,
    SemanticGraderConfig,
    SourceCheckConfig,
    TavilyConfig,
    VectorSearchRetrieverConfig,
    stable_hash,
)
from crag.errors import ConfigError
from crag.text import TermWeights

log = logging.getLogger("crag")


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
            needed += [
                (role.host_env, None, f"{what}, workspace URL", True),
                (role.token_env, role.token_secret, what, True),
            ]
        else:
            needed.append((role.api_key_env, role.api_key_secret, what, False))
    if cfg.retriever.backend == "databricks_vector_search":
        r = cfg.retriever
        needed += [
            (r.host_env, None, "retriever (workspace URL)", True),
            (r.token_env, r.token_secret, "retriever", True),
        ]
    if cfg.web_search.backend == "tavily":
        needed.append((cfg.web_search.api_key_env, cfg.web_search.api_key_secret, "web_search (Tavily)", False))
    return needed


def resolve_credentials(cfg: CragConfig) -> dict[str, str]:
    """Every credential the config needs, filed by `credential_key`. A missing one is a ConfigError
    naming it. The values travel to Spark workers in memory only: never logged, never stored."""
    found = {
        credential_key(env, ref): secret(env, ref, what, optional_on_databricks=optional)
        for env, ref, what, optional in credentials(cfg)
    }
    # On Databricks a section may leave its workspace URL, or its token too, to the runtime: the job's
    # own workspace and identity are resolved here, for the workers, which cannot resolve them.
    runtime: tuple[str, str] | None = None
    for auth in _databricks_sections(cfg):
        host_key, token_key = _workspace_keys(auth)
        if found.get(host_key) is None or found.get(token_key) is None:
            runtime = runtime or runtime_workspace()
            found[host_key] = found.get(host_key) or runtime[0]
            found[token_key] = found.get(token_key) or runtime[1]
    _one_serving_identity(cfg, found)
    return {key: value for key, value in found.items() if value is not None}


def _one_serving_identity(cfg: CragConfig, found: dict[str, str | None]) -> None:
    """mlflow's deployments client reads its workspace and token from the process environment at each
    request, so the serving clients of one process take turns setting them: two serving sections with
    different credentials could send a request with the other's token. They must share one (Vector
    Search and OpenAI-compatible sections have clients of their own and may differ)."""
    serving = {
        name: tuple(found.get(key) for key in _workspace_keys(role))
        for name, role in cfg.llm_roles().items()
        if role.backend == "databricks"
    }
    if len(set(serving.values())) > 1:
        raise ConfigError(
            f"the Databricks serving sections ({', '.join(serving)}) resolve to different workspaces or tokens: "
            f"mlflow's deployments client takes them from the process environment, so they must share one "
            f"(the same host_env, token_env and token_secret)"
        )


def _workspace_keys(auth: DatabricksAuth) -> tuple[str, str]:
    """Where a Databricks section's workspace URL and token are filed among the resolved credentials."""
    return credential_key(auth.host_env, None), credential_key(auth.token_env, auth.token_secret)


def _databricks_sections(cfg: CragConfig) -> list[DatabricksAuth]:
    """The sections that call a Databricks service (serving endpoints, Vector Search)."""
    sections: list[DatabricksAuth] = [role for role in cfg.llm_roles().values() if role.backend == "databricks"]
    if cfg.retriever.backend == "databricks_vector_search":
        sections.append(cfg.retriever)
    return sections


def _endpoint_key(role: LLMConfig) -> tuple:
    """What makes two roles' endpoint the same one: the service, where it is, and whose credentials."""
    return (role.backend, role.endpoint, role.base_url, role.host_env, role.token_env, role.api_key_env)


def shared_policies(cfg: CragConfig) -> dict[tuple, EndpointPolicy]:
    """The policy of each chat endpoint. Roles that name the same endpoint share one client, and so one
    policy, since the endpoint's capacity is one: each of its values is the largest any of those roles
    sets (the generator's longer timeout holds for the rewriter that shares its endpoint), whatever
    the order of the roles. Databricks serving endpoints also share the longest timeout among them."""
    policies: dict[tuple, list[EndpointPolicy]] = {}
    for role in cfg.llm_roles().values():
        policies.setdefault(_endpoint_key(role), []).append(role.policy)
    merged = {
        key: EndpointPolicy(**{name: max(getattr(p, name) for p in group) for name in EndpointPolicy.model_fields})
        for key, group in policies.items()
    }
    # mlflow's deployments client reads its request timeout from the process environment, which every
    # serving client of a process shares: they all take the longest, or one's request could be cut off
    # at another's shorter timeout.
    serving = [key for key in merged if key[0] == "databricks"]
    if serving:
        longest = max(merged[key].timeout_s for key in serving)
        merged.update({key: merged[key].model_copy(update={"timeout_s": longest}) for key in serving})
    return merged


def smallest_budget(cfg: CragConfig) -> tuple[str, int] | None:
    """The smallest max_concurrency among the remote endpoints the config calls, and the role whose
    endpoint it is (None: every backend the run calls is in-process). A job runs no more tasks at once than this:
    each task keeps at least one request in flight to every endpoint (crag.backends.remote.budget_share)."""
    policies = shared_policies(cfg)
    roles = cfg.llm_roles()
    if isinstance(cfg.web_search, NoWebSearchConfig):  # the rewriter and the source check are never called
        roles = {name: role for name, role in roles.items() if name not in ("rewriter", "web_search.verify")}
    budgets = {name: policies[_endpoint_key(role)].max_concurrency for name, role in roles.items()}
    for name in ("retriever", "web_search"):
        policy = getattr(getattr(cfg, name), "policy", None)  # a remote one's (an in-process one has none)
        if isinstance(policy, EndpointPolicy):
            budgets[name] = policy.max_concurrency
    if not budgets:
        return None
    role = min(budgets, key=budgets.__getitem__)
    return role, budgets[role]


def _chat_model(
    role: LLMConfig,
    secrets,
    concurrent_tasks: int,
    shared: dict | None = None,
    policies: dict[tuple, EndpointPolicy] | None = None,
):
    """One client per endpoint: roles that name the same endpoint share it, with the policy
    `shared_policies` merged for them."""
    key = _endpoint_key(role)
    if shared is not None and key in shared:
        return shared[key]
    if policies is not None and key in policies:
        role = role.model_copy(update={"policy": policies[key]})
    model = _new_chat_model(role, secrets, concurrent_tasks, policies)
    if shared is not None:
        shared[key] = model
    return model


def _new_chat_model(role: LLMConfig, secrets, concurrent_tasks: int, policies: dict[tuple, EndpointPolicy] | None):
    if role.backend == "databricks":
        serving = sum(p.max_concurrency for key, p in (policies or {}).items() if key[0] == "databricks")
        return DatabricksServing(role, secrets, concurrent_tasks, serving)

    return OpenAICompatible(role, secrets, concurrent_tasks, getattr(role, "guided_regex_key", "guided_regex"))


@dataclass
class _Building:
    """What the providers of one `build_backends` call share: the config, the credentials, one chat
    client per endpoint, and the local indexes loaded so far."""

    cfg: CragConfig
    secrets: dict[str, str] | None
    concurrent_tasks: int
    policies: dict[tuple, EndpointPolicy]
    opened_before: bool = False  # the services were opened in this run already (by the driver, for a Spark task)
    shared: dict = field(default_factory=dict)
    # loaded local indexes by document source: the lexical scorer's term weights, the semantic grader's
    # dense vectors
    local_indexes: dict = field(default_factory=dict)

    def chat_model(self, role: LLMConfig):
        return _chat_model(role, self.secrets, self.concurrent_tasks, self.shared, self.policies)

    @cached_property
    def scorer(self):
        """The lexical scorer, over the term weights of every local index (without one, as with Vector
        Search and Tavily, every term weighs the same). Its collections are all loaded by then: the
        retriever and web search are built before the roles that score."""

        internal, web = self.local_indexes.get("internal"), self.local_indexes.get("web")
        weights = internal.term_weights if internal else TermWeights({}, 1)
        if web:
            # The lexical grader and extractive generator weigh terms by IDF over every local
            # collection: with the knowledge base alone, all words it lacks would weigh the same,
            # however common.
            weights = weights.merged(web.term_weights)
        return LexicalScorer(weights, internal.tokenizer if internal else self.cfg.indexing.tokenizer)


def _bm25_retriever(b: _Building, cfg: BM25RetrieverConfig):
    retriever = BM25Retriever(_require(cfg.index, "retriever.index"))
    b.local_indexes["internal"] = retriever.index
    return retriever


def _hybrid_retriever(b: _Building, cfg: HybridRetrieverConfig):
    retriever = HybridRetriever(cfg, _require(cfg.index, "retriever.index"))
    b.local_indexes["internal"] = retriever.index
    return retriever


def _langchain_retriever(b: _Building, cfg: LangChainRetrieverConfig):
    from crag.backends.langchain_retriever import LangChainRetriever  # noqa: PLC0415  # langchain extra: loaded only when configured

    return LangChainRetriever(cfg, b.concurrent_tasks)


def _vector_search_retriever(b: _Building, cfg: VectorSearchRetrieverConfig):
    return VectorSearchRetriever(cfg, b.secrets, b.concurrent_tasks, b.opened_before)


def _offline_corpus(b: _Building, cfg: OfflineCorpusConfig):
    web_search = OfflineCorpusSearch(_require(cfg.index, "web_search.index"))
    internal = b.local_indexes.get("internal")
    if internal is not None and web_search.index.tokenizer != internal.tokenizer:
        raise ConfigError(
            f"retriever.index uses tokenizer {internal.tokenizer!r} but web_search.index uses "
            f"{web_search.index.tokenizer!r}: rebuild one of them with the same indexing.tokenizer"
        )
    b.local_indexes["web"] = web_search.index
    return web_search


def _tavily(b: _Building, cfg: TavilyConfig):
    return TavilySearch(cfg, b.secrets, b.concurrent_tasks)


def _no_web_search(b: _Building, cfg: NoWebSearchConfig) -> None:
    return None


def _lexical_grader(b: _Building, cfg: LexicalGraderConfig):
    return LexicalGrader(
        b.scorer, cfg.threshold, cfg.web_threshold, cfg.exponents.model_dump(), cfg.signals.model_dump()
    )


def _semantic_grader(b: _Building, cfg: SemanticGraderConfig):
    if not b.opened_before:  # said once, where the run starts (the driver, `crag ask`), not by each worker
        for source, index in b.local_indexes.items():
            if index.embedding != cfg.embedding:
                setting = "retriever.index" if source == "internal" else "web_search.index"
                log.warning(
                    "%s %s was built with indexing.embedding=%s, not the grader's %s: each document is embedded "
                    "when graded, more slowly and whole rather than by its best chunk (rebuild the index with "
                    "indexing.embedding=%s)",
                    setting,
                    index.path,
                    index.embedding,
                    cfg.embedding,
                    cfg.embedding,
                )
    return SemanticGrader(b.scorer, cfg, b.local_indexes)


def _llm_grader(b: _Building, cfg: LLMGraderConfig):
    return LLMGrader(b.chat_model(cfg), cfg)


def _keyword_rewriter(b: _Building, cfg: KeywordRewriterConfig):
    return KeywordRewriter(cfg.policy_keywords)


def _llm_rewriter(b: _Building, cfg: LLMRewriterConfig):
    return LLMRewriter(b.chat_model(cfg), cfg)


def _extractive_generator(b: _Building, cfg: ExtractiveGeneratorConfig):
    return ExtractiveGenerator(
        b.scorer,
        cfg.max_sentences,
        cfg.min_sentence_score,
        cfg.document_weight,
        cfg.answer_from_best_document,
        (cfg.cosine_weight, load_embedder(cfg.embedding)) if cfg.cosine_weight > 0 and cfg.embedding else None,
    )


def _llm_generator(b: _Building, cfg: LLMGeneratorConfig):
    return LLMGenerator(b.chat_model(cfg), cfg)


def _llm_source_check(b: _Building, cfg: SourceCheckConfig):
    return LLMSourceCheck(b.chat_model(cfg), cfg)


# The chat services a model role can be served by (LLMConfig.backend).
_CHAT_SERVICES = ("databricks", "openai")

# (role, backend name in the config) -> the constructor of that backend, from the shared build state and
# the role's own config section. Each provider imports its module only when called, so the embedded
# default never loads a cloud client.
PROVIDERS: dict[tuple[str, str], Callable[[_Building, Any], Any]] = {
    ("retriever", "bm25"): _bm25_retriever,
    ("retriever", "hybrid"): _hybrid_retriever,
    ("retriever", "langchain"): _langchain_retriever,
    ("retriever", "databricks_vector_search"): _vector_search_retriever,
    ("web_search", "offline_corpus"): _offline_corpus,
    ("web_search", "tavily"): _tavily,
    ("web_search", "none"): _no_web_search,
    ("grader", "lexical"): _lexical_grader,
    ("grader", "semantic"): _semantic_grader,
    ("rewriter", "keywords"): _keyword_rewriter,
    ("generator", "extractive"): _extractive_generator,
    **{("grader", service): _llm_grader for service in _CHAT_SERVICES},
    **{("rewriter", service): _llm_rewriter for service in _CHAT_SERVICES},
    **{("generator", service): _llm_generator for service in _CHAT_SERVICES},
    **{("source_check", service): _llm_source_check for service in _CHAT_SERVICES},
}


def _provide(b: _Building, role: str, section: Any):
    """The backend for `role` that `section` (the role's config) names."""
    provider = PROVIDERS.get((role, section.backend))
    if provider is None:
        known = sorted(name for r, name in PROVIDERS if r == role)
        raise ConfigError(f"no {role} backend {section.backend!r}: choose one of {known}")
    return provider(b, section)


def build_backends(
    cfg: CragConfig, secrets: dict[str, str] | None = None, concurrent_tasks: int = 1, opened_before: bool = False
) -> Backends:
    """`concurrent_tasks`: how many Spark tasks run at once, each in its own process; every remote
    endpoint's max_concurrency is shared out among them. `opened_before`: the driver built these
    backends first, so a service that does not answer at start-up is retried as any call is, not given
    up after the first open's short limit (crag.backends.vector_search). The retriever and web search
    are built first: the local indexes they load weigh the terms of the lexical roles."""
    b = _Building(cfg, secrets, concurrent_tasks, shared_policies(cfg), opened_before)
    retriever = _provide(b, "retriever", cfg.retriever)
    web_search = _provide(b, "web_search", cfg.web_search)
    verify = cfg.web_search.verify
    return Backends(
        retriever=retriever,
        grader=_provide(b, "grader", cfg.grader),
        rewriter=_provide(b, "rewriter", cfg.rewriter),
        web_search=web_search,
        generator=_provide(b, "generator", cfg.generator),
        source_check=None if verify is None else _provide(b, "source_check", verify),
    )


_CACHE: dict[tuple, Backends] = {}
# Sets of backends one process keeps: a Spark worker that lives across runs (an all-purpose cluster)
# would otherwise keep every run's, each run bringing new credentials (a job's token is its own).
KEPT_BACKENDS = 4
# The credentials each config's backends were last built with in this process. They name the
# workspace, which the stage cache's key needs (crag.cache.role_slices); the process environment does
# not do, since every DatabricksServing built here rewrites DATABRICKS_HOST in it.
_SECRETS: dict[str, dict[str, str]] = {}


def secrets_for(cfg: CragConfig) -> dict[str, str] | None:
    return _SECRETS.get(_identity(cfg))


def _identity(cfg: CragConfig) -> str:
    """The whole config's hash, for this process's own caches (cfg.hash() is the stored one, taken with
    its credentials masked: two configs that differ only in a password must not share a store)."""
    return stable_hash(cfg.model_dump(mode="json"))


def cached_backends(
    cfg: CragConfig, secrets: dict[str, str] | None = None, concurrent_tasks: int = 1, opened_before: bool = False
) -> Backends:
    """One set of backends per config per Python process: Spark reuses its Python workers across
    tasks, so indexes and clients are built once per executor process, not once per partition."""
    # The credentials are part of the key: they name the workspace (DATABRICKS_HOST), which the config
    # does not, so a run pointed at another workspace in the same worker process gets new clients. So
    # are the builds of the local indexes: one rebuilt in the same folder gets backends that read it.
    builds = tuple(build_identity(getattr(section, "index", None)) for section in (cfg.retriever, cfg.web_search))
    identity = _identity(cfg)
    # (Not `opened_before`: backends built either way have opened their services.)
    key = (identity, concurrent_tasks, stable_hash(sorted((secrets or {}).items())), builds)
    _SECRETS[identity] = dict(secrets or {})
    if key not in _CACHE:
        if len(_CACHE) >= KEPT_BACKENDS:
            del _CACHE[next(iter(_CACHE))]  # the oldest
            gc.unfreeze()  # its objects can be collected now (the collect below)
        _CACHE[key] = build_backends(cfg, secrets, concurrent_tasks, opened_before)
        # The backends, and the modules and indexes loaded for them, live as long as the process: out
        # of the collector's sight, full collections stop pausing every pipeline thread (dips of ~10%
        # in the busiest endpoint's use were measured without this). Garbage is collected first, so
        # none of it is kept for good.
        gc.collect()
        gc.freeze()
    return _CACHE[key]
