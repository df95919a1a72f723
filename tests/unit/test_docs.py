"""The documentation matches the code: the tables page is generated from crag.schema, every docs page is
reachable from the README, links resolve, and the examples run as written: config snippets load with
crag's config loader, crag commands parse with crag's own parser (their configs, variants and --set
values load too), and the LangChain factory example retrieves from the bundled sample."""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import sys
import textwrap
import types
from pathlib import Path

import pytest
import yaml

from crag import schema
from crag.cli import parser
from crag.config import load_config
from tests.support import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^( *)```([^\n]*)\n(.*?)^\1```[ \t]*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def blocks(kind: str) -> list[tuple[str, str]]:
    """Every fenced block whose info string is `kind`, as (where, text), from the README and docs/."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            if match[2].strip() == kind:
                line = text.count("\n", 0, match.start()) + 1
                found.append((f"{page.relative_to(REPO)}:{line}", textwrap.dedent(match[3])))
    return found


def commands(block: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments and a trailing `&` dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    found = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[-1] == "&":
            words = words[:-1]
        if words:
            found.append(words)
    return found


def test_the_tables_page_is_generated_from_crag_schema():
    assert (DOCS / "tables.md").read_text(encoding="utf-8") == schema.tables_markdown(), (
        "docs/tables.md is stale: run `.venv/bin/python -m crag.schema > docs/tables.md`"
    )


def test_the_tables_page_covers_every_table_and_column():
    page = schema.tables_markdown()
    for name, columns in schema.TABLES.items():
        kind = "view" if name in schema.VIEWS else "stored"
        assert f"### {name} ({kind})" in page
        for column in columns.names:
            assert schema.meaning(name, column)
    with pytest.raises(KeyError, match="no meaning"):
        schema.meaning("answers", "a_column_nobody_described")


def test_every_docs_page_is_linked_from_the_readme():
    readme = README.read_text(encoding="utf-8")
    targets = set(LINK.findall(readme))
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if f"docs/{p.name}" not in targets]
    assert not unlinked, f"README.md links no docs/ page named {unlinked}"
    assert "docs/measurements/" in targets, "README.md links no docs/measurements/"


def test_the_readme_is_at_most_300_lines():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md is {lines} lines: move detail to a docs/ page"


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken


@pytest.fixture(scope="module")
def conf_copy(tmp_path_factory) -> Path:
    """A copy of conf/, so that a snippet's prompt paths resolve as they would next to conf/local.yaml."""
    conf = tmp_path_factory.mktemp("docs") / "conf"
    shutil.copytree(REPO / "conf", conf)
    return conf


@pytest.mark.parametrize(("where", "text"), blocks("yaml"), ids=[w for w, _ in blocks("yaml")])
def test_config_snippets_load(where, text, conf_copy):
    snippet = conf_copy / "snippet.yaml"
    snippet.write_text(text, encoding="utf-8")
    load_config(snippet)  # a ConfigError names the key that is wrong


@pytest.mark.parametrize(("where", "text"), blocks("yaml bundle"), ids=[w for w, _ in blocks("yaml bundle")])
def test_bundle_snippets_are_yaml(where, text):
    assert isinstance(yaml.safe_load(text), dict)


def _check_crag_command(words: list[str]) -> None:
    args = parser().parse_args(words[1:])  # a usage error exits 2
    for name in ("questions", "docs"):
        path = getattr(args, name, None)
        if path and not path.startswith(".crag/") and "/" in path:
            assert (REPO / path).exists(), path
    conf = getattr(args, "conf", None)
    if conf and (REPO / conf).is_file():
        load_config(REPO / conf, [*args.overrides], getattr(args, "variant", None))


def _check_shell_command(words: list[str]) -> None:
    program = words[0]
    if program in (".venv/bin/crag", "crag"):
        _check_crag_command(words)
    elif program == ".venv/bin/python" and words[1] == "-m":
        assert importlib.util.find_spec(words[2]) is not None, words[2]
    elif program == "make":
        makefile = (REPO / "Makefile").read_text(encoding="utf-8")
        for target in words[1:]:
            assert re.search(rf"^{re.escape(target)}:", makefile, re.MULTILINE), f"no make target {target}"


@pytest.mark.parametrize(("where", "text"), blocks("bash"), ids=[w for w, _ in blocks("bash")])
def test_shell_examples_are_commands_crag_takes(where, text, monkeypatch):
    monkeypatch.chdir(REPO)
    for words in commands(text):
        _check_shell_command(words)


@pytest.mark.parametrize(("where", "text"), blocks("python"), ids=[w for w, _ in blocks("python")])
def test_python_examples_compile(where, text):
    compile(text, where, "exec")


def test_the_langchain_factory_example_retrieves_from_the_sample(monkeypatch, conf_copy):
    pytest.importorskip("rank_bm25")
    from crag.backends.langchain_retriever import LangChainRetriever

    # docs/backends.md's factory (BM25 over the sample's web pages); docs/backends-retrieval.md's (dense,
    # with crag's packaged encoder) is run by tests/slow/test_langchain_docs_example.py
    page = "docs/backends.md:"
    [(where, code)] = [
        (w, t) for w, t in blocks("python") if t.startswith("# my_project/stores.py") and w.startswith(page)
    ]
    [config] = [t for w, t in blocks("yaml") if "my_project.stores:" in t and w.startswith(page)]
    package, module = types.ModuleType("my_project"), types.ModuleType("my_project.stores")
    exec(compile(code, where, "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "my_project", package)
    monkeypatch.setitem(sys.modules, "my_project.stores", module)
    monkeypatch.chdir(REPO)
    snippet = conf_copy / "langchain.yaml"
    snippet.write_text(config, encoding="utf-8")
    cfg = load_config(snippet)
    [found] = LangChainRetriever(cfg.retriever).search(["What does HEPA stand for?"], cfg.retriever.k)
    assert found[0]["doc_id"] == "web-hepa" and found[0]["title"] == "HEPA filter"
