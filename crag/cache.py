"""Re-run only what changed: every backend call's result is stored under a key made of the call's
inputs and a hash of its role's config slice (backend, model, prompt text, parameters, and the
identity of local indexes). A later run with the same key reuses the stored result instead of calling
the backend, so a variant that changes only the answer prompt makes no retrieval, grading, rewrite or
search call.

The store is a Delta table (`stage_cache`), so it works on Databricks too. Rows carry the hash of the
question they were made for: before each batch the driver loads the rows of that batch's questions
and ships them to the Spark tasks in a column; the tasks return their new rows in the stage output.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import asdict
from typing import Any
from urllib.parse import urlsplit

from crag.backends import Backends, secrets_for
from crag.backends.base import Answer, Grade
from crag.backends.bm25 import build_identity
from crag.backends.parsing import READING_VERSION
from crag.backends.remote import on_databricks
from crag.config import CragConfig, LLMConfig, stable_hash
from crag.questions import question_key
from crag.secrets import masked
from crag.text import TEXT_VERSION


def service_url(url: str | None) -> str | None:
    """A service's address as its identity: scheme, host, port and path, lower-cased where URLs are
    case-blind, without credentials, query or trailing slash (the same service however it is written)."""
    if not url:
        return None
    parts = urlsplit(url.strip() if "://" in url else f"https://{url.strip()}")
    address = parts.netloc.rpartition("@")[2].lower()  # host[:port], credentials dropped
    return f"{parts.scheme.lower()}://{address}{parts.path.rstrip('/')}"


def _setting(env_name: str | None, secrets: dict[str, str] | None) -> str | None:
    """A value the backends read from the environment (or the credentials shipped to workers)."""
    if not env_name:
        return None
    return (secrets or {}).get(env_name) or os.environ.get(env_name)


def endpoint_identity(section: Any, secrets: dict[str, str] | None = None) -> str | None:
    """Which service answers for a role: the workspace, server or API it calls, never a token. Two
    workspaces can serve endpoints of the same name with different models; their results must not
    stand in for each other."""
    backend = getattr(section, "backend", None)
    if backend in ("databricks", "databricks_vector_search"):
        # On a Databricks cluster with the runtime's own auth the host is the workspace itself.
        return service_url(_setting(section.host_env, secrets)) or ("this-workspace" if on_databricks() else None)
    if backend == "openai":
        return service_url(section.base_url or _setting("OPENAI_BASE_URL", secrets)) or "https://api.openai.com/v1"
    if backend == "tavily":
        return service_url(section.api_base_url) or "https://api.tavily.com"
    return None  # an in-process backend


def role_slices(cfg: CragConfig, secrets: dict[str, str] | None = None) -> dict[str, str]:
    """Hash of what determines each role's results: its config (without policy) and, for a remote role,
    the identity of the service that answers (`endpoint_identity`). `secrets`: the credentials the
    driver resolved, which name the workspace on workers that lack the driver's environment; by
    default, the ones this process last built the config's backends with (crag.backends.cached_backends)."""
    if secrets is None:
        secrets = secrets_for(cfg)
    indexes = {
        "kb": build_identity(getattr(cfg.retriever, "index", None)),
        "web": build_identity(getattr(cfg.web_search, "index", None)),
        "tokenizer": cfg.indexing.tokenizer,
    }

    def dump(section):
        if section is None:
            return None
        # masked: the hashes are stored (stage_cache.key), and must not confirm a guess at a secret
        return {
            **masked(section.model_dump(mode="json", exclude={"policy"})),
            "service": endpoint_identity(section, secrets),
        }

    def reading(section):
        """How a model's output is read into a grade, a query or an answer; for an embedded role, how
        its text functions (sentences, tokens) work and what its records hold (TEXT_VERSION)."""
        if section is None:
            return None
        return READING_VERSION if isinstance(section, LLMConfig) else TEXT_VERSION

    web = dump(cfg.web_search)
    web.pop("verify", None)
    verify = cfg.web_search.verify
    return {
        "retriever": stable_hash({"retriever": dump(cfg.retriever), "indexes": indexes}),
        # the lexical grader and extractive generator weigh terms by the local indexes' statistics
        "grader": stable_hash({"grader": dump(cfg.grader), "indexes": indexes, "reading": reading(cfg.grader)}),
        "rewriter": stable_hash({"rewriter": dump(cfg.rewriter), "reading": reading(cfg.rewriter)}),
        "web_search": stable_hash({"web_search": web, "indexes": indexes}),
        "source_check": stable_hash({"verify": dump(verify), "reading": reading(verify)}),
        "generator": stable_hash(
            {"generator": dump(cfg.generator), "indexes": indexes, "reading": reading(cfg.generator)}
        ),
    }


class StageCache:
    """The entries known to one batch, and the ones it adds. Thread-safe."""

    def __init__(self, entries: dict[str, str]):
        self.entries = dict(entries)
        self.new: list[dict] = []
        self._lock = threading.Lock()

    def key(self, role: str, slice_hash: str, inputs: Any) -> str:
        return f"{role}:{stable_hash([slice_hash, inputs])}"

    def get(self, key: str) -> str | None:
        with self._lock:
            return self.entries.get(key)

    def put(self, key: str, role: str, question: str, value: str) -> None:
        with self._lock:
            if key not in self.entries:
                self.entries[key] = value
                self.new.append({"key": key, "question_key": question_key(question), "role": role, "value": value})

    def cached(
        self,
        role: str,
        slice_hash: str,
        inputs: Any,
        usage,
        question: str,
        call: Callable[[], Any],
        encode: Callable[[Any], Any],
        decode: Callable[[Any], Any],
    ):
        key = self.key(role, slice_hash, inputs)
        stored = self.get(key)
        if stored is not None:
            if usage is not None:
                usage.cache_hits += 1
            return decode(json.loads(stored))
        result = call()
        self.put(key, role, question, json.dumps(encode(result), ensure_ascii=False))
        return result


def _doc_inputs(docs: list[dict], relevance: bool = False) -> list:
    fields = ("source", "doc_id", "parent_id", "title", "text", *(("relevance", "answer_weight") if relevance else ()))
    return [[d.get(f) for f in fields] for d in docs]


def _same(value: Any) -> Any:
    return value


class _Wrapper:
    """A backend whose calls are answered from the stage cache when it holds their result."""

    role: str  # the role's name in role_slices and in the stored rows

    def __init__(self, inner, cache: StageCache, slice_hash: str):
        self._inner, self._cache, self._slice = inner, cache, slice_hash

    def __getattr__(self, name):  # name, concurrency, prompt_hash, policy_keywords ...
        return getattr(self._inner, name)

    def _cached(self, inputs: Any, usage, question: str, call: Callable[[], Any], encode=_same, decode=_same):
        """call()'s result, or the one stored for the same inputs, filed under `question`."""
        return self._cache.cached(self.role, self._slice, inputs, usage, question, call, encode, decode)


class CachedRetriever(_Wrapper):
    role = "retriever"

    def search(self, queries, k, usages=None):
        usages = usages or [None] * len(queries)
        results: list = [None] * len(queries)
        missing = []
        for i, (query, usage) in enumerate(zip(queries, usages)):
            stored = self._cache.get(self._cache.key(self.role, self._slice, [query, k]))
            if stored is not None:
                results[i] = json.loads(stored)
                if usage is not None:
                    usage.cache_hits += 1
            else:
                missing.append(i)
        if missing:
            found = self._inner.search([queries[i] for i in missing], k, [usages[i] for i in missing])
            for i, docs in zip(missing, found):
                results[i] = docs
                self._cache.put(
                    self._cache.key(self.role, self._slice, [queries[i], k]),
                    self.role,
                    queries[i],
                    json.dumps(docs, ensure_ascii=False),
                )
        return results


class CachedGrader(_Wrapper):
    role = "grader"

    def grade(self, question, documents, usage):
        return self._cached(
            [question, _doc_inputs(documents)],
            usage,
            question,
            lambda: self._inner.grade(question, documents, usage),
            # fields at their None default left out: a row stays readable by a version without them
            lambda grades: [{k: v for k, v in asdict(g).items() if v is not None} for g in grades],
            lambda rows: [Grade(**r) for r in rows],
        )


class CachedRewriter(_Wrapper):
    role = "rewriter"

    def rewrite(self, question, usage):
        return self._cached(question, usage, question, lambda: self._inner.rewrite(question, usage))


class CachedWebSearch(_Wrapper):
    role = "web_search"

    def search(self, query, k, usage=None, *, question=None):
        # filed under the question it serves, so that it is loaded with that question's rows
        return self._cached(
            [query, k], usage, question or query, lambda: self._inner.search(query, k, usage, question=question)
        )


class CachedSourceCheck(_Wrapper):
    role = "source_check"

    def verify(self, question, results, usage):
        return self._cached(
            [question, _doc_inputs(results)],
            usage,
            question,
            lambda: self._inner.verify(question, results, usage),
            list,
            list,
        )


class CachedGenerator(_Wrapper):
    role = "generator"

    def generate(self, question, context, usage):
        return self._cached(
            # a generator that does not say whether it reads relevances is taken to read them
            [question, _doc_inputs(context, getattr(self._inner, "reads_relevance", True))],
            usage,
            question,
            lambda: self._inner.generate(question, context, usage),
            asdict,
            lambda row: Answer(**row),
        )


def with_cache(backends: Backends, cache: StageCache, slices: dict[str, str]) -> Backends:
    return Backends(
        retriever=CachedRetriever(backends.retriever, cache, slices["retriever"]),
        grader=CachedGrader(backends.grader, cache, slices["grader"]),
        rewriter=CachedRewriter(backends.rewriter, cache, slices["rewriter"]),
        web_search=CachedWebSearch(backends.web_search, cache, slices["web_search"]) if backends.web_search else None,
        generator=CachedGenerator(backends.generator, cache, slices["generator"]),
        source_check=CachedSourceCheck(backends.source_check, cache, slices["source_check"])
        if backends.source_check
        else None,
    )
