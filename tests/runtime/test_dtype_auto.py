"""dtype="auto": bf16 where the CPU computes in bf16 (or on CUDA), fp32 elsewhere; stats() says which."""

from __future__ import annotations

import pytest
import torch

from tokenflow.engine import Engine
from tokenflow.runtime.cpu import features
from tokenflow.runtime.loader import resolve_dtype


@pytest.mark.parametrize(("flags", "expected"), [
    ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),  # Zen 4, Cooper Lake and later
    ({"avx2", "amx_bf16", "amx_tile"}, torch.bfloat16),  # Sapphire Rapids
    ({"avx2", "avx512f", "avx512_vnni"}, torch.float32),  # no bf16 arithmetic: emulated, slower than fp32
    (set(), torch.float32),  # an OS that does not say
])
def test_auto_follows_the_cpu_flags(monkeypatch, flags, expected) -> None:
    monkeypatch.setattr(features.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(features, "cpu_flags", lambda: frozenset(flags))
    assert resolve_dtype("auto", torch.device("cpu")) == expected
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32  # an explicit choice stands


def test_auto_is_fp32_on_other_architectures(monkeypatch) -> None:
    monkeypatch.setattr(features.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(features, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


def test_this_machines_flags_are_read() -> None:
    flags = features.cpu_flags()
    assert (not flags) or "fpu" in flags or "sse2" in flags or "fp" in flags


async def test_engine_reports_the_dtype_auto_chose(tiny_model, monkeypatch) -> None:
    monkeypatch.delenv("TOKENFLOW_DTYPE")  # the suite pins fp32; this test is about the default
    expected = "bfloat16" if features.has_native_bf16() else "float32"
    async with Engine(tiny_model, max_num_seqs=2) as engine:
        assert engine.config.dtype == "auto"
        stats = engine.stats()
        assert stats["dtype"] == expected and stats["device"] == "cpu"
        done = await engine.generate("hello", max_tokens=4, ignore_eos=True, temperature=0)
        assert len(done.token_ids) == 4
    async with Engine(tiny_model, dtype="float32", max_num_seqs=2) as engine:
        assert engine.stats()["dtype"] == "float32"
