"""The crag compare HTML report, rendered from two small runs built here as pandas frames (no Spark),
checked as markup and then in a real browser: Debian's Chromium, headless, driven by Playwright.

The browser test looks at what a person would see: every section and chart on screen, the changed
answers with their gold verdicts (a new wrong answer in red, never green), each metric delta coloured
by its direction, Japanese text drawn by a font that has its glyphs (no tofu), and nothing wider than
the window. It skips when Chromium is absent; CI installs it (apt: chromium fonts-noto-cjk)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pandas as pd
import pytest

from crag.compare import compared, gold_verdict, metric_deltas, render_report, summary_lines
from crag.evaluation import METRIC_DIRECTIONS, QUESTION_METRICS, evaluate, is_cjk, question_scores
from tests.support import REPO, ReportMarkup

CHROMIUM = os.environ.get("CRAG_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
LONG_URL = "https://support.example.com/aq-7/manuals/" + "filter-replacement-schedule-" * 6 + "and-warranty.html"

# question_id: question, gold (answers, is_impossible, expected_route), base answer, candidate answer,
# base route, candidate route
QUESTIONS = {
    "q1": (
        "What is the clean air delivery rate of the AQ-7?",
        (["420 m3/h"], False, "internal"),
        "The clean air delivery rate (CADR) of the AQ-7 is 420 m3/h.",
        "The AQ-7 filters the air of a room quickly.",
        "mixed",
        "internal",
    ),
    "q2": (
        "Which Wi-Fi band does the AQ-7 connect to?",
        (["2.4 GHz"], False, "internal"),
        None,
        "The AQ-7 connects only to 2.4 GHz Wi-Fi networks; 5 GHz networks are not supported.",
        "refused",
        "internal",
    ),
    "q3": (
        "フィルターサインをリセットするにはフィルターボタンを何秒間長押ししますか？",
        (["5秒"], False, "internal"),
        "フィルターボタンを3秒間長押ししてください。",
        "フィルターボタンを5秒間長押ししてフィルターサインを消してください。",
        "internal",
        "internal",
    ),
    "q4": (
        "Where is the filter replacement schedule published?",
        (["support site"], False, "web"),
        "On the support site.",
        f"The support site has it: {LONG_URL}",
        "web",
        "mixed",
    ),
    "q5": (
        "What is the capital of Australia?",
        ([], True, "none"),
        None,
        "Sapporo is the capital of Hokkaido and the fifth largest city in Japan.",
        "refused",
        "web",
    ),
    "q6": (
        "How long is the AQ-7 warranty?",
        (["2 years"], False, "internal"),
        "The AQ-7 warranty lasts 2 years.",
        "The AQ-7 warranty lasts 2 years.",
        "web",
        "internal",
    ),
    "q7": (
        "What colour is the AQ-7 front panel?",
        None,
        "The front panel is white.",
        "The front panel is matte white.",
        "web",
        "internal",
    ),
}
REFUSAL = "I don't know: the available documents do not answer this question."


def _run(run_id: str, which: int) -> dict[str, pd.DataFrame]:
    """One run's answers, grades and gold frames, as crag.evaluation and crag.compare read them."""
    answers, grades, gold = [], [], []
    for qid, (question, g, *answer_pair, route_base, route_candidate) in QUESTIONS.items():
        answer = answer_pair[which]
        route = (route_base, route_candidate)[which]
        refused = answer is None
        web = route in ("web", "mixed")
        source = "web" if route == "web" else "internal"
        answers.append(
            {
                "run_id": run_id,
                "variant": run_id,
                "question_id": qid,
                "question": question,
                "answer": REFUSAL if refused else answer,
                "action": "incorrect" if web else "correct",
                "route": route,
                "refused": refused,
                "web_query": question if web else None,
                "n_web": 1 if web else 0,
                "n_relevant": 0 if refused else 1,
                "sources": []
                if refused
                else [{"source": source, "doc_id": f"{qid}-doc", "title": "AQ-7 manual", "url": None}],
            }
        )
        for rank, parent in enumerate(("p0", "p1")):
            # the candidate's lower threshold flips the second document of every other question to yes
            relevance = 0.35 if parent == "p1" else 0.8
            flipped = which == 1 and parent == "p1" and int(qid[1:]) % 2 == 1
            grades.append(
                {
                    "run_id": run_id,
                    "question_id": qid,
                    "rank": rank,
                    "source": "internal",
                    "doc_id": f"{qid}-doc",
                    "parent_id": f"{qid}-doc#{parent}",
                    "title": f"AQ-7 manual, section {parent}",
                    "url": None,
                    "relevance": relevance,
                    "grade": "yes" if parent == "p0" or flipped else "no",
                }
            )
        if g is not None:
            gold.append(
                {
                    "run_id": run_id,
                    "question_id": qid,
                    "answers": g[0],
                    "is_impossible": g[1],
                    "expected_route": g[2],
                    "gold_doc_ids": [f"{qid}-doc"],
                }
            )
    frames = {"answers": pd.DataFrame(answers), "grades": pd.DataFrame(grades), "gold": pd.DataFrame(gold)}
    frames["metrics"] = evaluate(frames["answers"], frames["grades"], frames["gold"]).assign(run_id=run_id)
    return frames


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    base, candidate = _run("base", 0), _run("cand", 1)
    _, figures = compared(base, candidate, "base", "cand")
    deltas = metric_deltas(base["metrics"], candidate["metrics"])
    path = tmp_path_factory.mktemp("report") / "compare.html"
    path.write_text(render_report(figures, deltas), encoding="utf-8")
    return path


def _changed() -> list[str]:
    return [qid for qid, (_, _, a, b, *_) in QUESTIONS.items() if a != b]


# ------------------------------------------------------------------ markup


def test_the_report_is_one_script_free_page_in_its_sections(report):
    page = report.read_text(encoding="utf-8")
    markup = ReportMarkup()
    markup.feed(page)
    assert markup.sections == ["summary", "metrics", "routes", "relevance", "changed", "flips"]
    assert "script" not in markup.tags and markup.external == [] and markup.inline_events == []
    assert markup.tags.count("svg") == 6
    # the metric table appears once: the summary does not repeat its rows
    assert len(re.findall(r"<td>web_search_rate</td>", page)) == 1 and "<pre>" not in page


def test_untrusted_text_is_escaped(tmp_path):
    """Questions and answers are data: markup in them is shown as text, not rendered."""
    base, candidate = _run("base", 0), _run("cand", 1)
    hostile = '<img src=x onerror="alert(1)"><script>alert(2)</script>'
    for run in (base, candidate):
        run["answers"].loc[run["answers"]["question_id"] == "q1", "question"] = hostile
    candidate["answers"].loc[candidate["answers"]["question_id"] == "q1", "answer"] = hostile
    _, figures = compared(base, candidate, 'base"><b>', "cand", with_gold=False)
    page = render_report(figures, metric_deltas(base["metrics"], candidate["metrics"]))
    markup = ReportMarkup()
    markup.feed(page)
    assert "script" not in markup.tags and "img" not in markup.tags and "b" not in markup.tags
    assert "&lt;script&gt;alert(2)&lt;/script&gt;" in page


def test_a_grade_flip_shows_the_relevance_as_stored():
    """Relevance is stored with 4 decimals and compared with the threshold as it is: a flip from
    0.4996 to 0.5004 across a threshold of 0.5 must not read 0.50 -> 0.50."""
    base, candidate = _run("base", 0), _run("cand", 1)
    for run, value in ((base, 0.4996), (candidate, 0.5004)):
        run["grades"].loc[run["grades"]["parent_id"] == "q1-doc#p1", "relevance"] = value
    _, figures = compared(base, candidate, "base", "cand", with_gold=False)
    page = render_report(figures, metric_deltas(base["metrics"], candidate["metrics"]))
    assert "0.4996 → 0.5004" in page


def test_every_metric_has_a_direction():
    """Colouring a delta needs its metric's direction: every metric crag eval computes has one."""
    base = _run("base", 0)
    assert set(base["metrics"]["metric"]) <= set(METRIC_DIRECTIONS)
    assert set(METRIC_DIRECTIONS) == set(QUESTION_METRICS) | {"grader_precision", "grader_recall"}


def test_gold_verdicts_of_each_case():
    base, candidate = _run("base", 0), _run("cand", 1)
    verdicts = {}
    for name, run in (("base", base), ("cand", candidate)):
        scores = question_scores(run["answers"], run["grades"], run["gold"]).set_index("question_id")
        verdicts[name] = {
            qid: gold_verdict(scores.loc[qid] if qid in scores.index else None)["verdict"] for qid in QUESTIONS
        }
    # a gold answer contained, dropped, refused, answered when it should refuse, and no gold at all
    assert (verdicts["base"]["q1"], verdicts["cand"]["q1"]) == ("correct", "wrong")
    assert (verdicts["base"]["q2"], verdicts["cand"]["q2"]) == ("wrong", "correct")
    assert (verdicts["base"]["q3"], verdicts["cand"]["q3"]) == ("wrong", "correct")
    assert (verdicts["base"]["q5"], verdicts["cand"]["q5"]) == ("correct", "wrong")
    assert verdicts["base"]["q7"] == verdicts["cand"]["q7"] == "no gold"


def test_the_summary_lines_keep_their_metric_rows():
    """The CLI's summary still lists every metric (the report shows them once, in its table)."""
    base, candidate = _run("base", 0), _run("cand", 1)
    _, figures = compared(base, candidate, "base", "cand", with_gold=False)
    lines = summary_lines(figures, metric_deltas(base["metrics"], candidate["metrics"]))
    assert lines[0].startswith("compare base (base) -> cand (candidate): 7 questions in both")
    assert any(line.strip().startswith("web_search_rate") for line in lines)


def test_the_wheel_ships_the_template_configs_and_prompts(tmp_path):
    """Built as the bundle builds its artifact (databricks.yml), the wheel carries the report template
    and every config, prompt and variant of conf/ (crag/conf is a symlink to it); unpacked away from
    any checkout, `--conf NAME` loads them."""
    source = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout; the symlink stays one
    shutil.copytree(REPO / "crag", source / "crag", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "conf", source / "conf")
    assert (source / "crag" / "conf").is_symlink()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(tmp_path / "dist"), str(source)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("crag-*.whl")
    shipped = zipfile.ZipFile(wheel)
    assert "crag/templates/compare_report.html.j2" in shipped.namelist()
    confs = [p for pattern in ("*.yaml", "prompts/*.yaml", "variants/*.yaml") for p in (REPO / "conf").glob(pattern)]
    assert len(confs) >= 10
    for path in confs:
        assert shipped.read(f"crag/conf/{path.relative_to(REPO / 'conf').as_posix()}") == path.read_bytes()

    unpacked, elsewhere = tmp_path / "unpacked", tmp_path / "elsewhere"
    shipped.extractall(unpacked)
    elsewhere.mkdir()
    probe = (
        "import crag, crag.config as c; cfg = c.load_config('databricks', variant='paper_thresholds'); "
        "print(crag.__file__, cfg.routing.policy, cfg.generator.prompt_text == open(c.PACKAGED_CONF / 'prompts' / "
        "'answer_concise.yaml', encoding='utf-8').read())"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(unpacked)},
    )
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.split() == [str(unpacked / "crag" / "__init__.py"), "thresholds", "True"]


# ------------------------------------------------------------------ in a real browser

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Chromium not found (apt-get install chromium fonts-noto-cjk, "
    "or set CRAG_CHROMIUM): the browser test of the report is skipped",
)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # Playwright starts the browser headless with a fresh temporary profile; these flags keep it
        # off the network and quiet.
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


def _open(browser, report: Path, width: int):
    page = browser.new_page(viewport={"width": width, "height": 900})
    page.goto(report.as_uri())
    page.evaluate("document.fonts.ready")
    return page


def _rgb(css: str) -> tuple[int, int, int]:
    return tuple(int(v) for v in re.findall(r"\d+", css)[:3])


def _on_top(page, selector: str) -> list[bool]:
    """For each element matched, whether the point at its centre shows that element (or a child):
    it is on screen and nothing covers it."""
    return page.eval_on_selector_all(
        selector,
        """els => els.map(el => {
        el.scrollIntoView({block: "center"});
        const r = el.getBoundingClientRect();
        const hit = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
        return r.width > 0 && r.height > 0 && hit !== null && (hit === el || el.contains(hit));
    })""",
    )


@needs_chromium
def test_a_person_sees_the_charts_and_the_changed_answers(browser, report, tmp_path):
    page = _open(browser, report, 1280)
    for section in ("summary", "metrics", "routes", "relevance", "changed", "flips"):
        assert page.locator(f"section#{section}").is_visible(), section
    # charts: six drawn, each with its bars on screen in its run's colour
    charts = page.locator("section svg")
    assert charts.count() == 6
    for i in range(charts.count()):
        box = charts.nth(i).bounding_box()
        assert box["width"] > 200 and box["height"] > 40
    bars = page.eval_on_selector_all(
        "svg rect.bar", "els => els.map(e => [e.getBoundingClientRect().width, getComputedStyle(e).fill])"
    )
    assert sum(1 for w, _ in bars if w > 0) >= 12 and len({fill for _, fill in bars}) == 2
    # the changed answers: one row each, on screen, with the diff's removed and added words
    rows = page.locator("tr.changed-answer")
    assert rows.count() == len(_changed())
    assert all(_on_top(page, "tr.changed-answer td.diff")) and all(_on_top(page, "tr.changed-answer td.verdict"))
    shown = page.locator("section#changed").inner_text()
    for qid in _changed():
        assert QUESTIONS[qid][0] in shown
    assert (
        page.locator("section#changed ins").first.is_visible()
        and page.locator("section#changed del").first.is_visible()
    )
    # a new wrong answer is red, a fixed one green; the diff itself is in neither colour
    for qid, expected in (("q1", "wrong"), ("q5", "wrong"), ("q2", "correct")):
        row = rows.filter(has_text=QUESTIONS[qid][0])
        badge = row.locator("td.verdict .badge").nth(1)
        assert badge.inner_text() == expected
        r, g, b = _rgb(badge.evaluate("e => getComputedStyle(e).backgroundColor"))
        assert (r > g) if expected == "wrong" else (g > r), (qid, r, g, b)
    for tag in ("ins", "del"):
        r, g, b = _rgb(
            page.locator(f"section#changed {tag}").first.evaluate("e => getComputedStyle(e).backgroundColor")
        )
        assert not (g > r + 20 and g > b + 20) and not (r > g + 20 and r > b + 20), (tag, r, g, b)
    # the grade flips are listed
    assert page.locator("tr.grade-flip").count() > 0 and all(_on_top(page, "tr.grade-flip"))
    screenshot = tmp_path / "report.png"
    page.screenshot(path=str(screenshot), full_page=True)
    assert screenshot.stat().st_size > 20_000
    page.close()


@needs_chromium
def test_each_metric_delta_is_coloured_by_its_direction(browser, report):
    """Green means the metric got better, whichever way that is: a lower web_search_rate is green."""
    page = _open(browser, report, 1280)
    cells = page.eval_on_selector_all(
        "section#metrics tbody tr",
        """rows => rows.map(r => {
        const c = r.querySelectorAll("td"), d = c[4].querySelector(".delta");
        return [c[0].innerText, c[1].innerText, d.innerText, getComputedStyle(d).color];
    })""",
    )
    seen = set()
    for metric, better_when, delta, color in cells:
        value = float(delta.split()[0])
        r, g, _ = _rgb(color)
        if METRIC_DIRECTIONS[metric] is None:  # the share of an action: neither better nor worse, so neither colour
            assert better_when == "–" and not (g > r + 40 or r > g + 40), (metric, delta, color)
            continue
        assert better_when == {1: "higher", -1: "lower"}[METRIC_DIRECTIONS[metric]]
        if value == 0:
            continue
        better = (value > 0) == (better_when == "higher")
        assert (g > r) if better else (r > g), (metric, delta, color)
        seen.add((metric, better))
    assert ("web_search_rate", True) in seen and any(not better for _, better in seen)
    assert {metric for metric, *_ in cells} <= set(QUESTION_METRICS) | {"grader_precision", "grader_recall"}
    page.close()


@needs_chromium
def test_japanese_text_is_drawn_with_a_font_that_has_its_glyphs(browser, report):
    """Tofu check: Chromium reports which fonts drew a node's text; the Japanese question must be drawn
    by fonts that fontconfig lists for Japanese, one glyph per CJK character."""
    japanese = set(
        subprocess.run(["fc-list", ":lang=ja", "family"], capture_output=True, text=True)
        .stdout.replace("\n", ",")
        .split(",")
    )
    japanese = {f.strip() for f in japanese if f.strip()}
    assert japanese, "no Japanese font installed (apt-get install fonts-noto-cjk)"
    page = _open(browser, report, 1280)
    question = QUESTIONS["q3"][0]
    cdp = page.context.new_cdp_session(page)
    cdp.send("DOM.enable")
    cdp.send("CSS.enable")
    root = cdp.send("DOM.getDocument", {"depth": -1})["root"]["nodeId"]
    (node,) = [
        n
        for n in cdp.send("DOM.querySelectorAll", {"nodeId": root, "selector": "td.question"})["nodeIds"]
        if question in cdp.send("DOM.getOuterHTML", {"nodeId": n})["outerHTML"]
    ]
    fonts = cdp.send("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]
    cjk_glyphs = sum(f["glyphCount"] for f in fonts if f["familyName"] in japanese)
    assert cjk_glyphs >= sum(1 for ch in question if is_cjk(ch)), fonts
    page.close()


@needs_chromium
@pytest.mark.parametrize("width", [1280, 720])
def test_nothing_overflows_horizontally(browser, report, width):
    """At a desktop and a narrow width: the page is no wider than the window, and no table cell's
    content (a long URL, Japanese without spaces) spills out of its cell."""
    page = _open(browser, report, width)
    assert page.evaluate("document.documentElement.scrollWidth") <= page.evaluate("window.innerWidth")
    spilling = page.eval_on_selector_all(
        "td, th, h1, dd",
        """els => els
        .filter(e => e.scrollWidth > e.clientWidth + 1 || e.getBoundingClientRect().right > window.innerWidth)
        .map(e => e.innerText.slice(0, 60))""",
    )
    assert spilling == []
    assert LONG_URL in page.locator("section#changed").inner_text()
    page.close()
