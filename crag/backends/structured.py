"""Structured output: how a request asks an OpenAI-compatible server to keep the reply to a role's JSON
schema, in each of the ways servers take it, and the GBNF grammar llama.cpp takes, generated from the
schema.

Servers differ: OpenAI, vLLM, SGLang, Ollama and llama.cpp's own server take response_format
json_schema; llama-cpp-python's server refuses it (HTTP 500, a pydantic literal_error) and takes
response_format json_object with a `schema`, or a GBNF `grammar`; vLLM also takes `guided_json`. The
config names one mode, or `auto`, which OpenAICompatible resolves by probing the server once.

The grammar is generated for the JSON-schema forms crag's roles use (an object of fixed properties,
strings from an enum or of bounded length, integers in a small range, booleans); any other form is
refused with a ValueError rather than approximated. llama-cpp-python ships a general converter
(llama_cpp.llama_grammar.json_schema_to_gbnf), but crag does not depend on llama-cpp-python, and no
library on PyPI that does this alone is maintained.
"""

from __future__ import annotations

import json
import re
from typing import Any

# The modes, in the order `auto` tries them: the most widely taken first. json_object before grammar,
# since a server that does not know `grammar` may ignore the field rather than refuse it; but a server
# known to take GBNF (llama.cpp's, llama-cpp-python's) gets crag's grammar first: llama-cpp-python's own
# schema converter lets control characters into strings, which makes the JSON invalid.
PROBED_MODES = ("json_schema", "json_object", "grammar")
PROBED_MODES_GBNF = ("json_schema", "grammar", "json_object")


def object_schema(name: str, **properties: dict) -> dict:
    """A json_schema wrapper ({"name", "schema", "strict"}) for an object of exactly these properties,
    all required, in this order: the form OpenAI's strict mode takes and `gbnf` states."""
    schema = {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}
    return {"name": name, "schema": schema, "strict": True}


def request_fields(mode: str, schema: dict) -> dict:
    """The body fields that ask for `schema` (a json_schema wrapper: {"name", "schema", "strict"}) in
    `mode`; {} for none."""
    if mode == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    if mode == "json_object":
        return {"response_format": {"type": "json_object", "schema": schema["schema"]}}
    if mode == "grammar":
        return {"grammar": gbnf(schema["schema"])}
    if mode == "guided_json":
        return {"guided_json": schema["schema"]}
    if mode == "none":
        return {}
    raise ValueError(f"unknown structured output mode {mode!r}")


# ------------------------------------------------------------------ GBNF from a JSON schema

# A JSON string's character: anything but a quote, a backslash or a control character, or an escape.
_CHAR = r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
_MAX_INTEGER_CHOICES = 1000


def gbnf(schema: dict) -> str:
    """A GBNF grammar whose language is the compact JSON texts (one optional space after a colon or
    comma) that `schema` describes. ValueError for a schema form it does not cover."""
    rules: dict[str, str] = {"root": ""}  # first in the text
    rules["root"] = _value(schema, "root", rules)
    if any(re.search(r"\bchar\b", body) for body in rules.values()):
        rules["char"] = _CHAR
    if any(re.search(r"\bws\b", body) for body in rules.values()):
        rules["ws"] = '" "?'
    return "".join(f"{name} ::= {body}\n" for name, body in rules.items())


def _literal(text: str) -> str:
    """`text` as a GBNF string literal."""
    escaped = "".join(
        {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c, c)
        if c in '\\"\n\r\t' or ord(c) >= 0x20
        else f"\\x{ord(c):02X}"
        for c in text
    )
    return f'"{escaped}"'


def _rule_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9-]+", "-", name).strip("-") or "value"


def _value(schema: Any, name: str, rules: dict[str, str]) -> str:
    """The body of the rule for a value of `schema`; rules it needs are added to `rules`."""
    if not isinstance(schema, dict):
        raise ValueError(f"{name}: a schema must be an object")
    if "enum" in schema:
        return " | ".join(_literal(json.dumps(v, ensure_ascii=False)) for v in schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        return _object(schema, name, rules)
    if kind == "string":
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        count = f"{{{low},{'' if high is None else high}}}"
        return f'"\\"" char{count} "\\""'
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is None or high is None or high - low >= _MAX_INTEGER_CHOICES:
            raise ValueError(f"{name}: an integer needs a minimum and a maximum (a small range)")
        return " | ".join(_literal(str(n)) for n in range(low, high + 1))
    if kind == "boolean":
        return '"true" | "false"'
    raise ValueError(f"{name}: no grammar for this schema (type {kind!r})")


def _object(schema: dict, name: str, rules: dict[str, str]) -> str:
    """An object with exactly its properties, in their order: the schema must require them all and
    forbid others (as OpenAI's strict mode does), so that the grammar's language is the schema's."""
    properties = schema.get("properties") or {}
    if schema.get("additionalProperties", True) is not False or set(schema.get("required", [])) != set(properties):
        raise ValueError(f"{name}: an object must require every property and set additionalProperties: false")
    parts = []
    for key, sub in properties.items():
        rule = _rule_name(f"{name}-{key}")
        if rule in rules:
            raise ValueError(f"{name}: two properties give the rule name {rule!r}")
        rules[rule] = ""  # reserved before its body is made, so a nested property cannot take the name
        rules[rule] = _value(sub, rule, rules)
        parts.append(f'{_literal(json.dumps(key, ensure_ascii=False))} ws ":" ws {rule}')
    inner = ' ws "," ws '.join(parts)
    return f'"{{" ws {inner} ws "}}"' if parts else '"{" ws "}"'
