"""The KV pool is sized from available memory, and the context the engine serves fits its pool.

Free pages shrink towards zero as the page cache grows on any long-running host (the same command got
2,236, then 629, then 53 blocks), while the memory the OS can give (`MemAvailable`) stays put. A pool
too small for one sequence of `max_model_len` tokens is refused when that length was asked for, and
clamps the served context, with a warning, when it was only the model's.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import httpx
import pytest
import torch

from tests.engines import running_engine
from tests.servers import Server
from tokenflow.config import EngineConfig
from tokenflow.errors import ConfigError, InvalidRequest
from tokenflow.runtime.backends.paged import kv_pool_blocks

FILL_BYTES = 3 * 2**30


def _pool_blocks() -> int:
    """What the default rule gives for 1 MiB blocks (large enough that no ceiling caps it)."""
    config = EngineConfig(max_model_len=2**20, max_num_seqs=256)
    return kv_pool_blocks(config, 2**20, 2**20, torch.device("cpu"))


def _fill_page_cache(path: Path) -> None:
    """Write and read `FILL_BYTES` of file data: the page cache holds it afterwards."""
    chunk = os.urandom(2**20) * 16
    with open(path, "wb") as f:
        for _ in range(FILL_BYTES // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    with open(path, "rb") as f:
        while f.read(2**24):
            pass


def _free_pages_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_the_pool_size_does_not_follow_the_page_cache(tmp_path: Path) -> None:
    before, free_before = _pool_blocks(), _free_pages_bytes()
    big = tmp_path / "page-cache-filler"
    try:
        _fill_page_cache(big)
        after, free_after = _pool_blocks(), _free_pages_bytes()
    finally:
        big.unlink()
    print(f"\n[pool] {before} -> {after} blocks; free pages {free_before / 2**30:.2f} -> "
          f"{free_after / 2**30:.2f} GiB")
    assert abs(after - before) <= 0.05 * before, (before, after)


async def test_a_pool_too_small_for_the_models_context_clamps_it_and_says_so(tiny_model, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="tokenflow")
    async with running_engine(tiny_model, num_kv_blocks=8, num_threads=1) as engine:  # 8 x 16 = 128 tokens
        assert engine.loaded.max_model_len == 128 and engine.limits.max_model_len == 128
        assert "serving max_model_len=128" in caplog.text
        with pytest.raises(InvalidRequest) as refused:  # refused for the context, not for the pool
            await engine.generate("hello", max_tokens=200)
        assert refused.value.field == "max_tokens" and "context is 128 tokens" in str(refused.value)
        done = await engine.generate("hello", max_tokens=100, ignore_eos=True)  # fits: served
        assert len(done.token_ids) == 100


async def test_an_asked_for_context_the_pool_cannot_hold_is_refused(tiny_model) -> None:
    with pytest.raises(ConfigError) as refused:
        async with running_engine(tiny_model, num_kv_blocks=8, max_model_len=512, num_threads=1):
            pass
    assert refused.value.field == "max_model_len" and "num_kv_blocks" in str(refused.value)


def test_models_and_tokenize_report_the_served_context(tiny_model) -> None:
    with Server(tiny_model, num_kv_blocks=8, num_threads=1) as server:
        models = httpx.get(server.url + "/v1/models").json()["data"]
        assert models[0]["max_model_len"] == 128
        tokenized = httpx.post(server.url + "/tokenize", json={"prompt": "hello"}).json()
        assert tokenized["max_model_len"] == 128
