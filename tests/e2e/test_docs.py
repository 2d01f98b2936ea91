"""docs/*.md: every python block runs, in order, in one namespace per document (model paths = the tiny models)."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
DOCS = Path(__file__).resolve().parents[2] / "docs"


def _run_blocks(doc: Path, namespace: dict, min_blocks: int) -> None:
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    assert len(blocks) >= min_blocks
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"{doc.name}[block {i}]", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"docs/{doc.name} block {i} failed: {exc!r}\n{block}") from exc


def test_extending_snippets_run(ray_cluster, tiny_model_path):
    _run_blocks(DOCS / "extending.md", {"model_path": tiny_model_path, "__name__": "docs_extending"}, 7)


def test_efficiency_snippets_run(tiny_model_path, tiny_moe_path):
    namespace = {"model_path": tiny_model_path, "moe_path": tiny_moe_path, "__name__": "docs_efficiency"}
    _run_blocks(DOCS / "efficiency.md", namespace, 3)
    assert namespace["moe_trainer_cfg"].backend.routing_replay
    assert namespace["engine_cfg"].weight_format == namespace["qat_cfg"].backend.weight_format
