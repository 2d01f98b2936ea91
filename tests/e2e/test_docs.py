"""docs/extending.md: every python block runs, in order, in one namespace (model_path = the tiny model)."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def test_extending_snippets_run(ray_cluster, tiny_model_path):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) >= 7
    namespace = {"model_path": tiny_model_path, "__name__": "docs_extending"}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"{DOC.name}[block {i}]", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"docs/extending.md block {i} failed: {exc!r}\n{block}") from exc
