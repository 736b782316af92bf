"""The native bf16 decode kernel: same attention as the torch-ops path, built once, optional."""

from __future__ import annotations

import random
import shutil
import sys

import pytest
import torch

from tokenflow.model import native_attention
from tokenflow.model.matmul_attention import decode_attention
from tokenflow.model.native_attention import load_paged_decode

BF16 = torch.bfloat16

# The CPUs we serve (Linux with gcc): the kernel must build there, not silently fall back.
needs_compiler = pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("cc") is None, reason="needs Linux and a C compiler"
)


class PagedBatch:
    """A KV cache with `lengths` sequences in shuffled blocks, and their decode queries."""

    def __init__(self, lengths: list[int], kv_heads: int, group: int, head_dim: int, block_size: int) -> None:
        rng = random.Random(sum(lengths) + head_dim)
        g = torch.Generator().manual_seed(len(lengths) * 7 + group)
        self.lengths, self.block_size = lengths, block_size
        self.max_blocks = -(-max(lengths) // block_size)
        num_blocks = 1 + sum(-(-n // block_size) for n in lengths) + 5
        slots = num_blocks * block_size
        self.k = torch.randn(slots, kv_heads, head_dim, generator=g).to(BF16)
        self.v = torch.randn(slots, kv_heads, head_dim, generator=g).to(BF16)
        free = list(range(1, num_blocks))
        rng.shuffle(free)
        self.tables = torch.zeros(len(lengths), self.max_blocks, dtype=torch.long)  # padding: block 0
        for i, n in enumerate(lengths):
            for b in range(-(-n // block_size)):
                self.tables[i, b] = free.pop()
        self.q = torch.randn(len(lengths), kv_heads, group, head_dim, generator=g).to(BF16)
        self.scale = head_dim**-0.5

    def torch_ops(self) -> torch.Tensor:
        """The torch-ops path: gather the padded blocks, mask the padding, bf16 matmuls (eager arithmetic)."""
        n, kv_heads, _, head_dim = self.q.shape
        kv_len = max(self.lengths)
        shape = (n, self.max_blocks * self.block_size, kv_heads, head_dim)
        blocks = self.tables.view(-1)
        k = self.k.view(-1, self.block_size, kv_heads, head_dim).index_select(0, blocks)
        v = self.v.view(-1, self.block_size, kv_heads, head_dim).index_select(0, blocks)
        k = k.view(shape)[:, :kv_len].transpose(1, 2)
        v = v.view(shape)[:, :kv_len].transpose(1, 2)
        mask = torch.zeros(n, 1, 1, kv_len, dtype=BF16)
        for i, length in enumerate(self.lengths):
            mask[i, ..., length:] = float("-inf")
        return decode_attention(self.q, k, v, mask, self.scale)

    def exact(self) -> torch.Tensor:
        """fp64 attention of each sequence over its own keys."""
        out = torch.empty(self.q.shape, dtype=torch.float64)
        for i, length in enumerate(self.lengths):
            slots = torch.tensor([int(self.tables[i, t // self.block_size]) * self.block_size + t % self.block_size
                                  for t in range(length)])
            k = self.k[slots].double().transpose(0, 1)  # [KVH, L, D]
            v = self.v[slots].double().transpose(0, 1)
            probs = torch.softmax(self.q[i].double() @ k.transpose(1, 2) * self.scale, dim=-1)  # [KVH, G, L]
            out[i] = probs @ v
        return out

    def native(self) -> torch.Tensor:
        kernel = load_paged_decode(self.q.shape[-1])
        assert kernel is not None
        lengths = torch.tensor(self.lengths, dtype=torch.long)
        return kernel(self.q, self.k, self.v, self.tables, lengths, max(self.lengths), self.block_size, self.scale)


@needs_compiler
@pytest.mark.parametrize(
    ("kv_heads", "group", "head_dim", "block_size"),
    [(3, 3, 64, 16), (2, 4, 128, 16), (1, 8, 64, 32), (4, 1, 32, 8)],
)
def test_kernel_matches_the_torch_ops_path(kv_heads: int, group: int, head_dim: int, block_size: int) -> None:
    lengths = [1, block_size, block_size + 1, 3 * block_size, 57, 200, 333, 2]
    batch = PagedBatch(lengths, kv_heads, group, head_dim, block_size)
    native, ops, exact = batch.native(), batch.torch_ops(), batch.exact()
    assert native.shape == ops.shape and native.dtype == BF16
    # Both round scores and probabilities to bf16 the same way but sum in different orders, so
    # they are compared by their error against fp64 attention: the kernel's is no larger.
    native_error = (native.double() - exact).abs()
    ops_error = (ops.double() - exact).abs()
    assert native_error.max() <= 1.5 * ops_error.max() + 1e-3
    assert native_error.mean() <= 1.2 * ops_error.mean() + 1e-5
    assert native_error.max() < 0.02  # outputs are O(1): a wrong key or block would be off by ~0.1-1


@needs_compiler
def test_kernel_refuses_a_head_dim_it_was_not_built_for() -> None:
    batch = PagedBatch([5, 9], 2, 2, 32, 16)
    kernel = load_paged_decode(64)
    assert kernel is not None
    lengths = torch.tensor(batch.lengths, dtype=torch.long)
    with pytest.raises(ValueError, match="head_dim 64"):
        kernel(batch.q, batch.k, batch.v, batch.tables, lengths, 9, 16, batch.scale)


@needs_compiler
def test_kernel_is_built_once_per_machine(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENFLOW_HOME", str(tmp_path))
    load_paged_decode.cache_clear()
    try:
        first = load_paged_decode(64)
        assert first is not None and first.path.parent == tmp_path / "kernels"
        built = first.path.stat().st_mtime_ns
        load_paged_decode.cache_clear()  # a new process: finds the library instead of compiling again
        again = load_paged_decode(64)
        assert again is not None and again.path == first.path and again.path.stat().st_mtime_ns == built
        assert [p.name for p in (tmp_path / "kernels").iterdir()] == [first.path.name]  # no temporary files left
    finally:
        load_paged_decode.cache_clear()


@needs_compiler
def test_loading_the_kernel_keeps_subnormal_floats(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A library linked with -ffast-math would switch the whole process to flush-to-zero on load."""
    monkeypatch.setenv("TOKENFLOW_HOME", str(tmp_path))
    load_paged_decode.cache_clear()
    try:
        assert load_paged_decode(48) is not None  # a fresh build, loaded now
        tiny = torch.tensor([1e-38], dtype=torch.float32)
        assert (tiny / 1000).item() != 0.0  # still a subnormal, not flushed to zero
    finally:
        load_paged_decode.cache_clear()


@pytest.mark.parametrize("compiler", ["no-such-compiler", "false"], ids=["missing", "failing"])
def test_without_a_working_compiler_attention_stays_on_torch_ops(
    compiler: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("CC", compiler)
    load_paged_decode.cache_clear()
    try:
        assert load_paged_decode(64) is None
        assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").iterdir())
    finally:
        load_paged_decode.cache_clear()


def test_a_second_openmp_runtime_turns_the_kernel_off(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch's OpenMP is not libgomp, a kernel built with -fopenmp would start its own threads."""
    monkeypatch.setattr(native_attention, "_libgomp_paths", lambda: set())
    load_paged_decode.cache_clear()
    try:
        assert load_paged_decode(64) is None
    finally:
        load_paged_decode.cache_clear()
