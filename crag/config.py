"""Typed, validated configuration: a YAML file, an optional variant overlay, then `--set key=value`.

Every section forbids unknown keys, so a typo fails before any work starts with a message that names
the key and the keys allowed there.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from crag.errors import ConfigError
from crag.text import TOKENIZERS

DEFAULT_REFUSAL = "I don't know: the available documents do not answer this question."


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class InputConfig(Section):
    max_question_chars: int = Field(2000, gt=0)


class RetrieverConfig(Section):
    backend: Literal["bm25"] = "bm25"
    index: str | None = None
    k: int = Field(10, gt=0)


class GraderConfig(Section):
    backend: Literal["lexical"] = "lexical"
    threshold: float = Field(0.5, ge=0, le=1)


class RewriterConfig(Section):
    backend: Literal["keywords"] = "keywords"
    policy_keywords: list[str] = Field(default_factory=list)


class WebSearchConfig(Section):
    backend: Literal["offline_corpus", "none"] = "offline_corpus"
    index: str | None = None
    k: int = Field(3, gt=0)
    grade_results: bool = True


class GeneratorConfig(Section):
    backend: Literal["extractive"] = "extractive"
    max_sentences: int = Field(2, ge=1, le=3)
    min_sentence_score: float = Field(0.2, ge=0, le=1)
    refusal_message: str = DEFAULT_REFUSAL


class RoutingConfig(Section):
    policy: Literal["any_irrelevant", "all_irrelevant", "min_context_chars", "thresholds"] = "any_irrelevant"
    max_relevant_docs: int = Field(5, gt=0)
    min_context_chars: int = Field(100, ge=0)
    upper: float = Field(0.6, ge=0, le=1)
    lower: float = Field(0.3, ge=0, le=1)

    @model_validator(mode="after")
    def _ordered(self) -> "RoutingConfig":
        if self.lower > self.upper:
            raise ValueError(f"routing.lower ({self.lower}) must not exceed routing.upper ({self.upper})")
        return self


class RefinementConfig(Section):
    enabled: bool = False
    strip: Literal["sentence", "words"] = "sentence"
    window_words: int = Field(50, gt=0)
    keep: int = Field(5, gt=0)


class IndexingConfig(Section):
    tokenizer: Literal[TOKENIZERS] = "cjk_ngram"  # type: ignore[valid-type]
    parent_chars: int = Field(1500, gt=0)
    child_chars: int = Field(300, gt=0)
    child_overlap: int = Field(50, ge=0)


class SparkConfig(Section):
    master: str = "local[2]"
    partitions: int | None = Field(None, gt=0)


class TablesConfig(Section):
    backend: Literal["delta_rs", "unity_catalog"] = "delta_rs"


class CragConfig(Section):
    input: InputConfig = Field(default_factory=InputConfig)
    indexing: IndexingConfig = Field(default_factory=IndexingConfig)
    retriever: RetrieverConfig = Field(default_factory=RetrieverConfig)
    grader: GraderConfig = Field(default_factory=GraderConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    rewriter: RewriterConfig = Field(default_factory=RewriterConfig)
    web_search: WebSearchConfig = Field(default_factory=WebSearchConfig)
    refinement: RefinementConfig = Field(default_factory=RefinementConfig)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    spark: SparkConfig = Field(default_factory=SparkConfig)
    tables: TablesConfig = Field(default_factory=TablesConfig)

    def hash(self) -> str:
        return stable_hash(self.model_dump(mode="json"))


def stable_hash(value: Any) -> str:
    """Short content hash of a JSON-able value, independent of key order."""
    blob = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


_SECRET_WORDS = ("token", "secret", "password", "api_key", "apikey", "credential")


def redacted(value: Any) -> Any:
    """The config as JSON-able data with every secret-looking value replaced; names of environment
    variables (keys ending in _env) are kept, since they say where a secret comes from, not what it is."""
    if isinstance(value, dict):
        return {
            k: ("***" if v and any(w in k.lower() for w in _SECRET_WORDS) and not k.endswith("_env") else redacted(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redacted(v) for v in value]
    return value


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value parsed as YAML, so numbers, booleans and lists work)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects key=value, got {item!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: value {raw!r} is not valid YAML ({exc.__class__.__name__})") from None
    return key.strip().split("."), value


def deep_merge(base: dict, overlay: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _read_yaml(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise ConfigError(f"{what} {path} is not valid YAML: {first}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must be a mapping of sections, got {type(data).__name__}")
    return data


def variant_path(conf_path: Path, variant: str) -> Path:
    """Variants live beside the config: conf/variants/<name>.yaml for conf/local.yaml."""
    return conf_path.parent / "variants" / f"{variant}.yaml"


def load_config(path: str | Path | None, overrides: list[str] = (), variant: str | None = None) -> CragConfig:
    data: dict = _read_yaml(Path(path), "config file") if path else {}
    if variant:
        if not path:
            raise ConfigError("--variant needs --conf: variants are overlays on a config file")
        vpath = variant_path(Path(path), variant)
        if not vpath.is_file():
            known = sorted(p.stem for p in vpath.parent.glob("*.yaml"))
            raise ConfigError(f"unknown variant {variant!r}: no {vpath} (known: {', '.join(known) or 'none'})")
        data = deep_merge(data, _read_yaml(vpath, "variant file"))
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {'.'.join(keys)}: {key!r} is not a section")
        node[keys[-1]] = value
    try:
        return CragConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem, each naming the dotted key and, for unknown keys, the allowed ones."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            model: type[BaseModel] = CragConfig
            for part in err["loc"][:-1]:
                field = model.model_fields.get(str(part))
                model = field.annotation if field is not None else model
            allowed = ", ".join(model.model_fields)
            lines.append(f"unknown config key {loc!r} (allowed here: {allowed})")
        elif err["type"] == "literal_error":
            lines.append(f"config key {loc!r}: got {err['input']!r}, expected {err['ctx']['expected']}")
        else:
            where = f"config key {loc!r}: " if loc else "config: "
            lines.append(f"{where}{err['msg']} (got {err['input']!r})")
    return "; ".join(lines)
