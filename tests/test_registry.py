"""Entry-point discovery: built-ins, a third-party plugin, the allow-list, broken plugins."""

from __future__ import annotations

import sys

import pytest

from tokenflow import Engine, registry
from tokenflow.cli import main
from tokenflow.config import EngineConfig
from tokenflow.errors import PluginError


def test_builtins_are_registered_through_entry_points_one_group_per_kind() -> None:
    found = {(p.group, p.name): p for p in registry.list_plugins()}
    for key in [(registry.SCHEDULERS, "scheduler"), (registry.SCHEDULERS, "batcher"), (registry.KV_POOLS, "token_pool"),
                (registry.TIERS, "disk"), (registry.BACKENDS, "paged"), (registry.BACKENDS, "hf")]:
        assert key in found and found[key].builtin and found[key].origin.startswith("tokenflow-engine ")
    assert not [p for p in registry.list_plugins(registry.STAGES) if p.builtin]  # stages: your middleware only


def test_kinds_come_from_the_protocols() -> None:
    config = EngineConfig()
    assert registry.kind_of(registry.load_stage("redact", config)) == "request"
    assert registry.kind_of(registry.load_scheduler("scheduler", config)) == "loop"
    assert registry.kind_of(registry.load_tier("disk", config)) == "tier"
    assert registry.kind_of(registry.load_backend("paged", config)) == "backend"


def test_a_scheduler_registered_the_old_way_is_found_with_a_warning(tmp_path, monkeypatch) -> None:
    src = "from tokenflow.scheduler.scheduler import Scheduler\n\ndef create(config):\n    return Scheduler(config)\n"
    _fake_distribution(tmp_path, monkeypatch, "old-sched", "oldsched = old_sched:create", src)
    with pytest.warns(DeprecationWarning, match="tokenflow.schedulers"):
        assert registry.kind_of(registry.load_scheduler("oldsched", EngineConfig())) == "loop"


def test_third_party_stage_is_found_and_runs(tiny_model) -> None:
    """`tokenflow-redact` (plugins/) is installed in the test environment like any other package."""
    found = {p.name: p for p in registry.list_plugins(registry.STAGES)}
    assert "redact" in found and not found["redact"].builtin
    assert found["redact"].origin.startswith("tokenflow-redact")

    import anyio

    async def run() -> str:
        async with Engine(tiny_model, request_stages=["redact"]) as engine:
            done = await engine.generate("mail alice@example.com now", max_tokens=2, temperature=0.0)
            assert engine.stats()["redacted_emails"] == 1
            return engine.loaded.tokenizer.decode(done.prompt_token_ids)

    assert anyio.run(run) == "mail [email] now"


def test_allow_list_blocks_unlisted_third_party_plugins(monkeypatch) -> None:
    monkeypatch.setenv("TOKENFLOW_PLUGINS", "something-else")
    with pytest.raises(PluginError, match="TOKENFLOW_PLUGINS"):
        registry.load_stage("redact", EngineConfig())
    registry.load_scheduler("scheduler", EngineConfig())  # built-ins always load
    monkeypatch.setenv("TOKENFLOW_PLUGINS", "redact")
    registry.load_stage("redact", EngineConfig())


def _fake_distribution(tmp_path, monkeypatch, name: str, entry: str, module_src: str | None) -> None:
    """A distribution on sys.path made of a dist-info folder (what pip writes)."""
    info = tmp_path / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[tokenflow.stages]\n{entry}\n")
    if module_src is not None:
        (tmp_path / f"{name.replace('-', '_')}.py").write_text(module_src)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_plugin_that_fails_to_import_names_the_entry_point(tmp_path, monkeypatch) -> None:
    _fake_distribution(tmp_path, monkeypatch, "broken-plugin", "broken = no_such_module_xyz:create", None)
    with pytest.raises(PluginError, match=r"tokenflow.stages:broken.*failed to import"):
        registry.load_stage("broken", EngineConfig())


def test_plugin_without_the_protocol_names_what_is_missing(tmp_path, monkeypatch) -> None:
    src = "class NotAStage:\n    pass\n\ndef create(config):\n    return NotAStage()\n"
    _fake_distribution(tmp_path, monkeypatch, "lazy-plugin", "lazy = lazy_plugin:create", src)
    sys.modules.pop("lazy_plugin", None)
    with pytest.raises(PluginError, match=r"lazy.*does not implement.*missing handle"):
        registry.load_stage("lazy", EngineConfig(), kinds=("request",))


def test_engine_start_fails_on_unknown_stage(tiny_model) -> None:
    import anyio

    async def run() -> None:
        async with Engine(tiny_model, request_stages=["nope"]):
            pass

    with pytest.raises(PluginError, match="no plugin named 'nope'"):
        anyio.run(run)


def test_cli_plugins_lists_kind_and_origin(capsys) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "scheduler" in out and "loop" in out and "token_pool" in out and "disk" in out and "kv tier" in out
    assert "redact" in out and "tokenflow-redact 0.1.0" in out
    assert "paged" in out and "backend" in out
