"""The plugin surface: plugins import only `tokenflow.plugin_api` (and the public `tokenflow` package), and
a third-party scheduler written against it alone, installed through an entry point, passes the oracle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.test_oracle import hf_greedy, make_prompts, run_concurrently
from tokenflow import Engine, registry

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_SOURCES = [*ROOT.glob("plugins/*/tokenflow_*/*.py"), ROOT / "tests/third_party/fifo_scheduler.py"]


def _tokenflow_imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tokenflow":
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(a.name for a in node.names if a.name.split(".")[0] == "tokenflow")
    return modules


def test_plugins_import_only_the_plugin_surface() -> None:
    assert len(PLUGIN_SOURCES) > 8
    private = {str(p.relative_to(ROOT)): sorted(m for m in _tokenflow_imports(p) if m not in
                                                ("tokenflow", "tokenflow.plugin_api"))
               for p in PLUGIN_SOURCES}
    assert {p: m for p, m in private.items() if m} == {}


@pytest.fixture
def fifo_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Install the test's scheduler the way a distribution would: a dist-info with an entry point."""
    dist = tmp_path / "fifo_scheduler-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fifo-scheduler\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[tokenflow.stages]\nfifo = tests.third_party.fifo_scheduler:create\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fifo"


async def test_a_third_party_scheduler_passes_the_oracle(tiny_model, fifo_plugin: str) -> None:
    found = {p.name: p for p in registry.list_plugins(registry.STAGES)}
    assert found[fifo_plugin].origin == "fifo-scheduler 0.1" and not found[fifo_plugin].builtin
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompts = make_prompts(400, [3, 9, 17, 33, 64, 100, 150, 230, 301, 47])
    async with Engine(tiny_model, batcher=fifo_plugin, max_num_seqs=8, max_batch_tokens=128) as engine:
        outputs = await run_concurrently(engine, prompts, max_tokens=24, stagger_s=0.01)
        stats = engine.stats()
    assert stats["fifo_steps"] > 0 and stats["kv_blocks_used"] == 0
    for prompt, got in zip(prompts, outputs):
        assert got == hf_greedy(model, prompt, 24)
