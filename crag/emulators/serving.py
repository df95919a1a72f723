"""Databricks model serving and OpenAI-compatible chat, emulated. The model is not a language model: it
reads the question and documents from between the delimiters of crag's prompts and answers with the
lexical grader and the extractive answerer, so its outputs are deterministic and grounded."""

from __future__ import annotations

import json
import re
import time
from typing import TYPE_CHECKING, Any

from crag.backends.base import Usage

if TYPE_CHECKING:
    from crag.emulators.server import Emulator, ServiceBehaviour

# The OpenAI-compatible servers /v1 can answer as (ServiceBehaviour.chat_server), each in its own ways:
# vllm: takes response_format json_schema and the guided-decoding fields, and describes nothing;
# llama-cpp-python: refuses response_format json_schema as its pydantic request model does (HTTP 500,
#   a literal_error), takes json_object with a schema and `grammar`, and names itself in its OpenAPI
#   title (it runs one request at a time);
# llama.cpp: takes them all, and its /props gives its context window and slots.
CHAT_SERVERS = ("vllm", "llama-cpp-python", "llama.cpp")
LLAMA_CPP_PYTHON_TITLE = "\U0001f999 llama.cpp Python API"

# A block opens with its tag alone on a line (as in crag's prompts); "the <document> tags" in the
# instructions is prose, not a block.
_TAG = {name: re.compile(rf"<{name}[^>]*>\n(.*?)\n</{name}>", re.S) for name in ("question", "document", "web_result")}


# Body fields of vLLM's and SGLang's guided decoding, each an alternative to response_format.
GUIDED_DECODING = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "regex", "json_schema", "ebnf")


def _tag(name: str, text: str) -> str:
    match = _TAG[name].search(text)
    return match.group(1).strip() if match else ""


def _tokens(text: str) -> int:
    return max(1, len(text.split()))


def _model_reply(emulator: Emulator, system: str, user: str, fault: str) -> str:
    if fault == "malformed":
        return "I am not sure how to answer in the requested format."
    # The same prompt always gets the same reply: remembered, so that the emulator's own computing
    # does not compete for CPU with the client it serves in a benchmark.
    with emulator._lock:
        reply = emulator._replies.get((system, user))
    if reply is None:
        reply = _lexical_reply(emulator, system, user)
        with emulator._lock:
            if len(emulator._replies) < 50_000:
                emulator._replies[(system, user)] = reply
    return (
        f"Sure! Here is my answer:\n```json\n{reply}\n```\nLet me know if you need more." if fault == "prose" else reply
    )


def _lexical_reply(emulator: Emulator, system: str, user: str) -> str:
    """What the lexical model says to one prompt, read from crag's delimiters."""
    scorer, rewriter, generator = emulator.model
    prompt = f"{system}\n{user}"
    question = _tag("question", prompt)
    if "<web_result" in prompt:  # reference flow 3's source check: YES/NO
        relevance, _ = scorer.score(scorer.terms(question), _tag("web_result", prompt))
        return "YES" if relevance >= 0.5 else "NO"
    if "<document" in prompt and "<context" not in prompt:  # relevance grading
        relevance, matched = scorer.score(scorer.terms(question), _tag("document", prompt))
        if "Score:" in system:
            return (
                f"Score: {round(relevance * 5)}\nReason: {len(matched)} of the question's terms appear in the document."
            )
        return json.dumps({"grade": "yes" if relevance >= 0.5 else "no"})
    if "<context" in prompt:  # answer generation
        docs = [{"text": t} for t in _TAG["document"].findall(prompt)]
        answer = generator.generate(question, docs, Usage())
        if answer.text is None:
            refusal = re.search(r'exactly: "([^"]+)"', system)
            return refusal.group(1) if refusal else "I don't know."
        return answer.text + "".join(f" [{i + 1}]" for i in answer.cited)
    return rewriter.rewrite(question or user, None)  # web-query rewriting


def _messages_text(messages: list[dict]) -> tuple[str, str]:
    def content(m):
        c = m.get("content")
        return c if isinstance(c, str) else " ".join(b.get("text", "") for b in c or [] if isinstance(b, dict))

    system = "\n".join(content(m) for m in messages if m.get("role") == "system")
    user = "\n".join(content(m) for m in messages if m.get("role") != "system")
    return system, user


def _chat_completion(emulator: Emulator, body: dict, fault: str) -> dict:
    system, user = _messages_text(body.get("messages") or [])
    text = _model_reply(emulator, system, user, fault)
    content: str | list = text
    if fault == "blocks":
        reasoning = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "The user asks a question."}]}
        content = [reasoning, {"type": "text", "text": text}]
    return {
        "id": f"chatcmpl-{len(emulator.requests)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", "emulated"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": _tokens(system + user),
            "completion_tokens": _tokens(text),
            "total_tokens": _tokens(system + user) + _tokens(text),
        },
    }


def description(behaviour: ServiceBehaviour, method: str, path: str) -> tuple[int, dict] | None:
    """What the emulated chat server says of itself at `path` (None: not a description it gives)."""
    if method != "GET":
        return None
    if path == "/props" and behaviour.chat_server == "llama.cpp":
        n_ctx = behaviour.context_tokens or 4096
        return 200, {"default_generation_settings": {"n_ctx": n_ctx}, "total_slots": behaviour.slots}
    if path == "/openapi.json" and behaviour.chat_server == "llama-cpp-python":
        return 200, {"openapi": "3.1.0", "info": {"title": LLAMA_CPP_PYTHON_TITLE, "version": "0.0.1"}}
    return None


def _refusal(behaviour: ServiceBehaviour, body: dict) -> tuple[int, dict] | None:
    """The error the emulated server answers a chat request it does not take with (None: it takes it)."""
    response_format = body.get("response_format") or {}
    if behaviour.chat_server == "llama-cpp-python" and response_format.get("type") not in (None, "text", "json_object"):
        # as llama-cpp-python 0.3.36's server words pydantic's error, with status 500 and its traceback
        error = {
            "type": "literal_error",
            "loc": ("body", "response_format", "type"),
            "msg": "Input should be 'text' or 'json_object'",
            "input": response_format.get("type"),
            "ctx": {"expected": "'text' or 'json_object'"},
        }
        message = (
            f'1 validation error:\n  {error}\n\n  File "llama_cpp/server/app.py", line 376, in '
            "create_chat_completion\n    POST /v1/chat/completions"
        )
        return 500, {"error": {"message": message, "type": "internal_server_error", "param": None, "code": None}}
    if behaviour.context_tokens is not None:
        system, user = _messages_text(body.get("messages") or [])
        prompt, completion = _tokens(system + user), int(body.get("max_tokens") or 16)
        if prompt + completion > behaviour.context_tokens:
            message = (
                f"This model's maximum context length is {behaviour.context_tokens} tokens, however you requested "
                f"{prompt + completion} tokens ({prompt} in your prompt; {completion} for the completion). Please "
                "reduce your prompt; or completion length."
            )
            error = {"message": message, "type": "invalid_request_error", "param": "messages"}
            return 400, {"error": {**error, "code": "context_length_exceeded"}}
    return None


def serving(emulator: Emulator, method: str, path: str, body: Any, fault: str):
    if path.startswith("/api/2.0/serving-endpoints/") and method == "GET":  # describe (the Vector Search client asks)
        name = path.rsplit("/", 1)[-1]
        return 200, {"id": f"ep-{name}", "name": name, "route_optimized": False, "state": {"ready": "READY"}}
    if not isinstance(body, dict):
        return 400, {"error_code": "BAD_REQUEST", "message": "expected a JSON object"}
    if "messages" in body:
        constraints = [k for k in ("response_format", *GUIDED_DECODING) if body.get(k) is not None]
        if len(constraints) > 1:  # as vLLM and SGLang answer it
            message = f"You can only use one kind of guided decoding but multiple are specified: {constraints}"
            return 400, {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}
        refused = _refusal(emulator.behaviour["serving"], body)
        if refused is not None:
            return refused
        return 200, _chat_completion(emulator, body, fault)
    if "inputs" in body:  # the custom batch-grading endpoint of reference flow 1
        params = body.get("params") or {}
        system = params.get("system_prompt", "")
        outputs = [_model_reply(emulator, system, item.get("prompt", ""), fault) for item in body["inputs"]]
        return 200, {"predictions": [{"output": o} for o in outputs]}
    return 400, {"error_code": "BAD_REQUEST", "message": "expected messages or inputs"}
