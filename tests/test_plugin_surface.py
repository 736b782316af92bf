"""The plugin surface: plugins import only `tokenflow.plugin_api` (and the public `tokenflow` package), and
a third-party scheduler, KV pool and KV tier written against it alone, installed through entry points, pass
the oracle; a pool that lacks a method the engine calls is refused when it loads, naming the method."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.test_oracle import hf_greedy, make_prompts, run_concurrently
from tokenflow import Engine, registry

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_SOURCES = [*ROOT.glob("plugins/*/tokenflow_*/*.py"), *ROOT.glob("tests/third_party/[a-z]*.py")]


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


THIRD_PARTY_ENTRY_POINTS = """\
[tokenflow.schedulers]
fifo = tests.third_party.fifo_scheduler:create

[tokenflow.kv_pools]
plain = tests.third_party.plain_pool:create
no_trim = tests.third_party.plain_pool:create_without_trim

[tokenflow.kv_tiers]
memtier = tests.third_party.memory_tier:create
"""


@pytest.fixture
def third_party(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Install the test plugins the way a distribution would: a dist-info with entry points."""
    dist = tmp_path / "third_party_plugins-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: third-party-plugins\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(THIRD_PARTY_ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.fixture(scope="module")
def oracle(tiny_model) -> tuple[list[list[int]], list[list[int]]]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompts = make_prompts(400, [3, 9, 17, 33, 64, 100, 150, 230, 301, 47])
    return prompts, [hf_greedy(model, prompt, 24) for prompt in prompts]


async def test_a_third_party_scheduler_passes_the_oracle(tiny_model, third_party, oracle) -> None:
    found = {p.name: p for p in registry.list_plugins(registry.SCHEDULERS)}
    assert found["fifo"].origin == "third-party-plugins 0.1" and not found["fifo"].builtin
    prompts, expected = oracle
    async with Engine(tiny_model, scheduler="fifo", max_num_seqs=8, max_batch_tokens=128) as engine:
        outputs = await run_concurrently(engine, prompts, max_tokens=24, stagger_s=0.01)
        stats = engine.stats()
    assert stats["fifo_steps"] > 0 and stats["kv_blocks_used"] == 0
    assert outputs == expected


async def test_a_third_party_pool_passes_the_oracle(tiny_model, third_party, oracle) -> None:
    prompts, expected = oracle
    async with Engine(tiny_model, kv_pool="plain", num_kv_blocks=48, max_num_seqs=8, max_batch_tokens=128,
                      debug_leaks=True) as engine:
        outputs = await run_concurrently(engine, prompts, max_tokens=24, stagger_s=0.01)
        stats = engine.stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["plain_pool_allocations"] > 48  # 10 prompts of up to 325 tokens in 48 blocks: blocks were reused
    assert outputs == expected


async def test_a_third_party_tier_passes_the_oracle(tiny_model, third_party, oracle) -> None:
    """One engine publishes its prompts' blocks to the tier as they fill; a fresh one loads them back."""
    from tests.third_party import memory_tier

    memory_tier.STORE.clear()
    prompts, expected = oracle
    settings = dict(kv_tiers=["memtier"], num_kv_blocks=128, max_num_seqs=8, max_batch_tokens=128)
    async with Engine(tiny_model, **settings) as engine:
        first = await run_concurrently(engine, prompts, max_tokens=24)
    assert len(memory_tier.STORE) >= sum(len(p) // 16 for p in prompts) // 2
    async with Engine(tiny_model, **settings) as engine:
        again = [await engine.generate(p, max_tokens=24, temperature=0.0) for p in prompts]
        stats = engine.stats()
    assert first == expected and [d.token_ids for d in again] == expected
    assert stats["memtier_blocks_loaded"] > 0 and sum(d.usage.cached_tokens for d in again) > 0


def test_a_pool_without_a_method_the_engine_calls_is_refused_by_name(tiny_model, third_party) -> None:
    from tokenflow.config import EngineConfig
    from tokenflow.errors import PluginError

    with pytest.raises(PluginError, match=r"no_trim.*does not implement.*KVPool.*missing trim"):
        registry.load_pool("no_trim", EngineConfig(), num_blocks=4, block_size=16)


def test_a_partly_implemented_optional_hook_set_is_refused(tmp_path, monkeypatch) -> None:
    """A scheduler with `shrink` but `oom_recoverd` misspelled: the hook would silently never be called."""
    from tokenflow.config import EngineConfig
    from tokenflow.errors import PluginError

    src = ("from tests.third_party.fifo_scheduler import FifoScheduler\n\n"
           "class Half(FifoScheduler):\n    def shrink(self, plan):\n        return False\n"
           "    def oom_recoverd(self):\n        pass\n\ndef create(config):\n    return Half(config)\n")
    (tmp_path / "half_sched.py").write_text(src)
    dist = tmp_path / "half-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: half\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[tokenflow.schedulers]\nhalf = half_sched:create\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match=r"RecoveringScheduler hooks but not oom_gave_up, oom_recovered, "
                                          r"vacate_blocks_from"):
        registry.load_scheduler("half", EngineConfig())
