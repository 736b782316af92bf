"""The decode step's layers in one C call (`NativeDecodeLayers`): the fused Python loop's output, bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.test_paged_runner import Seq, build, make_runner
from tokenflow.runtime.cpu.few_rows_linear import load_few_rows_kernels
from tokenflow.runtime.cpu.rms_norm import fuse_rms_norms
from tokenflow.runtime.paged_runner import PagedModelRunner, SeqChunk


def _runner(name: str, dtype: torch.dtype) -> tuple[PagedModelRunner, object]:
    kernels = load_few_rows_kernels()
    if kernels is None or dtype not in kernels.dtypes:  # a CPU without AVX512 (or its BF16 part) has no few-rows kernel
        pytest.skip(f"this CPU runs no few-rows kernel for {dtype}")
    runner, pool = make_runner(build(name, dtype), num_blocks=160)
    fuse_rms_norms(runner.model, runner.native)  # as the paged backend does: the norms the C loop computes too
    assert runner.fused is not None and runner.fused.native_layers is not None
    return runner, pool


def _python_loop(runner: PagedModelRunner, chunks: list[SeqChunk]) -> torch.Tensor:
    loop, runner.fused.native_layers = runner.fused.native_layers, None
    try:
        return runner.execute(chunks)
    finally:
        runner.fused.native_layers = loop


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# GQA, MHA, biases on Q, K, V, per-head Q/K norms, single QKV and gate/up projections, Granite's multipliers
@pytest.mark.parametrize("name", ["llama", "llama-mha", "qwen2", "qwen3", "phi3", "granite"])
def test_decode_steps_equal_the_python_loop(name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    runner, pool = _runner(name, dtype)
    loop = runner.fused.native_layers
    calls = []
    monkeypatch.setattr(loop, "run", lambda *args: calls.append(1) or type(loop).run(loop, *args))
    g = torch.Generator().manual_seed(3)
    seqs = [Seq(torch.randint(0, 256, (n,), generator=g).tolist()) for n in (2, 4, 9, 30, 57)]
    for s in seqs:
        runner.execute([s.chunk(pool, len(s.tokens))])
    assert not calls  # prefill steps keep the Python loop (a one-token prompt is a decode row)
    for rows in (1, 3, 5, 5):
        for s in seqs[:rows]:
            s.tokens.append(int(torch.randint(0, 256, (1,), generator=g)))
        chunks = [s.chunk(pool, 1) for s in seqs[:rows]]
        native = runner.execute(chunks)
        assert len(calls) == 1
        calls.clear()
        assert torch.equal(native, _python_loop(runner, chunks))  # the same step again: the same K/V written
    seqs[0].tokens.append(7)
    mixed = [seqs[0].chunk(pool, 1), Seq(list(range(6))).chunk(pool, 6)]  # a decode beside a prefill chunk
    runner.execute(mixed)
    assert not calls


def test_off_where_the_few_rows_kernel_is_off_or_a_linear_is_replaced() -> None:
    runner, pool = _runner("llama", torch.float32)
    fused = runner.fused
    seq = Seq(list(range(10)))
    runner.execute([seq.chunk(pool, 10)])
    seq.tokens.append(3)
    chunk = seq.chunk(pool, 1)
    step = runner.prepare([chunk], runner.kv_cache)
    h = torch.zeros(1, runner.model.config.hidden_size)
    assert fused.native_layers.takes(h, step.meta)
    with fused.without_few_rows_kernel():  # the self-check's reference arithmetic: oneDNN, Python loop
        assert not fused.native_layers.takes(h, step.meta)
    fused.set_linear("layers.0.o", fused.linears()["layers.0.o"].fallback)
    assert fused.native_layers is None
