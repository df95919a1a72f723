"""Typed, validated configuration: a YAML file, an optional variant overlay, then `--set key=value`.

Every section forbids unknown keys, so a typo fails before any work starts with a message that names
the key and the keys allowed there.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import ParseResult, unquote, urlparse

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from crag.errors import ConfigError, describe
from crag.secrets import is_secret_key, masked, redact_config, remember, scrub
from crag.text import TOKENIZERS

DEFAULT_REFUSAL = "I don't know: the available documents do not answer this question."


def _is_number(annotation: Any) -> bool:
    return annotation in (int, float) or any(_is_number(a) for a in get_args(annotation))


class Section(BaseModel):
    # allow_inf_nan=False: .inf or .nan for a timeout or threshold is a mistake, not a setting.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_numbers(cls, data: Any) -> Any:
        """`k: true` would pass as 1 (a bool is an int to Python): a number key takes numbers only."""
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if isinstance(value, bool) and field is not None and _is_number(field.annotation):
                    raise PydanticCustomError(
                        "boolean_number", "{field}: a boolean is not a number", {"field": name, "value": value}
                    )
        return data


DAY_S = 86400  # bound on every duration: past it, a timeout or backoff is a mistake (1e300 s overflows clients)


class InputConfig(Section):
    max_question_chars: int = Field(2000, gt=0)


class EndpointPolicy(Section):
    """How crag treats one remote endpoint."""

    max_concurrency: int = Field(8, gt=0, le=10_000)  # requests in flight to this endpoint across the whole job
    timeout_s: float = Field(60, gt=0, le=DAY_S)  # per call
    max_attempts: int = Field(5, ge=1, le=100)  # tries per call on 429 / 5xx / timeouts (1 = no retry)
    backoff_initial_s: float = Field(0.5, ge=0, le=DAY_S)  # exponential backoff with jitter, unless Retry-After says
    backoff_max_s: float = Field(30, ge=0, le=DAY_S)


def _env_name(value: str) -> str:
    if not ENV_NAME.fullmatch(value):  # a credential typed where its variable's name belongs: not shown
        raise PydanticCustomError(
            "env_name",
            "not an environment variable's name (letters, digits and _): is the credential itself here? "
            "Put it in the environment and name the variable",
        )
    return value


def _secret_ref(value: str | None) -> str | None:
    if value is not None and not SECRET_REF.fullmatch(value):
        raise PydanticCustomError(
            "secret_ref",
            "not a Databricks secret reference 'scope/key': is the credential itself here? Put it in a "
            "secret scope and name it",
        )
    return value


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SECRET_REF = re.compile(r"[\w.@\-]+/[\w.\-]+")  # Databricks scope and key names
# Where a credential comes from, checked in every section whether its backend reads it or not: a
# credential typed into one of these would otherwise be stored with the config (`*_env` values are
# not masked: they are names)
EnvName = Annotated[str, AfterValidator(_env_name)]
SecretRef = Annotated[str | None, AfterValidator(_secret_ref)]


class DatabricksAuth(Section):
    host_env: EnvName = "DATABRICKS_HOST"
    token_env: EnvName = "DATABRICKS_TOKEN"
    token_secret: SecretRef = None  # "scope/key" of a Databricks secret scope, used when token_env is unset


class LLMConfig(DatabricksAuth):
    """A chat model: a Databricks serving endpoint (through mlflow.deployments) or any OpenAI-compatible
    server (vLLM, SGLang, Ollama, OpenAI, Databricks /serving-endpoints) through the openai client."""

    backend: Literal["databricks", "openai"]
    endpoint: str  # databricks: serving endpoint name; openai: model name
    base_url: str | None = None  # openai: e.g. http://localhost:8000/v1 (None: api.openai.com)
    api_key_env: EnvName = "OPENAI_API_KEY"  # openai
    api_key_secret: SecretRef = None  # openai: "scope/key" fallback
    temperature: float = Field(0.0, ge=0, le=2)
    max_tokens: int = Field(512, gt=0)
    prompt: str  # prompt template (YAML with system/user), relative to the config file's folder
    prompt_text: str | None = None  # the template itself; read from `prompt` at load time unless given
    max_doc_chars: int = Field(6000, gt=0)  # documents are truncated to this before they enter a prompt
    # The server's context window in tokens: documents are cut so that the prompt and max_tokens fit
    # it. None: the window the server reports (llama.cpp's /props, vLLM's /v1/models), if it does.
    context_tokens: int | None = Field(None, gt=0)
    # How the token budget counts a prompt without the server's tokenizer: UTF-8 bytes per token.
    # English text runs 4 or more with common tokenizers, Japanese 1.5 to 3: lower it for such text.
    bytes_per_token: float = Field(3.0, gt=0, le=16)
    policy: EndpointPolicy = Field(default_factory=EndpointPolicy)


# How a role asks the server to keep its output to the role's JSON schema (crag.backends.structured):
# json_schema: response_format json_schema (OpenAI, vLLM, SGLang, Ollama, llama.cpp's server);
# json_object: response_format json_object with the schema (llama-cpp-python, llama.cpp's server);
# grammar: a GBNF grammar generated from the schema (llama.cpp, llama-cpp-python); guided_json: vLLM's
# body field; auto: the first of json_schema, json_object and grammar that the server accepts, found
# by probing it once; none: no constraint.
StructuredOutput = Literal["auto", "json_schema", "json_object", "grammar", "guided_json", "none"]
OPENAI_ONLY_MODES = ("json_object", "grammar", "guided_json")


class ConstrainedLLMConfig(LLMConfig):
    """A role whose reply has a contract crag can state as a JSON schema (grader, rewriter, source check)."""

    structured_output: StructuredOutput = "auto"

    @field_validator("structured_output", mode="before")
    @classmethod
    def _from_boolean(cls, value: Any) -> Any:
        # the key was a boolean before the modes: true asked for a constraint, false for none
        return {True: "auto", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _mode_of_the_backend(self) -> ConstrainedLLMConfig:
        if self.backend == "databricks" and self.structured_output in OPENAI_ONLY_MODES:
            raise ValueError(
                f"structured_output {self.structured_output} is for OpenAI-compatible servers (backend: openai); "
                "Databricks serving takes json_schema (or auto, none)"
            )
        return self


class BM25RetrieverConfig(Section):
    backend: Literal["bm25"] = "bm25"
    index: str | None = None
    k: int = Field(10, gt=0)


class HybridRetrieverConfig(Section):
    """BM25 and dense search over the same `crag index` directory (built with indexing.embedding),
    fused by reciprocal rank fusion."""

    backend: Literal["hybrid"]
    index: str | None = None
    k: int = Field(10, gt=0)  # fused child chunks kept, then expanded to parents as with bm25
    candidates: int = Field(50, gt=0)  # child chunks taken from each of the two rankings before fusion
    rrf_k: int = Field(60, gt=0)  # RRF's rank offset: a chunk scores sum of 1 / (rrf_k + rank)


class VectorSearchColumns(Section):
    """Names of the index columns (the chunk table written by crag index uses these)."""

    chunk_text: str = "chunk_text"
    parent_id: str = "parent_id"
    parent_text: str = "parent_text"
    doc_id: str = "doc_id"
    title: str = "title"
    url: str = "url"


class VectorSearchRetrieverConfig(DatabricksAuth):
    backend: Literal["databricks_vector_search"]
    endpoint: str  # Vector Search endpoint name
    index_name: str  # catalog.schema.index
    k: int = Field(10, gt=0)
    query_type: Literal["ANN", "HYBRID"] = "ANN"
    filters: dict[str, Any] | None = None
    columns: VectorSearchColumns = Field(default_factory=VectorSearchColumns)
    policy: EndpointPolicy = Field(default_factory=EndpointPolicy)
    # building the index (crag index): the chunk table it syncs from, and how it embeds
    source_table: str | None = None  # catalog.schema.table written by crag index on Databricks
    embedding_endpoint: str = "databricks-bge-m3"  # model serving endpoint that embeds chunk_text
    pipeline_type: Literal["TRIGGERED", "CONTINUOUS"] = "TRIGGERED"


class LangChainMetadataKeys(Section):
    """The metadata keys of a LangChain document that fill crag's document fields."""

    # A key that is null, or missing from a document, falls back as the comment says.
    doc_id: str | None = "doc_id"  # fallback: the Document's own id, else a hash of its text
    parent_id: str | None = "parent_id"  # fallback: the doc_id (each document is its own parent)
    parent_text: str | None = "parent_text"  # the text the generator reads; fallback: the page_content
    title: str | None = "title"
    url: str | None = "url"  # LangChain's loaders put the file or page in "source"
    score: str | None = "score"  # retrievers only (vector stores return scores themselves)


_FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


class LangChainRetrieverConfig(Section):
    """Any LangChain retriever or vector store, built in each Spark worker by a factory function."""

    backend: Literal["langchain"]
    factory: str  # "package.module:function" returning a BaseRetriever or VectorStore
    kwargs: dict[str, Any] = Field(default_factory=dict)  # passed to the factory; recorded in the runs table
    k: int = Field(10, gt=0)  # vector stores: results asked for; retrievers: their first k results are kept
    # vector stores: the store's own score (FAISS, Chroma: a distance, lower is closer), or LangChain's 0..1
    # relevance, which is only right where the store's relevance function fits its metric and embeddings
    scores: Literal["raw", "relevance"] = "raw"
    metadata: LangChainMetadataKeys = Field(default_factory=LangChainMetadataKeys)
    # None: an in-process store (FAISS, BM25, a local Chroma) serves a task's queries one after another.
    # Set: a remote store, one query per question under this budget, timeout and retry policy.
    policy: EndpointPolicy | None = None

    @field_validator("factory")
    @classmethod
    def _dotted_path(cls, value: str) -> str:
        if not _FACTORY.fullmatch(value):
            raise ValueError("expected 'package.module:function'")
        return value


class LexicalExponents(Section):
    """relevance = score ** exponent, by the question's language (Japanese when it has CJK
    characters, else English): one cut then serves both languages. Defaults: `crag calibrate` on the
    development sample of bench/quality.py (--setup actions --seed 1) found the best cut between
    knowledge-base and web questions at 0.458 for English and 0.415 for Japanese, and these exponents
    move both onto 0.5 (docs/quality.md)."""

    en: float = Field(0.887, gt=0, le=10)
    ja: float = Field(0.787, gt=0, le=10)


class LexicalSignals(Section):
    """The weight of each lexical signal in the grader's score (crag.backends.lexical.LexicalGrader).
    Defaults: the weights that told knowledge-base from web questions apart best on the development
    sample of bench/quality.py, where the three scored 0.926 / 0.977 / 0.937 (SQuAD 2.0 / JSQuAD /
    JaQuAD, each language's best cut) against 0.875 / 0.950 / 0.913 for `terms` alone; within
    0.75-1.25 (phrases) and 0.3-0.7 (title) they scored alike (docs/quality.md)."""

    terms: float = Field(1.0, ge=0)
    phrases: float = Field(1.0, ge=0)
    title: float = Field(0.5, ge=0)

    @model_validator(mode="after")
    def _some_weight(self) -> LexicalSignals:
        if self.terms + self.phrases + self.title <= 0:
            raise ValueError("at least one of terms, phrases and title must weigh more than 0")
        return self


class LexicalGraderConfig(Section):
    backend: Literal["lexical"] = "lexical"
    threshold: float = Field(0.5, ge=0, le=1)
    exponents: LexicalExponents = Field(default_factory=LexicalExponents)
    signals: LexicalSignals = Field(default_factory=LexicalSignals)
    # a web result sharing >= 2 question terms is graded "yes" at or above this (None: `threshold`);
    # see crag.backends.lexical. Its default lives here, not in conf/local.yaml, so that switching
    # grader.backend to an LLM does not leave a key that grader does not have.
    web_threshold: float | None = Field(0.25, ge=0, le=1)


class LanguageCalibration(Section):
    """relevance = sigmoid(bias + lexical * lexical relevance + semantic * cosine [+ the question-level
    term below]): the probability that a document is relevant, fitted per language by `crag calibrate`
    against gold_doc_ids (the term against the expected routes)."""

    lexical: float = Field(gt=0)  # the answer weight is the logit over it (crag.backends.semantic)
    semantic: float
    bias: float
    # A question-level term, for the knowledge base's documents: + best_cosine * (the best cosine among
    # the knowledge-base documents graded with this one - best_cosine_center). How close the question's
    # nearest document comes says whether the knowledge base holds its subject at all, which the one
    # document's relevance says less well (docs/quality.md). Web results, found by a search for this
    # very question, are graded without it.
    best_cosine: float = 0.0
    best_cosine_center: float = 0.0


# The packaged sentence encoders (crag.backends.embedding.MODELS).
EmbeddingModel = Literal["multilingual-e5-small", "use-multilingual-v3", "all-minilm-l6-v2"]

# The weights fitted for each embedding model, over the lexical relevance each was combined with. Each
# model's cosines sit on a scale of their own (multilingual-e5-small's between 0.7 and 0.9, USE's
# between 0 and 0.7), so a language the config leaves out gets its own model's weights.
# use-multilingual-v3: a logistic regression of "the document is gold" on the lexical grader's relevance
# (its three signals) and the cosine, per language, as `crag calibrate` fits it, over bench/quality.py's
# development samples (--setup actions --seed 1 and 2, the three sets; en from SQuAD 2.0, ja from JSQuAD
# and JaQuAD), each bias then moved so that its language's best routing cut lies at 0.5 (docs/quality.md).
# multilingual-e5-small: fitted the same way on --seed 1 when the lexical input was term coverage alone
# (before the three signals); `crag calibrate` on a run of it refits them. all-minilm-l6-v2 as
# use-multilingual-v3, and its English best_cosine term from a regression of the expected route on each
# question's best document logit and best cosine over the same samples, folded into the documents'
# logits so that 0.5 stays the routing cut (best_cosine_center: the bias the fold moved, over the weight).
FITTED_WEIGHTS: dict[str, dict[str, dict[str, float]]] = {
    "multilingual-e5-small": {
        "en": {"lexical": 5.545, "semantic": 41.093, "bias": -40.114},
        "ja": {"lexical": 11.5, "semantic": 18.347, "bias": -23.594},
    },
    "all-minilm-l6-v2": {
        "en": {"lexical": 7.237, "semantic": 5.645, "bias": -5.827, "best_cosine": 2.82, "best_cosine_center": 0.581},
        "ja": {"lexical": 11.776, "semantic": 0.0, "bias": -5.888},
    },
    "use-multilingual-v3": {
        "en": {"lexical": 8.41, "semantic": 5.241, "bias": -5.716},
        "ja": {"lexical": 12.608, "semantic": 1.577, "bias": -6.642},
    },
}


class SemanticLanguages(Section):
    """One calibration per language. Defaults: use-multilingual-v3's (FITTED_WEIGHTS)."""

    en: LanguageCalibration = Field(
        default_factory=lambda: LanguageCalibration(**FITTED_WEIGHTS["use-multilingual-v3"]["en"])
    )
    ja: LanguageCalibration = Field(
        default_factory=lambda: LanguageCalibration(**FITTED_WEIGHTS["use-multilingual-v3"]["ja"])
    )


class SemanticGraderConfig(Section):
    """Lexical relevance and the embedding cosine of question and document, combined per language
    (Japanese when the question has CJK characters, else English)."""

    backend: Literal["semantic"]
    threshold: float = Field(0.5, ge=0, le=1)
    web_threshold: float | None = Field(None, ge=0, le=1)  # as the lexical grader's (None: `threshold`)
    embedding: EmbeddingModel = "use-multilingual-v3"
    languages: SemanticLanguages = Field(default_factory=SemanticLanguages)
    # the lexical relevance it combines: the lexical grader's, with the same defaults
    exponents: LexicalExponents = Field(default_factory=LexicalExponents)
    signals: LexicalSignals = Field(default_factory=LexicalSignals)

    @model_validator(mode="before")
    @classmethod
    def _the_models_weights(cls, data: Any) -> Any:
        """A language the config does not calibrate gets the weights fitted for the configured model; one
        it calibrates is its own whole (a best_cosine term fitted around the model's bias would be wrong
        beside another bias: a language given without one has none)."""
        if isinstance(data, dict) and isinstance(data.get("languages", {}), dict):
            fitted = FITTED_WEIGHTS.get(data.get("embedding", "use-multilingual-v3"))
            if fitted is not None:  # an unknown model fails `embedding` with its own message
                data = {**data, "languages": {**fitted, **data.get("languages", {})}}
        return data


# A grade is a few tokens: {"grade": "yes"}, or a score and a one-sentence reason.
GRADER_MAX_TOKENS = {"binary": 20, "score": 80}


class LLMGraderConfig(ConstrainedLLMConfig):
    prompt: str = "prompts/grade_binary.yaml"
    format: Literal["binary", "score"] = "binary"  # {"grade": "yes|no"} | "Score: 0-5" + "Reason:" lines
    threshold: float = Field(0.6, ge=0, le=1)  # score format: score/5 >= threshold -> yes (3 of 5)
    guided_regex: bool = False  # openai, binary: a guided-decoding regex instead (vLLM / SGLang)
    # body field for the regex: vLLM guided_regex, SGLang regex (a regex is no GBNF grammar: sent as
    # llama.cpp's `grammar`, it fails to parse and takes the server down)
    guided_regex_key: Literal["guided_regex", "regex"] = "guided_regex"
    batch: bool = False  # databricks: one request grades every document of a question (reference flow 1)
    on_parse_failure: Literal["irrelevant", "retry"] = "irrelevant"  # retry: ask once more, then irrelevant

    @model_validator(mode="before")
    @classmethod
    def _max_tokens_of_the_format(cls, data: Any) -> Any:
        """A grader's default max_tokens is a grade's length, not the generic 512: a model that does
        not stop after its grade would write on for 512 tokens per document."""
        if isinstance(data, dict) and data.get("max_tokens") is None:
            data = {**data, "max_tokens": GRADER_MAX_TOKENS.get(data.get("format", "binary"), 20)}
        return data

    @model_validator(mode="after")
    def _one_output_constraint(self) -> LLMGraderConfig:
        # vLLM and SGLang refuse a request that constrains the output twice (HTTP 400: "only one kind
        # of guided decoding"), so every grading request would fail.
        if self.guided_regex and self.backend != "openai":
            raise ValueError("guided_regex is sent to OpenAI-compatible servers only (backend: openai)")
        if self.guided_regex and self.structured_output != "none" and self.format == "binary":
            raise ValueError(
                "guided_regex and structured_output each constrain the output, and vLLM and SGLang refuse a "
                "request with both: set structured_output: none to send the regex"
            )
        return self


class KeywordRewriterConfig(Section):
    backend: Literal["keywords"] = "keywords"
    policy_keywords: list[str] = Field(default_factory=list)


class LLMRewriterConfig(ConstrainedLLMConfig):
    prompt: str = "prompts/rewrite.yaml"
    max_tokens: int = Field(100, gt=0)
    policy_keywords: list[str] = Field(default_factory=list)
    # a web query longer than this is cut at a word (the structured output's maxLength asks the model
    # for no longer; Tavily takes 400 characters)
    max_query_chars: int = Field(200, gt=0, le=400)


class SourceCheckConfig(ConstrainedLLMConfig):
    """Reference flow 3's check that a web result is a usable source (YES/NO) before it is used."""

    prompt: str = "prompts/source_check.yaml"
    max_tokens: int = Field(20, gt=0)  # YES, or {"verdict": "YES"} under structured output
    subject: str | None = None  # what the sources must be about, e.g. "the Hoshi AQ-7 air purifier"


class WebSearchCommon(Section):
    k: int = Field(3, gt=0)
    grade_results: bool = True
    verify: SourceCheckConfig | None = None
    fallback: Literal["single", "two_stage"] = "single"  # two_stage: direct query first, rewritten one if still short


class OfflineCorpusConfig(WebSearchCommon):
    backend: Literal["offline_corpus"] = "offline_corpus"
    index: str | None = None


class TavilyConfig(WebSearchCommon):
    backend: Literal["tavily"]
    search_depth: Literal["basic", "advanced"] = "basic"
    topic: Literal["general", "news", "finance"] = "general"
    include_domains: list[str] = Field(default_factory=list)
    exclude_domains: list[str] = Field(default_factory=list)
    api_key_env: EnvName = "TAVILY_API_KEY"
    api_key_secret: SecretRef = None
    api_base_url: str | None = None  # None: Tavily's own; set for a proxy or the local emulator
    policy: EndpointPolicy = Field(default_factory=EndpointPolicy)


class NoWebSearchConfig(WebSearchCommon):
    backend: Literal["none"]


def _worded(message: str) -> str:
    # A reply counts as a refusal when its words start with these words: none would make every reply one
    if not re.search(r"\w", message):
        raise ValueError("must hold words: a reply is taken as a refusal when it starts with them")
    return message


RefusalMessage = Annotated[str, AfterValidator(_worded)]


class ExtractiveGeneratorConfig(Section):
    backend: Literal["extractive"] = "extractive"
    max_sentences: int = Field(2, ge=1, le=3)
    min_sentence_score: float = Field(0.2, ge=0, le=1)
    document_weight: float = Field(0.5, ge=0, le=1)  # share of a sentence's score taken from its document's relevance
    # share taken from the cosine of the question and the sentence (`embedding`'s model; 0: not embedded)
    cosine_weight: float = Field(0.0, ge=0, le=1)
    embedding: EmbeddingModel | None = None
    # no sentence reaches min_sentence_score: answer from the most relevant document's best sentences
    # instead of refusing (the context holds only documents graded relevant)
    answer_from_best_document: bool = True
    refusal_message: RefusalMessage = DEFAULT_REFUSAL

    @model_validator(mode="after")
    def _weights_within_one(self) -> ExtractiveGeneratorConfig:
        if self.document_weight + self.cosine_weight > 1:
            raise ValueError("generator.document_weight + generator.cosine_weight must be at most 1")
        if self.cosine_weight > 0 and self.embedding is None:
            raise ValueError("generator.cosine_weight needs generator.embedding: the model the cosine comes from")
        return self


class LLMGeneratorConfig(LLMConfig):
    prompt: str = "prompts/answer_concise.yaml"
    reply_language: str | None = None  # e.g. Japanese: adds "Reply in Japanese." to the prompt
    refusal_message: RefusalMessage = DEFAULT_REFUSAL
    max_tokens: int = Field(300, gt=0)


RetrieverConfig = Annotated[
    BM25RetrieverConfig | HybridRetrieverConfig | VectorSearchRetrieverConfig | LangChainRetrieverConfig,
    Field(discriminator="backend"),
]
GraderConfig = Annotated[LexicalGraderConfig | SemanticGraderConfig | LLMGraderConfig, Field(discriminator="backend")]
RewriterConfig = Annotated[KeywordRewriterConfig | LLMRewriterConfig, Field(discriminator="backend")]
WebSearchConfig = Annotated[OfflineCorpusConfig | TavilyConfig | NoWebSearchConfig, Field(discriminator="backend")]
GeneratorConfig = Annotated[ExtractiveGeneratorConfig | LLMGeneratorConfig, Field(discriminator="backend")]
# A role section that names no backend gets the embedded one.
DEFAULT_BACKENDS = {
    "retriever": "bm25",
    "grader": "lexical",
    "rewriter": "keywords",
    "web_search": "offline_corpus",
    "generator": "extractive",
}


class RoutingConfig(Section):
    policy: Literal["any_irrelevant", "all_irrelevant", "min_context_chars", "thresholds"] = "any_irrelevant"
    max_relevant_docs: int = Field(5, gt=0)
    min_context_chars: int = Field(100, ge=0)
    upper: float = Field(0.6, ge=0, le=1)
    lower: float = Field(0.3, ge=0, le=1)
    # None: a question left without context is refused (the CRAG paper). A relevance: it is answered from
    # the knowledge base's best document instead, if that reaches it (crag.stages.route_question).
    last_resort: float | None = Field(None, ge=0, le=1)

    @model_validator(mode="after")
    def _ordered(self) -> RoutingConfig:
        if self.lower > self.upper:
            raise ValueError(f"routing.lower ({self.lower}) must not exceed routing.upper ({self.upper})")
        return self


class RefinementConfig(Section):
    enabled: bool = False
    strip: Literal["sentence", "words"] = "sentence"
    window_words: int = Field(50, gt=0)
    keep: int = Field(5, gt=0)


class WebStageConfig(Section):
    """The web search stage's slice, spread over two sections of the file: the web_search section, and
    the routing threshold under which the two-stage fallback searches again. Made by the pipeline, not
    read from YAML."""

    search: WebSearchConfig
    min_context_chars: int = Field(ge=0)


class IndexingConfig(Section):
    tokenizer: Literal[TOKENIZERS] = "cjk_ngram"  # type: ignore[valid-type]
    # sections: parents are Markdown/HTML sections or paragraphs, children are split inside them
    # chunk: reference flow 3's flat split (child_chars 500, child_overlap 50), each chunk its own parent
    parents: Literal["sections", "chunk"] = "sections"
    parent_chars: int = Field(1500, gt=0)
    child_chars: int = Field(300, gt=0)
    child_overlap: int = Field(50, ge=0)
    # dense vectors of the child chunks next to the BM25 index, for the hybrid retriever and the
    # semantic grader: a model shipped in a package (crag.backends.embedding), or none
    embedding: Literal["none"] | EmbeddingModel = "none"
    # a folder keeping the passage vectors by model and text hash, so that a rebuild embeds only the
    # chunks that changed (crag.backends.embedding.EmbeddingCache); null: embed every chunk each build
    embedding_cache: str | None = None

    @model_validator(mode="after")
    def _overlap_inside_a_chunk(self) -> IndexingConfig:
        if self.child_overlap >= self.child_chars:
            raise ValueError(
                f"indexing.child_overlap ({self.child_overlap}) must be smaller than indexing.child_chars ({self.child_chars})"
            )
        return self


# local, local[N], local[N,F] (F: task failures allowed), local[*]: Spark's local masters
LOCAL_MASTER = re.compile(r"local(?:\[(\*|[1-9][0-9]*)(,[1-9][0-9]*)?\])?")


def usable_cores() -> int:
    """The cores this process may run on (a container's CPU set, not the machine's count): what
    `local[*]` means, and what `crag index` gives a model's runtime."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def connect_url_parts(url: str) -> tuple[ParseResult, list[str]]:
    """An sc:// URL split as pyspark's Spark Connect client splits it: the URL read as http, and its
    `;name=value` parameters as written."""
    parsed = urlparse("http" + url[2:])
    return parsed, parsed.params.split(";") if parsed.params else []


def connect_url_problem(url: str) -> str | None:
    """What pyspark's Spark Connect client would refuse in an sc:// URL (its own parsing rules), said
    without repeating the URL; None when it is well formed. Its token and user info are remembered as
    secrets first (crag.secrets): from here on no text carries them."""
    parsed, params = connect_url_parts(url)
    remember([url, *(unquote(p.partition("=")[2]) for p in params if p.partition("=")[0] == "token")])
    try:
        parsed.port  # noqa: B018  # raises on a port that is not a number
    except ValueError:
        return "the port of the Spark Connect URL is not a number (parameters follow '/;', as in sc://host:15002/;token=...)"
    if parsed.path not in ("", "/"):
        return "the Spark Connect URL has a path: it takes sc://host:port, parameters after '/;'"
    if not parsed.hostname:
        return "the Spark Connect URL has no host"
    if any(p.count("=") != 1 for p in params):
        return (
            "a parameter of the Spark Connect URL is not name=value with one '=' (write an '=' inside a value as %3D)"
        )
    return None


# Spark settings crag sets itself (crag.spark), which `spark.conf` may not change, and why: the
# session's time zone, Delta Lake's catalog, Arrow and a quiet console are what crag's tables and
# lines are written with; the master, the jars and the parallelism have keys of their own.
CRAG_SPARK_SETTINGS = {
    "spark.master": "set spark.master",
    "spark.remote": "set spark.remote",
    "spark.app.name": "crag names its session",
    "spark.jars": "the Delta Lake jars: set spark.jars_dir",
    "spark.default.parallelism": "set spark.partitions",
    "spark.sql.session.timeZone": "crag's tables hold UTC times",
    "spark.sql.extensions": "Delta Lake's extension",
    "spark.sql.catalog.spark_catalog": "Delta Lake's catalog",
    "spark.sql.execution.arrow.pyspark.enabled": "crag moves data through Arrow",
    "spark.ui.enabled": "a local session runs without a web UI",
    "spark.ui.showConsoleProgress": "the progress bar would break crag's lines",
    "spark.sql.shuffle.partitions": "crag sizes its own shuffles",
    "spark.databricks.delta.snapshotPartitions": "crag's small tables",
    "spark.databricks.delta.writeChecksumFile.enabled": "a local session's small commits skip it",
    "spark.databricks.delta.stats.collect": "a local session's small commits skip it",
    "spark.databricks.delta.history.metricsEnabled": "a local session's small commits skip it",
    "spark.databricks.delta.merge.materializeSource": "crag's MERGE sources are a few rows made on the driver",
    "spark.sql.codegen.factoryMode": "crag's many small queries run interpreted",
    "spark.driver.extraJavaOptions": "crag's JVM settings: its log, its JIT, its class-data archive",
    "spark.sql.warehouse.dir": "crag's tables live in --warehouse",
}
CRAG_SPARK_PREFIXES = {"spark.connect.": "Spark Connect's wiring: set spark.remote and spark.connect_timeout_s"}


class SparkConfig(Section):
    master: str = "local[2]"  # classic Spark when no session is active and `remote` is not set
    # Spark Connect: a server URL (sc://host:15002) or local[N] for a local server started in-process,
    # as Databricks serverless runs every job
    remote: str | None = None
    jars_dir: str | None = None  # Delta Lake jars for local Spark (None: .crag/jars, fetched by make)
    partitions: int | None = Field(None, gt=0)  # None: every task slot but one (crag.spark.parallelism; local[N]: N)
    # Input rows in a run's first committed batch; the later batches are sized to take about
    # `batch_seconds` at the rate measured so far (None: every batch has batch_questions rows). A
    # committed batch is what a killed run keeps.
    batch_questions: int = Field(2000, gt=0)
    batch_seconds: float | None = Field(60, gt=0)
    # Pipelines per task, on threads, each taking `questions_per_pipeline` questions at a time through
    # all the stages: out of phase with each other, they keep every remote endpoint busy at once
    # instead of one stage's endpoint at a time. 1 for the in-process embedded backends.
    pipelines_per_task: int = Field(1, gt=0)
    questions_per_pipeline: int | None = Field(None, gt=0)  # None: the task's questions shared out equally
    # Spark Connect: how long crag waits for a server that does not answer, at start and after a lost
    # connection, before it gives up with one line (pyspark's own client would retry for minutes)
    connect_timeout_s: float = Field(60, ge=1, le=DAY_S)
    # Spark settings passed to the session (a new one at start; an active one, or a Connect server's
    # session, takes its runtime settings). One dotted key each; crag's own are refused (CRAG_SPARK_SETTINGS).
    conf: dict[str, str] = Field(default_factory=dict)

    @field_validator("conf", mode="before")
    @classmethod
    def _spark_settings(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value  # pydantic says what a dict should be
        settings = {}
        for key, setting in value.items():
            key = str(key)
            if isinstance(setting, (dict, list)):
                raise PydanticCustomError(
                    "spark_setting",
                    "{key}: a Spark setting takes one value: write each one as a full dotted key "
                    "(spark.sql.shuffle.partitions: 8)",
                    {"key": shown_key(key)},
                )
            if not key.startswith("spark."):
                raise PydanticCustomError(
                    "spark_setting", "{key}: a Spark setting's name starts with 'spark.'", {"key": shown_key(key)}
                )
            owner = CRAG_SPARK_SETTINGS.get(key) or next(
                (why for prefix, why in CRAG_SPARK_PREFIXES.items() if key.startswith(prefix)), None
            )
            if owner is not None:
                raise PydanticCustomError(
                    "spark_setting", "{key} is set by crag ({why})", {"key": shown_key(key), "why": owner}
                )
            settings[key] = (
                "" if setting is None else str(setting).lower() if isinstance(setting, bool) else str(setting)
            )
        return settings

    @field_validator("master", "remote")
    @classmethod
    def _local_threads(cls, value: str | None) -> str | None:
        # Spark itself fails late, with a Java stack, on local[0] or local[x].
        if value is not None and value.startswith("local[") and not LOCAL_MASTER.fullmatch(value):
            raise ValueError(f"{value!r}: local mode takes local[N] or local[N,F] with N >= 1 threads, or local[*]")
        return value

    @field_validator("remote")
    @classmethod
    def _connect_url(cls, value: str | None) -> str | None:
        if value is None or LOCAL_MASTER.fullmatch(value):
            return value
        if not value.startswith("sc://"):
            raise PydanticCustomError("connect_url", "not a Spark Connect URL (sc://host:port) or local[N]")
        problem = connect_url_problem(value)
        if problem:
            raise PydanticCustomError("connect_url", problem)
        return value


class CacheConfig(Section):
    enabled: bool = True  # reuse stored backend results with the same inputs and config (crag run --no-cache: off)


class TrackingConfig(Section):
    enabled: bool = True  # log every run to MLflow
    tracking_uri: str | None = None  # None: SQLite under the warehouse; "databricks" on a Databricks cluster
    experiment: str = "crag"  # on Databricks, a workspace path such as /Shared/crag

    @field_validator("experiment")
    @classmethod
    def _named(cls, value: str) -> str:
        # MLflow refuses an empty name only once the run is over, when the run would be logged
        if not value.strip():
            raise ValueError("an MLflow experiment needs a name (on Databricks, a workspace path such as /Shared/crag)")
        return value


class TablesConfig(Section):
    """The warehouse's tables: a catalog.schema warehouse's schema, and the run ids' lease. (A local
    folder's tables are named by their paths: crag.warehouse.)"""

    # a catalog.schema warehouse whose schema does not exist: created by crag (else: an error that says so)
    create_schema: bool = False
    # a run id held by a process that stopped sending heartbeats this long ago may be taken over
    stale_run_after_s: float = Field(default=900, gt=0)


class CragConfig(Section):
    input: InputConfig = Field(default_factory=InputConfig)
    indexing: IndexingConfig = Field(default_factory=IndexingConfig)
    retriever: RetrieverConfig = Field(default_factory=BM25RetrieverConfig)
    grader: GraderConfig = Field(default_factory=LexicalGraderConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    rewriter: RewriterConfig = Field(default_factory=KeywordRewriterConfig)
    web_search: WebSearchConfig = Field(default_factory=OfflineCorpusConfig)
    refinement: RefinementConfig = Field(default_factory=RefinementConfig)
    generator: GeneratorConfig = Field(default_factory=ExtractiveGeneratorConfig)
    spark: SparkConfig = Field(default_factory=SparkConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    mlflow: TrackingConfig = Field(default_factory=TrackingConfig)
    tables: TablesConfig = Field(default_factory=TablesConfig)

    @model_validator(mode="before")
    @classmethod
    def _default_backends(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for section, backend in DEFAULT_BACKENDS.items():
                if isinstance(data.get(section), dict) and "backend" not in data[section]:
                    data = {**data, section: {**data[section], "backend": backend}}
        return data

    def llm_roles(self) -> dict[str, LLMConfig]:
        """The sections that call a chat model, by dotted config path."""
        roles = {
            "grader": self.grader,
            "rewriter": self.rewriter,
            "generator": self.generator,
            "web_search.verify": self.web_search.verify,
        }
        return {name: role for name, role in roles.items() if isinstance(role, LLMConfig)}

    def hash(self) -> str:
        """What the config computes, for the runs table and MLflow: taken over the config with its
        secrets masked (crag.secrets.masked), so that a stored hash cannot confirm a guess at one."""
        return stable_hash(masked(self.model_dump(mode="json")))


class _Absent:
    """A key one of two configs lacks (config_changes), apart from a key whose value is null."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()


def config_changes(before: Any, after: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """The dotted keys whose values differ between two JSON-able configs (stored ones: `runs.config`),
    with both values (ABSENT where a key is missing, None where it is null), in key order. A list is
    one value."""
    if not isinstance(before, dict) or not isinstance(after, dict):
        return [] if before == after else [(prefix, before, after)]
    changes = []
    for key in sorted(set(before) | set(after), key=str):
        changes += config_changes(
            before.get(key, ABSENT), after.get(key, ABSENT), f"{prefix}.{key}" if prefix else str(key)
        )
    return changes


@dataclass(frozen=True)
class ConfigDifference:
    """What two stored configs (`runs.config`, redacted) differ in: `changes` as config_changes gives
    them; `masked`: no stored value differs but the config hashes do, so a value the stored configs
    mask differs (a store's `text_key`: see crag.secrets.masked)."""

    changes: list[tuple[str, Any, Any]]
    masked: bool = False

    @classmethod
    def between(cls, before: dict, before_hash: str, after: dict, after_hash: str) -> ConfigDifference:
        changes = config_changes(before, after)
        return cls(changes, not changes and before_hash != after_hash)

    def keys(self) -> list[str]:
        return [shown_key(key) for key, _, _ in self.changes]


def shown_key(key: str) -> str:
    """A config key fit for a terminal line: as it is, or JSON-escaped when it holds a control,
    format or line-separating character (a key under `kwargs` or `filters` is the user's text)."""
    return key if key.isprintable() else json.dumps(key)


def stable_hash(value: Any) -> str:
    """Short content hash of a JSON-able value, independent of key order."""
    blob = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def redacted(value: Any) -> Any:
    """The config as JSON-able data fit to store (runs table, MLflow): secret-bearing keys masked and
    every value scrubbed of URL credentials and resolved secrets (crag.secrets.redact_config)."""
    return redact_config(value)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value parsed as YAML, so numbers, booleans and lists work);
    `spark.conf.spark.sql.x=value` -> (["spark", "conf", "spark.sql.x"], value)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"an override (--set, or one of --overrides) must be key=value, got {item!r}")
    try:
        value = safe_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        # the value is not repeated: it may be a credential typed on the command line
        raise ConfigError(f"--set {key}: its value is not valid YAML ({yaml_problem(exc)})") from None
    key = key.strip()
    if key.startswith(SPARK_CONF_PREFIX):  # a Spark setting's own name is dotted: one key under spark.conf
        return [*SPARK_CONF_PREFIX.split(".")[:2], key[len(SPARK_CONF_PREFIX) :]], value
    return key.split("."), value


SPARK_CONF_PREFIX = "spark.conf."


def deep_merge(base: dict, overlay: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


# A config or prompt file is small: a few hundred values. Aliases can make a tiny file stand for an
# exponential number of them (a "billion laughs" bomb), which then costs minutes and all memory to
# expand; past this many values, once aliases are expanded, the file is refused.
MAX_YAML_VALUES = 10_000


# libyaml's parser (PyYAML's wheels carry it): 15x faster than PyYAML's pure-Python one, a few
# milliseconds of every command's config, and it refuses nesting deeper than 1,000 levels itself, where
# the Python parser recursed to Python's limit. A PyYAML built without it parses in Python.
_SAFE_LOADER: type = yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader


class _ConfigLoader(_SAFE_LOADER):
    """safe_load that refuses a document whose aliases refer to themselves or expand past
    MAX_YAML_VALUES values, before anything is built from it."""

    def construct_document(self, node: yaml.Node) -> Any:
        _count_values(node, {}, set())
        return super().construct_document(node)


def _count_values(node: yaml.Node, counted: dict[int, int], open_nodes: set[int]) -> int:
    """How many values `node` stands for with every alias expanded (shared nodes are counted once per
    use, but computed once)."""
    if id(node) in counted:
        return counted[id(node)]
    if id(node) in open_nodes:
        raise yaml.YAMLError(f"an alias refers to the value that contains it (line {node.start_mark.line + 1})")
    open_nodes.add(id(node))
    children: list = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        _refuse_repeated_keys(node)
        children = [item for pair in node.value for item in pair]
    total = 1 + sum(_count_values(child, counted, open_nodes) for child in children)
    open_nodes.discard(id(node))
    if total > MAX_YAML_VALUES:
        raise yaml.YAMLError(f"aliases expand it to more than {MAX_YAML_VALUES} values")
    counted[id(node)] = total
    return total


def _refuse_repeated_keys(node: yaml.MappingNode) -> None:
    """PyYAML keeps the last of two equal keys and drops the first without a word: a config whose
    `retriever:` section is written twice would silently lose half of its settings. Keys are equal as
    PyYAML builds them (`true` and `yes`, `1` and `0x1`; not `1` and `"1"`). The error gives the lines
    (and columns, for two on one line), not the key: a key is the user's text and may be anything."""
    first: dict[Any, yaml.Mark] = {}
    constructor = yaml.constructor.SafeConstructor()
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue  # a list or mapping as a key is refused by PyYAML itself; `<<` may be repeated
        try:
            value = constructor.construct_object(key)
            hash(value)
        except (yaml.YAMLError, TypeError, ValueError):
            value = (key.tag, key.value)
        if value in first:
            here, there = key.start_mark, first[value]
            same_line = here.line == there.line
            raise yaml.YAMLError(
                f"a key on line {here.line + 1}{f' (column {here.column + 1})' if same_line else ''} repeats "
                f"the key on line {there.line + 1}{f' (column {there.column + 1})' if same_line else ''}"
            )
        first[value] = key.start_mark


def safe_yaml(text: str) -> Any:
    """yaml.safe_load for crag's configs and prompt templates: also refuses alias bombs, aliases that
    contain themselves, and nesting too deep to read (yaml.YAMLError)."""
    try:
        return yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 (a SafeLoader)
    except RecursionError:  # nesting within libyaml's limit: _count_values recurses through it
        raise yaml.YAMLError("nested too deeply") from None
    except UnicodeEncodeError:  # libyaml takes UTF-8: an argument's undecodable bytes (lone surrogates)
        raise yaml.YAMLError("not valid UTF-8") from None


def _read_yaml(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}")
    try:
        data = safe_yaml(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path} is not valid YAML: {yaml_problem(exc)}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not valid YAML: {describe(exc, with_type=False)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must be a mapping of sections, got {type(data).__name__}")
    return data


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What PyYAML found wrong and where, without the text it quotes from the document (a value that
    may be a credential: "found undefined alias 'p4ss'")."""
    if not isinstance(exc, yaml.MarkedYAMLError) or not exc.problem:
        return str(exc) if type(exc) is yaml.YAMLError else type(exc).__name__  # crag's own, or a bare class
    problem = re.sub(r"'[^']*'|\"[^\"]*\"", "…", exc.problem)
    mark = exc.problem_mark
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark else problem


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def interpolate(value: Any, where: str = "") -> Any:
    """${NAME} or ${NAME:-default} in string values -> the environment variable (or the default), so
    one config file serves a laptop and a server. An unset variable without a default is an error. An
    empty result means "not set" (None)."""
    if isinstance(value, dict):
        return {k: interpolate(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, where) for v in value]
    if not isinstance(value, str) or "${" not in value:
        return value

    def replace(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is None:
            raise ConfigError(
                f"config key {where!r} refers to ${{{name}}}, which is not set (give a default: ${{{name}:-...}})"
            )
        return default

    result = _ENV_REF.sub(replace, value)
    return result if result != "" else None


BASE_VARIANT = "base"  # the name a run without an overlay records; --variant base applies none


_VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


def variant_path(conf_path: Path, variant: str) -> Path:
    """Variants live beside the config: conf/variants/<name>.yaml for conf/local.yaml. A variant is
    named, never given as a path: no folder, no "..", so only files in that folder can be loaded."""
    folder = conf_path.parent / "variants"
    if not _VARIANT_NAME.fullmatch(variant) or ".." in variant or len(variant) > 128:
        raise ConfigError(
            f"--variant {variant!r}: give the name of a file in {folder} without .yaml "
            "(letters, digits, '_', '-', '.'), not a path"
        )
    return folder / f"{variant}.yaml"


PACKAGED_CONF = Path(__file__).parent / "conf"  # the checkout's conf/ (a symlink), shipped inside the wheel


def config_path(conf: str | Path) -> Path:
    """--conf: a config file, or, when there is no such file, the name of a config shipped with crag
    ("local", "databricks.yaml"), so that an installed wheel runs without a checkout. Its variants
    and prompts are then the shipped ones too (they resolve next to the file loaded)."""
    path = Path(conf)
    if path.is_file() or len(path.parts) != 1:
        return path
    packaged = PACKAGED_CONF / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    if packaged.is_file():
        return packaged
    known = ", ".join(sorted(p.stem for p in PACKAGED_CONF.glob("*.yaml"))) or "none"
    raise ConfigError(f"config file not found: {conf} (nor is it the name of a config shipped with crag: {known})")


def _drop_replaced_backends_keys(data: dict, file_backends: dict[str, Any], overridden: set[tuple[str, ...]]) -> None:
    """A --set (or a variant) that switches a section's backend (`web_search.backend=none` over
    conf/local.yaml) leaves the file's keys of the backend it replaces (`web_search.index`): those the new backend does
    not take, and another of the section's backends does, are dropped. Any other key stays to be
    checked: a mistyped one, or one a --set gave (`web_search.index=...`), still fails."""
    for name, field in CragConfig.model_fields.items():
        section = data.get(name)
        if (name, "backend") not in overridden or not isinstance(section, dict):
            continue
        if section.get("backend") == file_backends.get(name):
            continue  # not switched
        backends = [m for m in get_args(field.annotation) if "backend" in getattr(m, "model_fields", {})]
        chosen = [m for m in backends if section.get("backend") in get_args(m.model_fields["backend"].annotation)]
        if not chosen:
            continue  # an unknown backend: validation says so
        others = {key for m in backends if m is not chosen[0] for key in m.model_fields}
        given = {path[1] for path in overridden if len(path) > 1 and path[0] == name}
        for key in [k for k in section if k not in chosen[0].model_fields and k in others and k not in given]:
            del section[key]


def _backends(data: dict) -> dict[str, Any]:
    return {name: section.get("backend") for name, section in data.items() if isinstance(section, dict)}


def load_config(path: str | Path | None, overrides: Sequence[str] = (), variant: str | None = None) -> CragConfig:
    path = config_path(path) if path else None
    data: dict = _read_yaml(path, "config file") if path else {}
    if variant == "":  # an unset shell variable (--variant "$V"): said, not run as the base config
        raise ConfigError("--variant is empty: give a variant's name, or leave --variant out for the base config")
    if variant and variant != BASE_VARIANT:
        if not path:
            raise ConfigError("--variant needs --conf: variants are overlays on a config file")
        vpath = variant_path(path, variant)
        if not vpath.is_file():
            known = sorted(p.stem for p in vpath.parent.glob("*.yaml"))
            raise ConfigError(f"unknown variant {variant!r}: no {vpath} (known: {', '.join(known) or 'none'})")
        overlay = _read_yaml(vpath, "variant file")
        base_backends = _backends(data)
        data = deep_merge(data, overlay)
        # A variant that switches a backend (variant lexical: grader.backend) drops the base's keys of
        # the one it replaces, as a --set does.
        given: set[tuple[str, ...]] = {
            (name, key) for name, section in overlay.items() if isinstance(section, dict) for key in section
        }
        _drop_replaced_backends_keys(data, base_backends, given)
    file_backends = _backends(data)
    overridden: set[tuple[str, ...]] = set()
    for item in overrides:
        keys, value = parse_override(item)
        overridden.add(tuple(keys))
        node = data
        for key in keys[:-1]:
            if node.get(key) is None:  # absent, or null in the file: setting a key inside creates it
                node[key] = {}
            node = node[key]
            if not isinstance(node, dict):
                raise ConfigError(f"--set {'.'.join(keys)}: {key!r} is not a section")
        node[keys[-1]] = value
    _drop_replaced_backends_keys(data, file_backends, overridden)
    data = interpolate(data)
    try:
        cfg = CragConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None
    load_prompts(cfg, path.parent if path else Path.cwd())
    return cfg


def load_prompts(cfg: CragConfig, base: Path) -> None:
    """Read each LLM role's prompt template into the config, so the config (and its hash) carries the
    exact prompt text and Spark workers need no prompt files."""
    for name, role in cfg.llm_roles().items():
        if role.prompt_text is not None:
            continue
        path = Path(role.prompt) if Path(role.prompt).is_absolute() else base / role.prompt
        if not path.is_file():
            raise ConfigError(f"config key '{name}.prompt': prompt template not found: {path}")
        role.prompt_text = path.read_text(encoding="utf-8")
    grader = cfg.grader
    if isinstance(grader, LLMGraderConfig):
        _check_grading_prompt(grader)


# crag's own grading prompts, each asking for one format
_GRADING_PROMPTS = {"binary": "grade_binary.yaml", "score": "grade_score.yaml"}


def _check_grading_prompt(grader: LLMGraderConfig) -> None:
    """crag's own grading prompt of the other format (a copy too) would make every reply unreadable:
    every document graded irrelevant. A prompt of one's own is the user's to match."""
    for fmt, file in _GRADING_PROMPTS.items():
        shipped = PACKAGED_CONF / "prompts" / file
        if fmt != grader.format and shipped.is_file() and grader.prompt_text == shipped.read_text(encoding="utf-8"):
            raise ConfigError(
                f"config key 'grader.format': {grader.format}, but its prompt {grader.prompt} is crag's "
                f"{file}, which asks for the {fmt} format: set grader.prompt=prompts/{_GRADING_PROMPTS[grader.format]} too"
            )


def _walk(loc: tuple) -> tuple[str, type[BaseModel] | None]:
    """The dotted key a pydantic error location stands for (union tags such as "bm25" dropped) and the
    model that holds its last part."""
    model: Any = CragConfig
    keys: list[str] = []
    for part in loc:
        fields = getattr(model, "model_fields", {})
        if str(part) in fields:
            keys.append(str(part))
            annotation = fields[str(part)].annotation
            members = [a for a in _flatten(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
            model = members[0] if len(members) == 1 else members
        elif isinstance(model, list):  # a union: the part is the tag that picked the member
            model = next((m for m in model if str(part) in _backends_of(m)), None)
        else:
            keys.append(str(part))
    return ".".join(keys), model if isinstance(model, type) else None


def _flatten(annotation: Any) -> list[Any]:
    args = get_args(annotation)
    return [x for a in args for x in _flatten(a)] if args else [annotation]


def _backends_of(model: type[BaseModel]) -> tuple:
    field = model.model_fields.get("backend")
    return get_args(field.annotation) if field is not None else ()


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem, each naming the dotted key and, for unknown keys or backends, the allowed
    ones."""
    lines = []
    for err in exc.errors():
        key, _ = _walk(err["loc"])
        if err["type"] == "extra_forbidden":
            _, holder = _walk(err["loc"][:-1])
            allowed = ", ".join(holder.model_fields) if holder is not None else "?"
            # spark.sql.x=...: a Spark setting, given as a key of crag's spark section
            hint = f"; a Spark setting is given as {SPARK_CONF_PREFIX}spark.…" if holder is SparkConfig else ""
            lines.append(f"unknown config key {key!r} (allowed here: {allowed}{hint})")
        elif err["type"] == "union_tag_invalid":
            ctx = err["ctx"]
            lines.append(f"config key '{key}.backend': got {ctx['tag']!r}, expected one of {ctx['expected_tags']}")
        elif err["type"] == "literal_error":
            lines.append(f"config key {key!r}: got {err['input']!r}, expected {err['ctx']['expected']}")
        elif err["type"] == "boolean_number":
            ctx = err["ctx"]
            lines.append(
                f"config key '{key + '.' if key else ''}{ctx['field']}': a boolean is not a number (got {ctx['value']})"
            )
        elif err["type"] == "missing":
            lines.append(f"config key {key!r} is required here")
        elif err["type"] == "string_type" and isinstance(err["input"], dict):
            # a text with ": " in it, unquoted (a refusal message): YAML reads it as a mapping
            lines.append(
                f"config key {key!r}: {err['msg']} (got a mapping: YAML reads `a: b` as one; put the value in quotes)"
            )
        else:
            where = f"config key {key!r}: " if key else "config: "
            # a check across a section's keys names the keys and their values itself: not the whole
            # section; nor is a value shown that may be a credential
            hidden = isinstance(err["input"], dict) or any(
                is_secret_key(str(part)) or str(part).endswith("_env") for part in err["loc"]
            )
            got = "" if hidden else f" (got {scrub(repr(err['input']))})"
            lines.append(f"{where}{err['msg']}{got}")
    return "; ".join(lines)


def resolve_paths(cfg: CragConfig) -> CragConfig:
    """Index paths are relative to the working directory; Spark workers may run elsewhere, so they get
    absolute ones. Names that are not local paths (Unity Catalog, Volumes) are left as they are."""
    cfg = cfg.model_copy(deep=True)
    for section in (cfg.retriever, cfg.web_search):
        index = getattr(section, "index", None)
        if isinstance(index, str) and index and not index.startswith(("/", "dbfs:", "s3:", "abfss:", "gs:")):
            setattr(section, "index", str(Path(index).resolve()))
    return cfg


def crag_home() -> Path:
    """Where crag keeps its per-user state and caches (CRAG_HOME, default ~/.crag): the warm Spark
    server's address (crag spark start), a new MLflow store's template."""
    return Path(os.environ.get("CRAG_HOME") or Path.home() / ".crag")
