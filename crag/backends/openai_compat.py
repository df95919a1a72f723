"""Any OpenAI-compatible chat server through the `openai` client: vLLM, SGLang, Ollama, OpenAI, or
Databricks' /serving-endpoints. Structured output via response_format json_schema; for vLLM/SGLang a
guided-decoding regex can be sent as well (reference flow 2 forces {"score": "yes|no"} this way)."""

from __future__ import annotations

from crag.backends.base import Usage
from crag.backends.parsing import content_text
from crag.backends.remote import Endpoint, secret
from crag.config import LLMConfig


class OpenAICompatible:
    def __init__(
        self,
        cfg: LLMConfig,
        secrets: dict[str, str] | None = None,
        concurrent_tasks: int = 1,
        regex_key: str = "guided_regex",
    ):
        from openai import OpenAI  # noqa: PLC0415  # a heavy client: only this backend pays

        where = cfg.base_url or "api.openai.com"
        key = secret(
            cfg.api_key_env, cfg.api_key_secret, f"OpenAI-compatible model {cfg.endpoint!r} at {where}", secrets
        )
        # max_retries=0: crag's policy retries (and counts) instead of the client.
        self._client = OpenAI(api_key=key, base_url=cfg.base_url, max_retries=0, timeout=cfg.policy.timeout_s)
        self.model = cfg.endpoint
        self.regex_key = regex_key
        self.name = f"openai:{cfg.endpoint}"
        self._endpoint = Endpoint(self.name, cfg.policy, concurrent_tasks)
        self.concurrency = self._endpoint.concurrency

    def chat(self, messages, usage: Usage, *, max_tokens, temperature, json_schema=None, regex=None) -> str:
        kwargs: dict = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
        if json_schema is not None:
            kwargs["response_format"] = {"type": "json_schema", "json_schema": json_schema}
        if regex is not None:
            kwargs["extra_body"] = {self.regex_key: regex}
        reply = self._endpoint.call(lambda: self._client.chat.completions.create(**kwargs), usage)
        usage.llm_calls += 1
        if reply.usage is not None:
            usage.prompt_tokens += reply.usage.prompt_tokens or 0
            usage.completion_tokens += reply.usage.completion_tokens or 0
        if not reply.choices:
            raise ValueError("chat completion reply has no choices")
        return content_text(reply.choices[0].message.content)
