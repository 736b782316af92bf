"""The Triton decode kernel (`attention.triton_decode`), run on the CPU by Triton's interpreter.

The interpreter executes the kernel's own code (its loads, masks, running softmax and split merge) with numpy,
so what is checked here is the kernel's arithmetic and indexing: against a plain softmax over each row's
gathered keys (inside the fixed-shape decode steps against transformers: test_triton_varlen.py). How fast it
runs, only a GPU shows (`scripts/gpu_check.py`). Needs `scripts/install.sh --dev-all` (triton).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tokenflow.config import EngineConfig
from tokenflow.runtime.attention.triton_decode import decode_splits, paged_decode_attention
from tokenflow.runtime.backends import paged as paged_backend
from tokenflow.runtime.gpu.triton_launch import triton_available

if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py sets it before triton is imported"


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
               scale: float) -> torch.Tensor:
    """fp32 softmax attention of each row over its first `lengths[row]` keys, gathered by its table row."""
    rows, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k.shape
    out = []
    for r in range(rows):
        n = int(lengths[r])
        ids = table[r, : -(-n // block_size)]
        keys = k[ids].reshape(-1, kv_heads, head_dim)[:n].float()
        values = v[ids].reshape(-1, kv_heads, head_dim)[:n].float()
        queries = q[r].float().view(kv_heads, num_heads // kv_heads, head_dim)
        probs = (torch.einsum("hgd,nhd->hgn", queries, keys) * scale).softmax(-1)
        out.append(torch.einsum("hgn,nhd->hgd", probs, values).reshape(num_heads, head_dim))
    return torch.stack(out)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "dtype"), [
    (9, 3, 64, 16, torch.float32),  # SmolLM2's grouping: 3 query heads per KV head (padded to 4)
    (8, 2, 80, 12, torch.bfloat16),  # a head width and a block size that are no powers of two; bf16
    (4, 4, 32, 16, torch.float32),  # no grouping
])
def test_each_split_count_equals_softmax_over_the_rows_own_keys(heads: int, kv_heads: int, head_dim: int,
                                                                 block_size: int, dtype: torch.dtype) -> None:
    """Rows of 1 key, a whole block, a block and one, part of the table and all of it, each through blocks
    scattered over the pool; what no row may read is NaN (the slots past a row's length in its last block,
    the table's entries past it, every block no row owns), so one read of it shows in the output."""
    g = torch.Generator().manual_seed(0)
    num_blocks, rows, width = 48, 5, 12
    k = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v = k.clone()
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)  # strided rows, as the fused layers pass them
    lengths = torch.tensor([1, block_size, block_size + 1, 5 * block_size + 3, width * block_size])
    order = torch.randperm(num_blocks, generator=g)
    table = torch.empty((rows, width), dtype=torch.long)
    taken = 0
    for r, n in enumerate(lengths.tolist()):
        used = -(-n // block_size)
        table[r, :used] = order[taken : taken + used]
        table[r, used:] = order[-1]  # a NaN block, as padding points at the scratch block
        taken += used
        slots = k[table[r, :used]].reshape(-1, kv_heads, head_dim)  # a copy: filled below, written back
        slots[:n] = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
        k[table[r, :used]] = slots.view(used, block_size, kv_heads, head_dim)
        values = v[table[r, :used]].reshape(-1, kv_heads, head_dim)
        values[:n] = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
        v[table[r, :used]] = values.view(used, block_size, kv_heads, head_dim)
    expected = _reference(q, k, v, table, lengths, 0.125)
    assert expected.isfinite().all()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    for splits in (1, 2, 3, 5, 12):  # 5 of 12 blocks: 3 per split, 4 splits; short rows leave splits empty
        out = paged_decode_attention(q, k, v, table, lengths, 0.125, splits)
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance, msg=f"{splits} splits")


def test_splits_fill_the_device_and_keep_blocks_per_program() -> None:
    assert decode_splits(rows=1, kv_heads=3, blocks=256, programs=264) == 64  # batch 1: the context is split
    assert decode_splits(rows=64, kv_heads=8, blocks=256, programs=264) == 1  # enough rows to fill it
    assert decode_splits(rows=1, kv_heads=3, blocks=8, programs=264) == 2  # at least 4 blocks each
    assert decode_splits(rows=1, kv_heads=3, blocks=3, programs=264) == 1


def test_the_triton_settings_apply_on_cuda_with_triton_and_say_when_they_cannot(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    assert triton_available()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    backend = paged_backend.PagedBackend(EngineConfig(cuda_attention="triton", cuda_triton_ops=True))
    assert backend._triton_attention(cuda) and backend._triton_ops(cuda)
    assert not backend._triton_attention(cpu) and not backend._triton_ops(cpu)
    default = paged_backend.PagedBackend(EngineConfig())
    assert not default._triton_attention(cuda) and not default._triton_ops(cuda)  # off by default
    monkeypatch.setattr(paged_backend, "triton_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="tokenflow"):
        assert not backend._triton_attention(cuda)
        assert not backend._triton_ops(cuda)
    assert caplog.text.count("triton package is not installed") == 2
