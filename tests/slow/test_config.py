"""A config nested far too deeply is one line, not a RecursionError: PyYAML's parser (pure Python)
recurses into the brackets until Python's recursion limit, which takes it about a second. (The other
hostile configs: tests/unit/test_config.py.)"""

import pytest

from crag.config import load_config
from crag.errors import ConfigError


def test_nesting_too_deep_is_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("a: " + "[" * 20000 + "]" * 20000 + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(path)
