"""The grader, rewriter, generator and web-source check played by a chat model (any ChatModel).

Untrusted text (the question, documents, web results) enters a prompt only inside its tags, with any
closing tag inside it defused, so that it cannot end its block early and pose as instructions;
documents and web results are also truncated to `max_doc_chars`.
"""

from __future__ import annotations

import html
import re
import string
import unicodedata

import yaml

from crag.backends.base import Answer, ChatModel, Document, Grade, Usage
from crag.backends.parsing import clean_query, parse_answer, parse_binary, parse_score, parse_yes_no
from crag.backends.structured import object_schema
from crag.config import (
    LLMConfig,
    LLMGeneratorConfig,
    LLMGraderConfig,
    LLMRewriterConfig,
    SourceCheckConfig,
    safe_yaml,
    stable_hash,
    yaml_problem,
)
from crag.errors import ConfigError
from crag.text import invisible

GRADE_SCHEMA = object_schema("relevance_grade", grade={"type": "string", "enum": ["yes", "no"]})
GRADE_REGEX = r'\{"grade": "(yes|no)"\}'
# The score format under structured output: the score and the reason as JSON, in place of the two
# lines the prompt asks for (crag.backends.parsing.parse_score reads both)
SCORE_SCHEMA = object_schema(
    "relevance_score",
    score={"type": "integer", "minimum": 0, "maximum": 5},
    reason={"type": "string", "maxLength": 200},
)
# The source check's YES or NO
VERDICT_SCHEMA = object_schema("source_verdict", verdict={"type": "string", "enum": ["YES", "NO"]})


# The $placeholders each role fills: (those its prompt must use, those it may use)
PLACEHOLDERS = {
    "grader": (("question", "document"), ()),
    "rewriter": (("question",), ()),
    "generator": (("question", "context"), ("refusal", "language_line")),
    "web_search.verify": (("web_result",), ("question", "subject")),
}


class Prompt:
    """A system/user template pair with $placeholders, from a YAML prompt file: those of `role`
    (PLACEHOLDERS), every required one used and no other, so that a prompt that would send the model
    a literal "$document", or no document at all, is one line before any call."""

    def __init__(self, text: str, origin: str, role: str):
        try:
            data = safe_yaml(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"prompt {origin} is not valid YAML: {yaml_problem(exc)}") from None
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("system"), str)
            or not isinstance(data.get("user"), str)
        ):
            raise ConfigError(f"prompt {origin} must have string keys 'system' and 'user'")
        self.system = string.Template(data["system"])
        self.user = string.Template(data["user"])
        self.hash = stable_hash(text)
        required, optional = PLACEHOLDERS[role]
        used = {*self.system.get_identifiers(), *self.user.get_identifiers()}
        fills = ", ".join(f"${name}" for name in (*required, *optional))
        for template in (self.system, self.user):
            for match in template.pattern.finditer(template.template):
                if match["invalid"] is not None and template.template.startswith("${", match.start()):
                    # "${ document }" or "${document": it would reach the model as text
                    near = template.template[match.start() : match.start() + 20].split("\n")[0]
                    raise ConfigError(
                        f"prompt {origin} has a malformed placeholder at {near!r}: write ${{name}} or $name"
                    )
        if unknown := sorted(used - {*required, *optional}):
            raise ConfigError(
                f"prompt {origin} uses {', '.join('$' + n for n in unknown)}, which the {role} does not fill "
                f"(it fills {fills}; write $$ for a dollar sign)"
            )
        if missing := [name for name in required if name not in used]:
            raise ConfigError(f"prompt {origin} lacks {', '.join('$' + n for n in missing)}: the {role} fills {fills}")

    def messages(self, **values: str) -> list[dict]:
        return [
            {"role": "system", "content": self.system.safe_substitute(values).strip()},
            {"role": "user", "content": self.user.safe_substitute(values).strip()},
        ]


# The characters NFKC folds into "<", and into a text that starts with "/" (tests/unit/
# test_hardening_prompts.py checks every code point): the ways a closing tag can begin as a model reads
# it, or an NFKC-normalising tokenizer turns it into.
LESS_THAN_FORMS = "<\ufe64\uff1c"  # <, small form ﹤, fullwidth ＜
SLASH_FORMS = "/\uff0f"  # /, fullwidth ／
_LESS_THAN = re.compile(f"[{LESS_THAN_FORMS}]")


def defused(text: str) -> str:
    """Untrusted text made safe to place inside a delimited block: it holds no closing tag, of any name
    in any spelling, so that an injected "</question>" cannot end the question block. Every less-than
    sign whose next visible character is a slash, in any of their forms ("＜／"), is written "< /",
    whatever stands between them that shows nothing ("<\\u200b/", "<\\x00/"). The tag's name is not
    read: a look-alike letter ("</dоcument>" with a Cyrillic о) changes nothing. Other text is left as
    it is ("a < b", and "x</y" reads "x< /y")."""
    out, last = [], 0
    for less_than in _LESS_THAN.finditer(text):
        slash = _next_shown(text, less_than.end())
        if slash < len(text) and text[slash] in SLASH_FORMS:
            out += [text[last : less_than.start()], "< /"]
            last = slash + 1
    return "".join(out) + text[last:]


def _next_shown(text: str, start: int) -> int:
    """The position of the first character from `start` on that shows something (len(text): none does)."""
    while start < len(text) and _shows_nothing(text[start]):
        start += 1
    return start


def _shows_nothing(char: str) -> bool:
    """Control, format and unassigned characters, marks and blank letters, which a reader or a tokenizer
    may drop, and spaces: whatever stood between "<" and "/", defused text has exactly one space there."""
    return unicodedata.category(char)[0] in "CZ" or invisible(char)


TRUNCATED = " [truncated]"


def fenced(text: str, max_chars: int, max_bytes: int | None = None) -> str:
    """A document made safe to place inside a delimited block: cut to `max_chars` characters and, for
    the token budget, `max_bytes` UTF-8 bytes (the mark of the cut included), and defused."""
    cut = text[:max_chars]
    if max_bytes is not None and len(cut.encode("utf-8")) > max_bytes:
        cut = cut.encode("utf-8")[: max(0, max_bytes - len(TRUNCATED))].decode("utf-8", "ignore")
    return defused(text if cut == text else cut + TRUNCATED)


MAX_TITLE_CHARS = 200  # a label, not a second text: longer than any real title


def _title_attribute(doc: Document) -> str:
    """A document's title made safe for its tag's attribute: on one line, cut to MAX_TITLE_CHARS, and
    defused before it is escaped (html.escape leaves a fullwidth "＜／context＞" as it is)."""
    title = " ".join(str(doc.get("title") or "").split())[:MAX_TITLE_CHARS]
    return html.escape(defused(title), quote=True)


def render_context(context: list[Document], max_chars: int, max_bytes: int | None = None) -> str:
    blocks = []
    for i, doc in enumerate(context, 1):
        blocks.append(
            f'<document index="{i}" source="{doc["source"]}" title="{_title_attribute(doc)}">\n'
            f"{fenced(doc['text'], max_chars, max_bytes)}\n</document>"
        )
    return "\n".join(blocks)


# What a chat template adds around each message, in tokens (role markers, separators): about, and
# on the high side.
MESSAGE_TOKENS = 8
# Fewer tokens than this per document would leave no document worth reading.
MIN_DOCUMENT_TOKENS = 16


class PromptTooLong(ValueError):
    """A prompt that cannot fit the server's context window however its documents are cut."""


class _Role:
    def __init__(self, model: ChatModel, cfg: LLMConfig, role: str):
        self.model, self.cfg = model, cfg
        self.role = role
        self.prompt = Prompt(cfg.prompt_text or "", f"{role}.prompt ({cfg.prompt})", role)
        self.name = model.name
        self.concurrency = model.concurrency

    def _chat(self, messages, usage, **extra) -> str:
        return self.model.chat(
            messages, usage, max_tokens=self.cfg.max_tokens, temperature=self.cfg.temperature, **extra
        )

    def _structured(self, schema: dict) -> dict:
        """The chat arguments that keep a reply to `schema`, in the role's structured-output mode."""
        mode = getattr(self.cfg, "structured_output", "none")
        return {} if mode == "none" else {"json_schema": schema, "structured": mode}

    def _document_bytes(self, fixed: list[dict], documents: int) -> int | None:
        """The UTF-8 bytes each of `documents` documents may take in a prompt whose other text is
        `fixed`, for the prompt and max_tokens to fit the context window (None: no window known).
        Tokens are counted as bytes / bytes_per_token: the server's tokenizer is not at hand."""
        window = self.cfg.context_tokens or self.model.context_window()
        if window is None or documents == 0:
            return None
        per_token = self.cfg.bytes_per_token
        fixed_tokens = sum(len(m["content"].encode("utf-8")) for m in fixed) / per_token + MESSAGE_TOKENS * len(fixed)
        free = window - self.cfg.max_tokens - fixed_tokens
        if free < documents * MIN_DOCUMENT_TOKENS:
            raise PromptTooLong(
                f"the {self.role} prompt takes about {fixed_tokens + self.cfg.max_tokens:.0f} tokens with "
                f"{self.role}.max_tokens before its {documents} document(s), over the {window}-token context "
                f"window: shorten the prompt or lower max_tokens (context_tokens {self.cfg.context_tokens or 'from the server'})"
            )
        return int(free * per_token / documents)


class LLMGrader(_Role):
    def __init__(self, model: ChatModel, cfg: LLMGraderConfig):
        super().__init__(model, cfg, "grader")
        self.cfg: LLMGraderConfig = cfg
        self.prompt_hash = self.prompt.hash
        if cfg.batch and not hasattr(model, "batch"):
            raise ConfigError("grader.batch needs the databricks backend (a batch-inference serving endpoint)")
        if cfg.batch and (
            "document" in self.prompt.system.get_identifiers() or "question" in self.prompt.user.get_identifiers()
        ):
            # the batch endpoint takes the system part once, filled with the question, and one user part per document
            raise ConfigError(
                f"prompt grader.prompt ({cfg.prompt}): with grader.batch, $question goes in its system part and "
                "$document in its user part"
            )

    def _parse(self, output: str) -> Grade:
        parsed = (parse_score if self.cfg.format == "score" else parse_binary)(output)
        if parsed.relevance is None:
            return Grade(0.0, "no", "failed", parsed.rationale, output)
        relevance = round(parsed.relevance, 4)
        yes = relevance >= self.cfg.threshold if self.cfg.format == "score" else relevance >= 0.5
        return Grade(relevance, "yes" if yes else "no", parsed.status, parsed.rationale, output)

    def _chat_extra(self) -> dict:
        if self.cfg.guided_regex and self.cfg.format == "binary":
            return {"regex": GRADE_REGEX}  # alone: the config allows no structured_output beside it
        return self._structured(GRADE_SCHEMA if self.cfg.format == "binary" else SCORE_SCHEMA)

    def _texts(self, question: str, documents: list[Document]) -> list[str]:
        """The documents as the prompt holds them: cut to max_doc_chars, and to the token budget."""
        budget = self._document_bytes(self.prompt.messages(question=question, document=""), 1) if documents else None
        return [
            fenced(f"{d.get('title') or ''}\n{d['text']}".strip(), self.cfg.max_doc_chars, budget) for d in documents
        ]

    def _grade_all(self, question: str, documents: list[Document], usage: Usage) -> list[str]:
        question = defused(question)
        texts = self._texts(question, documents)
        if self.cfg.batch:
            [system, _] = self.prompt.messages(question=question)
            prompts = [self.prompt.user.safe_substitute(document=t).strip() for t in texts]
            structured = self.cfg.format == "binary" and self.cfg.structured_output != "none"
            return self.model.batch(  # type: ignore[attr-defined]  # grader.batch is for Databricks serving, which has it
                system["content"],
                prompts,
                usage,
                max_tokens=self.cfg.max_tokens,
                temperature=self.cfg.temperature,
                json_schema=GRADE_SCHEMA if structured else None,
            )
        return [
            self._chat(self.prompt.messages(question=question, document=t), usage, **self._chat_extra()) for t in texts
        ]

    def grade(self, question: str, documents: list[Document], usage: Usage) -> list[Grade]:
        grades = [self._parse(o) for o in self._grade_all(question, documents, usage)]
        failed = [i for i, g in enumerate(grades) if g.parse_status == "failed"]
        if failed and self.cfg.on_parse_failure == "retry":
            again = self._grade_all(question, [documents[i] for i in failed], usage)
            for i, output in zip(failed, again):
                grades[i] = self._parse(output)
        return grades


class LLMRewriter(_Role):
    def __init__(self, model: ChatModel, cfg: LLMRewriterConfig):
        super().__init__(model, cfg, "rewriter")
        self.cfg: LLMRewriterConfig = cfg
        self.policy_keywords = cfg.policy_keywords

    def rewrite(self, question: str, usage: Usage) -> str:
        reply = self._chat(
            self.prompt.messages(question=defused(question)), usage, **self._structured(query_schema(self.cfg))
        )
        query = cut_at_word(clean_query(reply) or question.strip(), self.cfg.max_query_chars)
        extra = [k for k in self.policy_keywords if k.lower() not in query.lower()]
        return " ".join([query, *extra])


def query_schema(cfg: LLMRewriterConfig) -> dict:
    return object_schema("web_query", query={"type": "string", "minLength": 1, "maxLength": cfg.max_query_chars})


def cut_at_word(text: str, max_chars: int) -> str:
    """`text` in at most `max_chars` characters, cut after a whole word where it has one."""
    if len(text) <= max_chars:
        return text
    cut = text[: max_chars + 1].rsplit(None, 1)[0] if " " in text[:max_chars] else text[:max_chars]
    return cut[:max_chars].rstrip()


class LLMGenerator(_Role):
    reads_relevance = False  # the prompt shows the documents, not their grades

    def __init__(self, model: ChatModel, cfg: LLMGeneratorConfig):
        super().__init__(model, cfg, "generator")
        self.cfg: LLMGeneratorConfig = cfg

    def generate(self, question: str, context: list[Document], usage: Usage) -> Answer:
        language = f"Reply in {self.cfg.reply_language}." if self.cfg.reply_language else ""

        def messages_with(max_chars: int, max_bytes: int | None = None) -> list[dict]:
            return self.prompt.messages(
                question=defused(question),
                context=render_context(context, max_chars, max_bytes),
                refusal=self.cfg.refusal_message,
                language_line=language,
            )

        # the documents' tags and the rest of the prompt are the fixed part of the token budget
        budget = self._document_bytes(messages_with(0), len(context)) if context else None
        messages = messages_with(self.cfg.max_doc_chars, budget)
        text, cited = parse_answer(self._chat(messages, usage), self.cfg.refusal_message, len(context))
        return Answer(text, cited)


class LLMSourceCheck(_Role):
    """Reference flow 3's web-source verification: YES keeps a web result, NO (or an unreadable reply)
    drops it."""

    def __init__(self, model: ChatModel, cfg: SourceCheckConfig):
        super().__init__(model, cfg, "web_search.verify")
        self.subject = cfg.subject or "the subject of the question"

    def verify(self, question: str, results: list[Document], usage: Usage) -> list[bool]:
        question = defused(question)
        fixed = self.prompt.messages(question=question, subject=self.subject, web_result="")
        budget = self._document_bytes(fixed, 1) if results else None
        verdicts = []
        for doc in results:
            text = fenced(f"{doc.get('title') or ''}\n{doc['text']}".strip(), self.cfg.max_doc_chars, budget)
            messages = self.prompt.messages(question=question, subject=self.subject, web_result=text)
            verdicts.append(parse_yes_no(self._chat(messages, usage, **self._structured(VERDICT_SCHEMA))) is True)
        return verdicts
