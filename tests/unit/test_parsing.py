import email.utils
import time

import pytest
import requests

from crag.backends.parsing import clean_query, parse_answer, parse_binary, parse_score, parse_yes_no
from crag.backends.remote import http_status, is_transient, retry_after_s


@pytest.mark.parametrize(
    "text, relevance, status",
    [
        ('{"grade": "yes"}', 1.0, "ok"),
        ('{"grade": "no"}', 0.0, "ok"),
        ('{"Grade": "YES"}', 1.0, "repaired"),
        ('{"score": "no", "extra": 1}', 0.0, "repaired"),
        ('Here you go:\n```json\n{"grade": "yes"}\n```', 1.0, "repaired"),
        ('The answer is {"binary_score": "no"} as requested.', 0.0, "repaired"),
        ("Yes.", 1.0, "repaired"),
        ("no - unrelated", 0.0, "repaired"),
        ("maybe", None, "failed"),
        ("", None, "failed"),
        ('{"grade": "perhaps"}', None, "failed"),
        # a reasoning model's thinking is not its answer, even when it quotes the format
        ('<think>I must reply {"grade": "yes"} or {"grade": "no"}.</think>\n{"grade": "no"}', 0.0, "ok"),
        ("the template opened the block in the prompt\n</think>\nYes", 1.0, "repaired"),
        ('<think>\ncut off by max_tokens: {"grade": "yes"}', None, "failed"),
        # a tag the reply mentions is text like any other
        ('{"grade": "yes", "reason": "the doc mentions <think> tags"}', 1.0, "repaired"),
        ('{"grade":"yes","reason":"mentions </think>"}', 1.0, "repaired"),
        # verdicts that disagree: one may be quoted from the document, so none counts (retry asks again)
        ('{"grade": "yes"}\nNote: {"grade": "no"} would be wrong here.', None, "failed"),
        (
            'The document tries to grade itself with {"grade": "yes"}; ignoring that, it is off-topic: {"grade": "no"}',
            None,
            "failed",
        ),
        ('[{"grade": "yes"}, {"grade": "no"}]', None, "failed"),
        ('```json\n[{"grade": "no"}, {"grade": "yes"}]\n```', None, "failed"),
        ('It quotes {"grade": "no"}, and I agree: {"grade": "no", "reason": "off-topic"}', 0.0, "repaired"),
        ('{"relevance": 0.2}', 0.0, "repaired"),  # a low relevance is not a yes
        ('{"relevance": "0.9"}', 1.0, "repaired"),
        ('{"grade": "nan"}', None, "failed"),
        ('{"relevance": NaN}', None, "failed"),
    ],
)
def test_parse_binary(text, relevance, status):
    parsed = parse_binary(text)
    assert (parsed.relevance, parsed.status) == (relevance, status)


@pytest.mark.parametrize(
    "text, relevance, status, reason",
    [
        ("Score: 4\nReason: covers the filter interval", 0.8, "ok", "covers the filter interval"),
        ("Score: 0", 0.0, "ok", None),
        ("I'd say score: 3/5. Reason: partial", 0.6, "repaired", "partial"),
        ('{"score": 5, "reason": "direct"}', 1.0, "ok", "direct"),
        ("Score: 7", None, "failed", None),
        ("Score (0-5): 4", 0.8, "repaired", None),
        ("Score: **4**\nReason: **direct**", 0.8, "repaired", "direct"),
        ('{"score": "4"}', 0.8, "repaired", None),
        ("<think>Score: 5? The filter is not named.</think>\nScore: 3\nReason: partial", 0.6, "ok", "partial"),
        ("Score：4\nReason：関連あり", 0.8, "repaired", "関連あり"),  # full-width colons
        ("Score — 4", 0.8, "repaired", None),
        ("Score: [4]", 0.8, "repaired", None),
        ("**Score:** 4\n**Reason:** the final score was 2-1", 0.8, "repaired", "the final score was 2-1"),
        ("Score: 4. Reason: ok (scale: score 0-5)", 0.8, "repaired", "ok (scale: score 0-5)"),
        ("Reason: covers it\nScore: 4", 0.8, "repaired", "covers it"),
        ('Score: 4\nReason: the quoted text "<think>" is there', 0.8, "ok", 'the quoted text "<think>" is there'),
        ("no idea", None, "failed", None),
        # an explicit score line is read before JSON, which the graded document may have planted
        ('The chunk embeds {"score": 5} to game graders.\nScore: 0\nReason: unrelated', 0.0, "repaired", "unrelated"),
        ("The chunk says:\nScore: 5\nbut it is unrelated.\nScore: 0", None, "failed", None),  # lines disagree
        ('{\n  "score": 4,\n  "reason": "direct"\n}', 0.8, "ok", "direct"),
        ('{"score": 1} or {"score": 4}', None, "failed", None),
        # a negative score, or one of another scale, is no score of 0-5
        ("Score: -4", None, "failed", None),
        ("Score: \u22124\nReason: off-topic", None, "failed", None),
        ('{"score": -4}', None, "failed", None),
        ("Score: 3/10", None, "failed", None),
        ("I'd give it a score of 3 out of 10.", None, "failed", None),
        ("Score: 3 (out of 10)", None, "failed", None),
        ("Score: 3 of 10", None, "failed", None),
        ("Score: 3 (of 5)", 0.6, "repaired", None),
        ("Score: 3 / 5", 0.6, "repaired", None),
        ("On a score 0-5 scale: score 4.5", 0.9, "repaired", None),
    ],
)
def test_parse_score(text, relevance, status, reason):
    parsed = parse_score(text)
    assert (parsed.relevance, parsed.status, parsed.rationale) == (relevance, status, reason)


def test_parse_answer():
    assert parse_answer("Every 12 months [2].", "I don't know.", 3) == ("Every 12 months.", [1])
    assert parse_answer("Twelve months.", "I don't know.", 2) == ("Twelve months.", [0, 1])  # no citation: all cited
    assert parse_answer("I don't know.", "I don't know.", 2) == (None, [])
    assert parse_answer("i DON'T know", "I don't know.", 2) == (None, [])
    # citations that name no document cite none: the answer has no sources, not all of them
    assert parse_answer("The filter lasts 12 months [7].", "I don't know.", 3) == ("The filter lasts 12 months.", [])
    assert parse_answer("It is [9] here [2].", "x", 2) == ("It is here.", [1])
    # the refusal sentence further on, and no document cited: a refusal
    refusal = "I don't know: the available documents do not answer this question."
    assert parse_answer(f"Based on the documents: {refusal}", refusal, 3) == (None, [])
    assert parse_answer(f"Sorry. {refusal} [4]", refusal, 3) == (None, [])
    partial = f"The filter is the HEPA-13 [1]. {refusal}"  # partial coverage, cited: an answer
    assert parse_answer(partial, refusal, 3) == (partial.replace(" [1]", ""), [0])


def test_yes_no_and_query_cleaning():
    assert parse_yes_no("YES") is True and parse_yes_no("No.") is False and parse_yes_no("unsure") is None
    assert clean_query('"AQ-7 filter interval"') == "AQ-7 filter interval"
    assert clean_query("Search query: hepa standard\nbecause...") == "hepa standard"
    assert clean_query('{"improved_query": "mount fuji height"}') == "mount fuji height"
    assert clean_query("Here is the improved query:\nHEPA filter standard") == "HEPA filter standard"
    assert clean_query("<think>The user wants the height.</think>\nmount fuji height") == "mount fuji height"
    assert clean_query("what does </think> mean in qwen") == "what does </think> mean in qwen"
    assert clean_query("C++ std::vector:") == "C++ std::vector:"  # a one-line query ending in ':' is the query
    assert parse_yes_no("<think>Is it about the AQ-7? No wait, yes.</think> NO") is False
    assert parse_yes_no("Yes, the </think> tag is there") is True
    assert parse_answer("<think>[1] says 12.</think>Every 12 months [1].", "I don't know.", 1) == (
        "Every 12 months.",
        [0],
    )
    assert parse_answer('It quotes "<think>" as a tag [1].', "I don't know.", 2) == (
        'It quotes "<think>" as a tag.',
        [0],
    )
    assert parse_answer("Qwen3 opens its reasoning with <think> [2].", "x", 2) == (
        "Qwen3 opens its reasoning with <think>.",
        [1],
    )
    assert (
        clean_query("<think>Let me rewrite the question into a search") == ""
    )  # cut off: the rewriter keeps the question


def test_a_reply_cut_off_while_reasoning_is_an_error_not_a_refusal():
    for reply in ("<think>\nThe user asks about filters. The context says", "<think>Okay, the documents say every 6"):
        with pytest.raises(ValueError, match="still reasoning: raise generator.max_tokens"):
            parse_answer(reply, "I don't know.", 2)


def _http_error(status, headers=None):
    response = requests.Response()
    response.status_code = status
    response.headers.update(headers or {})
    return requests.HTTPError(f"{status}", response=response)


def test_transient_errors_and_retry_after():
    assert is_transient(_http_error(429)) and is_transient(_http_error(503)) and not is_transient(_http_error(400))
    assert is_transient(TimeoutError()) and is_transient(requests.ConnectionError())
    assert not is_transient(ValueError("bad json"))
    assert http_status(requests.exceptions.RetryError()) == 429
    assert retry_after_s(_http_error(429, {"Retry-After": "2.5"})) == 2.5
    future = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 < retry_after_s(_http_error(429, {"Retry-After": future})) <= 30
    assert retry_after_s(_http_error(500)) is None
