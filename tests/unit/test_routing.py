import pytest

from crag.config import RoutingConfig
from crag.stages import route_question


def docs(*grades_and_scores):
    return [
        {"parent_id": f"p{i}", "text": "x" * 60, "grade": g, "relevance": r, "source": "internal"}
        for i, (g, r) in enumerate(grades_and_scores)
    ]


ALL = docs(("yes", 0.9), ("yes", 0.8))
SOME = docs(("yes", 0.9), ("no", 0.1), ("no", 0.2))
NONE = docs(("no", 0.1), ("no", 0.2))
MIDDLE = docs(("no", 0.45), ("no", 0.2))


@pytest.mark.parametrize(
    "policy, graded, action, needs_web, use_internal",
    [
        ("any_irrelevant", ALL, "correct", False, True),
        ("any_irrelevant", SOME, "ambiguous", True, True),
        ("any_irrelevant", NONE, "incorrect", True, True),
        ("any_irrelevant", [], "incorrect", True, False),  # nothing retrieved: no internal document to use
        ("all_irrelevant", SOME, "correct", False, True),
        ("all_irrelevant", NONE, "incorrect", True, True),
        ("thresholds", SOME, "correct", False, True),
        ("thresholds", MIDDLE, "ambiguous", True, True),
        ("thresholds", NONE, "incorrect", True, False),
        ("thresholds", [], "incorrect", True, False),
    ],
)
def test_policies(policy, graded, action, needs_web, use_internal):
    got = route_question(graded, RoutingConfig(policy=policy, upper=0.6, lower=0.3))
    assert (got.action, got.needs_web, got.use_internal) == (action, needs_web, use_internal)
    assert policy in got.reason


def test_min_context_chars_counts_relevant_characters():
    short = route_question(SOME, RoutingConfig(policy="min_context_chars", min_context_chars=100))
    long = route_question(ALL, RoutingConfig(policy="min_context_chars", min_context_chars=100))
    none = route_question(NONE, RoutingConfig(policy="min_context_chars", min_context_chars=100))
    assert (short.action, short.needs_web) == ("ambiguous", True) and "60 chars < 100" in short.reason
    assert (long.action, long.needs_web) == ("correct", False) and "120 chars >= 100" in long.reason
    assert (none.action, none.needs_web) == ("incorrect", True)


def test_relevant_documents_keep_rank_order_and_are_capped():
    graded = docs(*[("yes", 0.9)] * 8)
    relevant = route_question(graded, RoutingConfig(max_relevant_docs=5)).relevant
    assert [d["parent_id"] for d in relevant] == ["p0", "p1", "p2", "p3", "p4"]


def test_thresholds_policy_uses_the_documents_above_upper_even_if_graded_no():
    # the grader's yes/no threshold (say 0.6) above routing.upper (0.5): the 0.55 document made the
    # action correct, so it is the context rather than a refusal
    graded = docs(("no", 0.55), ("no", 0.2), ("yes", 0.7))
    route = route_question(graded, RoutingConfig(policy="thresholds", upper=0.5, lower=0.5))
    assert (route.action, route.needs_web, route.use_internal) == ("correct", False, True)
    assert [d["parent_id"] for d in route.relevant] == ["p0", "p2"]


def test_nothing_retrieved_goes_to_the_web():
    assert route_question([], RoutingConfig()).reason == "nothing retrieved; policy any_irrelevant: web search"
    # under every policy and any threshold: at the lowest settings, no document would still be "enough"
    for routing in (
        RoutingConfig(policy="min_context_chars", min_context_chars=0),
        RoutingConfig(policy="thresholds", upper=0, lower=0),
        RoutingConfig(policy="all_irrelevant"),
    ):
        route = route_question([], routing)
        assert (route.action, route.needs_web) == ("incorrect", True), routing.policy


def test_with_no_relevant_document_the_min_context_chars_policy_searches_the_web_at_any_length():
    route = route_question(NONE, RoutingConfig(policy="min_context_chars", min_context_chars=0))
    assert (route.action, route.needs_web) == ("incorrect", True)
    assert route.reason.endswith("none relevant -> web search")


def test_reason_is_readable():
    reason = route_question(SOME, RoutingConfig()).reason
    assert reason == "1 of 3 documents relevant; policy any_irrelevant: 2 irrelevant -> web search"


def test_the_last_resort_is_the_best_internal_document_of_a_route_without_one():
    graded = docs(("no", 0.35), ("no", 0.42))
    cfg = RoutingConfig(policy="thresholds", upper=0.5, lower=0.5, last_resort=0.4)
    route = route_question(graded, cfg)
    assert route.action == "incorrect" and [d["parent_id"] for d in route.last_resort] == ["p1"]
    assert route_question(graded, cfg.model_copy(update={"last_resort": 0.43})).last_resort == []
    assert route_question(graded, cfg.model_copy(update={"last_resort": None})).last_resort == []
    # a route that reads relevant internal documents needs none
    assert route_question(SOME, RoutingConfig(policy="thresholds", last_resort=0.0)).last_resort == []
    # any_irrelevant keeps use_internal with nothing relevant: the last resort is still set
    assert [d["parent_id"] for d in route_question(NONE, RoutingConfig(last_resort=0.15)).last_resort] == ["p1"]
