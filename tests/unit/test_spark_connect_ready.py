"""crag runs on Spark Connect (Databricks serverless), where a session has no SparkContext, RDDs or
JVM handle: none of them may appear anywhere in the package."""

import ast

import pytest

from tests.support import REPO

FORBIDDEN = {"sparkContext", "rdd", "_jvm", "_jsc", "_jsparkSession", "_jdf", "SparkContext"}


def _uses(path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if isinstance(node, (ast.ImportFrom, ast.Import)):
            found += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names if a.name in FORBIDDEN]
        elif name in FORBIDDEN:
            found.append(f"{path.name}:{node.lineno} uses {name}")
    return found


@pytest.mark.parametrize("path", sorted((REPO / "crag").rglob("*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_no_jvm_only_api(path):
    assert _uses(path) == []


def test_the_check_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(spark):\n    return spark.sparkContext.defaultParallelism, spark.range(1).rdd\n")
    assert len(_uses(bad)) == 2
