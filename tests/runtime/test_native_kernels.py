"""The native bf16 attention kernels: the same attention as the torch-ops path, built once, optional."""

from __future__ import annotations

import random
import shutil
import sys

import pytest
import torch

from tokenflow.runtime.attention import matmul as matmul_attention
from tokenflow.runtime.attention.matmul import decode_attention, prefill_attention
from tokenflow.runtime.cpu import native_kernels
from tokenflow.runtime.cpu.native_kernels import load_native_kernels

BF16 = torch.bfloat16

# The CPUs we serve (Linux with gcc): the kernel must build there, not silently fall back.
needs_compiler = pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("cc") is None, reason="needs Linux and a C compiler"
)


class PagedBatch:
    """A KV cache with `lengths` sequences in shuffled blocks, and their decode queries."""

    def __init__(self, lengths: list[int], kv_heads: int, group: int, head_dim: int, block_size: int,
                 dtype: torch.dtype = BF16) -> None:
        rng = random.Random(sum(lengths) + head_dim)
        g = torch.Generator().manual_seed(len(lengths) * 7 + group)
        self.lengths, self.block_size = lengths, block_size
        self.max_blocks = -(-max(lengths) // block_size)
        num_blocks = 1 + sum(-(-n // block_size) for n in lengths) + 5
        slots = num_blocks * block_size
        self.k = torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype)
        self.v = torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype)
        free = list(range(1, num_blocks))
        rng.shuffle(free)
        self.tables = torch.zeros(len(lengths), self.max_blocks, dtype=torch.long)  # padding: block 0
        for i, n in enumerate(lengths):
            for b in range(-(-n // block_size)):
                self.tables[i, b] = free.pop()
        self.q = torch.randn(len(lengths), kv_heads, group, head_dim, generator=g).to(dtype)
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

    def native(self, strided: bool = False) -> torch.Tensor:
        """The kernel's output; `strided`: the queries as rows of a wider projection (in place, as a QKV view)."""
        kernels = load_native_kernels(self.q.shape[-1], self.q.shape[2])
        assert kernels is not None
        lengths = torch.tensor(self.lengths, dtype=torch.long)
        q = self.q
        if strided:
            n = q.shape[0]
            wide = torch.full((n, 2 * q[0].numel() + 7), float("nan"), dtype=q.dtype)
            wide[:, 3:3 + q[0].numel()] = q.reshape(n, -1)
            q = wide[:, 3:3 + q[0].numel()].view(q.shape)
            assert not q.is_contiguous()
        return kernels.decode(q, self.k, self.v, self.tables, lengths, max(self.lengths), self.block_size, self.scale)


@needs_compiler
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize(("kv_heads", "group", "head_dim", "block_size"), [(3, 3, 64, 16), (4, 1, 32, 8)])
def test_int8_decode_kernel_equals_attention_over_the_dequantised_cache(
    kv_heads: int, group: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    """kv_cache_dtype="int8": the kernel reads int8 rows and their scales in place; the exact answer is fp64
    attention over the same values dequantised, as KVCache.gather hands them to the torch-ops path."""
    from tokenflow.kv.kv_cache import dequantize_int8, quantize_int8

    lengths = [1, block_size, block_size + 1, 3 * block_size, 57, 200, 333, 2]
    batch = PagedBatch(lengths, kv_heads, group, head_dim, block_size, dtype=torch.float32)
    (k8, ks), (v8, vs) = quantize_int8(batch.k), quantize_int8(batch.v)
    batch.k, batch.v = dequantize_int8(k8, ks, torch.float32), dequantize_int8(v8, vs, torch.float32)
    exact = batch.exact()  # over the dequantised values
    batch.q = batch.q.to(dtype)
    kernels = load_native_kernels(head_dim, group)
    assert kernels is not None
    out = kernels.decode_int8(batch.q, k8, v8, ks, vs, batch.tables, torch.tensor(lengths), max(lengths), block_size,
                              batch.scale)
    assert out.shape == batch.q.shape and out.dtype == dtype
    error = (out.double() - exact).abs().max().item()
    assert error < (2e-2 if dtype == BF16 else 1e-5), error  # a wrong scale or slot would be off by ~0.1-1


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
    assert torch.equal(batch.native(strided=True), native)  # queries read in place from strided rows


@needs_compiler
@pytest.mark.parametrize(
    ("kv_heads", "group", "head_dim", "block_size"), [(3, 3, 64, 16), (2, 4, 128, 16), (4, 1, 32, 8), (2, 2, 80, 16)]
)
def test_fp32_kernel_matches_sdpa(kv_heads: int, group: int, head_dim: int, block_size: int) -> None:
    """fp32 decodes read the cache in place too, as accurate as SDPA over the gathered blocks."""
    lengths = [1, block_size, block_size + 1, 3 * block_size, 57, 200, 333, 2]
    batch = PagedBatch(lengths, kv_heads, group, head_dim, block_size, dtype=torch.float32)
    native, exact = batch.native(), batch.exact()
    assert native.shape == batch.q.shape and native.dtype == torch.float32
    n, kv_len = len(lengths), max(lengths)
    blocks = batch.tables.view(-1)
    shape = (n, batch.max_blocks * block_size, kv_heads, head_dim)
    k = batch.k.view(-1, block_size, kv_heads, head_dim).index_select(0, blocks).view(shape)[:, :kv_len].transpose(1, 2)
    v = batch.v.view(-1, block_size, kv_heads, head_dim).index_select(0, blocks).view(shape)[:, :kv_len].transpose(1, 2)
    seen = torch.arange(kv_len)[None, :] < torch.tensor(lengths)[:, None]
    sdpa = torch.nn.functional.scaled_dot_product_attention(batch.q, k, v, attn_mask=seen.view(n, 1, 1, kv_len),
                                                            scale=batch.scale)
    native_error = (native.double() - exact).abs().max().item()
    assert native_error <= 4 * (sdpa.double() - exact).abs().max().item() + 1e-6
    assert native_error < 1e-5
    assert torch.equal(batch.native(strided=True), native)


@needs_compiler
@pytest.mark.parametrize("sharpness", [8.0, 40.0])
def test_fp32_kernels_keep_sharp_softmaxes_as_exact_as_fp32_ops(sharpness: float) -> None:
    """Scores up to hundreds apart (queries scaled up): the kernels' exponentials keep the softmax as
    exact as the same attention in fp32 torch ops, measured against fp64."""
    batch = PagedBatch([1, 17, 200, 333], 3, 3, 64, 16, dtype=torch.float32)
    batch.q *= sharpness
    exact = batch.exact()
    fp32 = torch.empty_like(batch.q)
    for i, length in enumerate(batch.lengths):  # the fp64 reference's arithmetic, in fp32
        slots = torch.tensor([int(batch.tables[i, t // 16]) * 16 + t % 16 for t in range(length)])
        k, v = batch.k[slots].transpose(0, 1), batch.v[slots].transpose(0, 1)
        fp32[i] = torch.softmax(batch.q[i] @ k.transpose(1, 2) * batch.scale, dim=-1) @ v
    ops_error = (fp32.double() - exact).abs().max().item()
    assert (batch.native().double() - exact).abs().max().item() <= 2 * ops_error + 1e-6

    kernels = load_native_kernels(64, 3)
    assert kernels is not None
    q = torch.randn(200, 9, 64, generator=torch.Generator().manual_seed(3)) * sharpness
    table = batch.tables[2]
    slots = torch.tensor([int(table[j // 16]) * 16 + j % 16 for j in range(200)])
    k, v = batch.k[slots].transpose(0, 1)[:, None], batch.v[slots].transpose(0, 1)[:, None]  # [KVH, 1, L, D]
    qh = q.view(200, 3, 3, 64).permute(1, 2, 0, 3)  # [KVH, G, t, D]
    mask = torch.full((200, 200), float("-inf")).triu_(1)
    exact = torch.softmax(qh.double() @ k.double().transpose(-1, -2) * batch.scale + mask, -1) @ v.double()
    sdpa = torch.nn.functional.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=batch.scale)
    native = kernels.prefill(q, batch.k, batch.v, table, 16, 0, batch.scale).view(200, 3, 3, 64).permute(1, 2, 0, 3)
    assert (native.double() - exact).abs().max().item() <= 2 * (sdpa.double() - exact).abs().max().item() + 1e-6


@needs_compiler
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_a_nan_query_gives_nan_attention_and_only_there(dtype: torch.dtype) -> None:
    """A NaN in one query (a numerical fault upstream) shows in that head's output, not masked into a
    plausible softmax; the other heads and sequences are untouched."""
    batch = PagedBatch([40, 70], 3, 3, 64, 16, dtype=dtype)
    clean = batch.native()
    batch.q[0, 1, 2, 5] = float("nan")
    faulty = batch.native()
    assert torch.isnan(faulty[0, 1, 2]).all()
    keep = torch.ones(faulty.shape, dtype=torch.bool)
    keep[0, 1, 2] = False
    assert torch.equal(faulty[keep], clean[keep])
    kernels = load_native_kernels(64, 3)
    assert kernels is not None
    if dtype in kernels.prefill_dtypes:
        q = torch.randn(40, 9, 64).to(dtype)
        q[7, 4, 0] = float("nan")
        out = kernels.prefill(q, batch.k, batch.v, batch.tables[0], 16, 0, batch.scale)
        assert torch.isnan(out[7, 4]).all() and torch.isfinite(out[:7]).all()
        assert torch.isfinite(out[7, :4]).all() and torch.isfinite(out[7, 5:]).all()


@needs_compiler
@pytest.mark.parametrize(
    ("kv_heads", "group", "head_dim", "scale"), [(3, 3, 64, None), (2, 4, 128, None), (1, 2, 80, 0.3)]
)
@pytest.mark.parametrize(("start", "t"), [(0, 300), (37, 90), (200, 1)])
def test_prefill_softmax_matches_the_torch_ops_path(
    kv_heads: int, group: int, head_dim: int, scale: float | None, start: int, t: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk of t queries at positions start.. over start + t keys, in query tiles: native
    softmax vs eager arithmetic, both against fp64 causal attention."""
    monkeypatch.setattr(matmul_attention, "QUERY_TILE", 64)  # several tiles, a partial last one
    g = torch.Generator().manual_seed(start + t + head_dim)
    q = torch.randn(t, kv_heads * group, head_dim, generator=g).to(BF16)
    k = torch.randn(kv_heads, start + t, head_dim, generator=g).to(BF16)
    v = torch.randn(kv_heads, start + t, head_dim, generator=g).to(BF16)
    scale = scale or head_dim**-0.5
    mask = torch.full((t, start + t), float("-inf"), dtype=BF16).triu_(start + 1)
    kernels = load_native_kernels(head_dim, group)
    assert kernels is not None
    native = prefill_attention(q, k, v, mask, scale, kernels)
    ops = prefill_attention(q, k, v, mask, scale)
    qh = q.double().view(t, kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [KVH, G, t, D]
    scores = qh @ k.double()[:, None].transpose(-1, -2) * scale + mask.double()
    exact = (torch.softmax(scores, -1) @ v.double()[:, None]).permute(2, 0, 1, 3).reshape(t, -1, head_dim)
    native_error, ops_error = (native.double() - exact).abs(), (ops.double() - exact).abs()
    assert native_error.max() <= 1.5 * ops_error.max() + 1e-3
    assert native_error.mean() <= 1.2 * ops_error.mean() + 1e-5
    assert (native == ops).float().mean() > 0.5  # mostly the very same bf16 numbers


@needs_compiler
@pytest.mark.parametrize(
    ("kv_heads", "group", "head_dim", "block_size"),
    [(3, 3, 64, 16), (2, 4, 128, 16), (1, 8, 64, 32), (4, 1, 32, 8), (2, 2, 80, 16), (1, 2, 16, 4)],
)
@pytest.mark.parametrize(("start", "t"), [(0, 300), (0, 1), (37, 90), (200, 1), (5, 7)])
def test_fp32_prefill_kernel_matches_sdpa(
    kv_heads: int, group: int, head_dim: int, block_size: int, start: int, t: int
) -> None:
    """An fp32 chunk of t queries at positions start.. over its sequence's keys in shuffled cache
    blocks (and, from position 0, over the chunk's own key rows): as accurate as SDPA against fp64."""
    kernels = load_native_kernels(head_dim, group)
    assert kernels is not None and torch.float32 in kernels.prefill_dtypes
    length = start + t
    batch = PagedBatch([length], kv_heads, group, head_dim, block_size, dtype=torch.float32)
    g = torch.Generator().manual_seed(length + head_dim)
    q = torch.randn(t, kv_heads * group, head_dim, generator=g)
    table = batch.tables[0]
    slots = torch.tensor([int(table[j // block_size]) * block_size + j % block_size for j in range(length)])
    k, v = batch.k[slots].transpose(0, 1), batch.v[slots].transpose(0, 1)  # [KVH, L, D]
    mask = torch.full((t, length), float("-inf")).triu_(start + 1)
    qh = q.view(t, kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [KVH, G, t, D]

    def heads_last(x: torch.Tensor) -> torch.Tensor:  # [KVH, G, t, D] -> [t, H, D]
        return x.permute(2, 0, 1, 3).reshape(t, -1, head_dim)

    scores = qh.double() @ k.double()[:, None].transpose(-1, -2) * batch.scale + mask.double()
    exact = heads_last(torch.softmax(scores, -1) @ v.double()[:, None])
    sdpa = heads_last(torch.nn.functional.scaled_dot_product_attention(
        qh, k[:, None], v[:, None], attn_mask=mask, scale=batch.scale))
    native = kernels.prefill(q, batch.k, batch.v, table, block_size, start, batch.scale)
    assert native.shape == q.shape and native.dtype == torch.float32
    native_error = (native.double() - exact).abs().max().item()
    assert native_error <= 4 * (sdpa.double() - exact).abs().max().item() + 1e-6
    assert native_error < 1e-5  # outputs are O(1): a wrong key, block or mask would be off by ~0.1-1
    if start == 0:  # the chunk's own rows, key j at row j
        own = kernels.prefill(q, k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(), None,
                              block_size, 0, batch.scale)
        assert (own.double() - exact).abs().max().item() < 1e-5


@needs_compiler
@pytest.mark.parametrize(
    ("kv_heads", "group", "head_dim", "block_size"), [(3, 3, 64, 16), (2, 4, 128, 16), (4, 1, 32, 8), (2, 2, 80, 16)]
)
@pytest.mark.parametrize(("start", "t"), [(0, 300), (0, 1), (37, 90), (200, 1), (5, 8)])
def test_bf16_prefill_kernel_equals_the_matmul_path(
    kv_heads: int, group: int, head_dim: int, block_size: int, start: int, t: int
) -> None:
    """With AVX512-BF16, a bf16 chunk over its keys in shuffled cache blocks: eager's rounding steps
    (scores, scaled scores, probabilities, output to bf16), so the same bf16 numbers as the matmul path."""
    kernels = load_native_kernels(head_dim, group)
    assert kernels is not None
    length = start + t
    batch = PagedBatch([length], kv_heads, group, head_dim, block_size)
    if torch.bfloat16 not in kernels.prefill_dtypes:  # only a CPU (or a build) without AVX512-BF16 lacks it
        assert "avx512_bf16" not in native_kernels.cpu_flags() or native_kernels.isa_restricted()
        q = torch.zeros(t, kv_heads * group, head_dim, dtype=BF16)
        with pytest.raises(ValueError, match="paged prefill here takes"):
            kernels.prefill(q, batch.k, batch.v, batch.tables[0], block_size, start, batch.scale)
        return
    g = torch.Generator().manual_seed(length + head_dim)
    q = torch.randn(t, kv_heads * group, head_dim, generator=g).to(BF16)
    table = batch.tables[0]
    slots = torch.tensor([int(table[j // block_size]) * block_size + j % block_size for j in range(length)])
    k, v = batch.k[slots].transpose(0, 1), batch.v[slots].transpose(0, 1)  # [KVH, L, D]
    mask = torch.full((t, length), float("-inf"), dtype=BF16).triu_(start + 1)
    ops = prefill_attention(q, k, v, mask, batch.scale)
    native = kernels.prefill(q, batch.k, batch.v, table, block_size, start, batch.scale)
    assert native.shape == q.shape and native.dtype == BF16
    assert (native == ops).float().mean() > 0.9  # fp32 sums in another order flip a few last bits
    assert (native.float() - ops.float()).abs().max() < 0.02  # a wrong key or mask would be off by ~0.1-1


@needs_compiler
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (2, 4, 128), (2, 2, 80)])
def test_bf16_prefill_rows_do_not_depend_on_the_chunking(kv_heads: int, group: int, head_dim: int) -> None:
    """A prompt's rows come out the same whether it is prefilled in one chunk or the rest after a cached
    prefix (every chunk runs the same arithmetic: AMX tiles where the CPU has them, else AVX512-BF16)."""
    kernels = load_native_kernels(head_dim, group)
    assert kernels is not None
    if torch.bfloat16 not in kernels.prefill_dtypes:
        pytest.skip("no bf16 prefill kernel on this CPU")
    length = 300
    batch = PagedBatch([length], kv_heads, group, head_dim, 16)
    g = torch.Generator().manual_seed(head_dim)
    q = torch.randn(length, kv_heads * group, head_dim, generator=g).to(BF16)
    table = batch.tables[0]
    whole = kernels.prefill(q, batch.k, batch.v, table, 16, 0, batch.scale)
    for start in (1, 37, 299):
        rest = kernels.prefill(q[start:].contiguous(), batch.k, batch.v, table, 16, start, batch.scale)
        assert torch.equal(rest, whole[start:]), start


@needs_compiler
def test_kernels_refuse_a_geometry_they_were_not_built_for() -> None:
    batch = PagedBatch([5, 9], 2, 2, 32, 16)
    kernels = load_native_kernels(64, 2)
    assert kernels is not None
    lengths = torch.tensor(batch.lengths, dtype=torch.long)
    with pytest.raises(ValueError, match="head_dim 64"):
        kernels.decode(batch.q, batch.k, batch.v, batch.tables, lengths, 9, 16, batch.scale)


@needs_compiler
def test_kernels_are_built_once_per_machine(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENFLOW_HOME", str(tmp_path))
    load_native_kernels.cache_clear()
    try:
        first = load_native_kernels(64, 3)
        assert first is not None and first.path.parent == tmp_path / "kernels"
        built = first.path.stat().st_mtime_ns
        load_native_kernels.cache_clear()  # a new process: finds the library instead of compiling again
        again = load_native_kernels(64, 3)
        assert again is not None and again.path == first.path and again.path.stat().st_mtime_ns == built
        assert [p.name for p in (tmp_path / "kernels").iterdir()] == [first.path.name]  # no temporary files left
    finally:
        load_native_kernels.cache_clear()


@needs_compiler
def test_loading_the_kernel_keeps_subnormal_floats(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A library linked with -ffast-math would switch the whole process to flush-to-zero on load."""
    monkeypatch.setenv("TOKENFLOW_HOME", str(tmp_path))
    load_native_kernels.cache_clear()
    try:
        assert load_native_kernels(48, 1) is not None  # a fresh build, loaded now
        tiny = torch.tensor([1e-38], dtype=torch.float32)
        assert (tiny / 1000).item() != 0.0  # still a subnormal, not flushed to zero
    finally:
        load_native_kernels.cache_clear()


@pytest.mark.parametrize("compiler", ["no-such-compiler", "false"], ids=["missing", "failing"])
def test_without_a_working_compiler_attention_stays_on_torch_ops(
    compiler: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("CC", compiler)
    load_native_kernels.cache_clear()
    try:
        assert load_native_kernels(64, 3) is None
        assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").iterdir())
    finally:
        load_native_kernels.cache_clear()


def test_a_second_openmp_runtime_turns_the_kernel_off(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch's OpenMP is not libgomp, kernels built with -fopenmp would start threads of their own."""
    monkeypatch.setattr(native_kernels, "loaded_libgomp_paths", lambda: set())
    load_native_kernels.cache_clear()
    try:
        assert load_native_kernels(64, 3) is None
    finally:
        load_native_kernels.cache_clear()


@needs_compiler
def test_a_vendored_libgomp_beside_torchs_keeps_the_kernels(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sentencepiece's wheel maps its own renamed libgomp when a tokenizer imports it: the kernels' libgomp.so.1
    still binds to torch's, so they stay on (they were off for every model whose tokenizer loaded
    sentencepiece, at half the speed)."""
    from tokenflow.runtime.cpu.openmp_team import loaded_libgomp_paths

    torch_gomp = {p for p in loaded_libgomp_paths() if p.endswith("/libgomp.so.1")}
    if len(torch_gomp) != 1:
        pytest.skip("torch here does not use libgomp")
    vendored = {*torch_gomp, "/site-packages/sentencepiece.libs/libgomp-6a29c32d.so.1.0.0"}
    monkeypatch.setattr(native_kernels, "loaded_libgomp_paths", lambda: vendored)
    monkeypatch.setenv("TOKENFLOW_HOME", str(tmp_path))
    load_native_kernels.cache_clear()
    try:
        assert load_native_kernels(64, 3) is not None
    finally:
        load_native_kernels.cache_clear()


@needs_compiler
@pytest.mark.parametrize(("start", "t"), [(0, 300), (37, 90), (200, 1)])
def test_int8_prefill_kernel_equals_the_fp32_one_over_the_dequantised_cache(start: int, t: int) -> None:
    """kv_cache_dtype="int8": the fp32 prefill kernel, dequantising as it packs, gives what the fp32 kernel
    gives over the same values dequantised beforehand."""
    from tokenflow.kv.kv_cache import dequantize_int8, quantize_int8

    kv_heads, group, head_dim, block_size = 3, 3, 64, 16
    kernels = load_native_kernels(head_dim, group)
    assert kernels is not None
    g = torch.Generator().manual_seed(start + t)
    blocks = -(-(start + t) // block_size)
    table = torch.randperm(blocks + 4, generator=g)[:blocks]
    slots = (blocks + 4) * block_size
    (k8, ks), (v8, vs) = (quantize_int8(torch.randn(slots, kv_heads, head_dim, generator=g)) for _ in range(2))
    q = torch.randn(t, kv_heads * group, head_dim, generator=g)
    got = kernels.prefill_int8(q, k8, v8, ks, vs, table, block_size, start, head_dim**-0.5)
    want = kernels.prefill(q, dequantize_int8(k8, ks, torch.float32), dequantize_int8(v8, vs, torch.float32), table,
                           block_size, start, head_dim**-0.5)
    assert got.shape == (t, kv_heads * group, head_dim)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, 130])
def test_rope_in_place_is_transformers_arithmetic(rows: int, dtype: torch.dtype) -> None:
    """RoPE on the Q and K heads of QKV rows (V untouched), bit for bit as apply_rotary_pos_emb."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    kernels = load_native_kernels(64, 3)
    assert kernels is not None
    g = torch.Generator().manual_seed(rows)
    heads, kv_heads = 6, 2
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * 64, generator=g).to(dtype)
    angles = torch.randn(rows, 32, generator=g) * 10
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    q = qkv[:, : heads * 64].view(rows, heads, 64).transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
    k = qkv[:, heads * 64 : (heads + kv_heads) * 64].view(rows, kv_heads, 64).transpose(0, 1).unsqueeze(0)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos.unsqueeze(0), sin.unsqueeze(0))
    v = qkv[:, (heads + kv_heads) * 64 :].clone()
    kernels.rope_(qkv, heads + kv_heads, cos, sin)
    assert torch.equal(qkv[:, : heads * 64].view(rows, heads, 64), want_q[0].transpose(0, 1))
    assert torch.equal(qkv[:, heads * 64 : (heads + kv_heads) * 64].view(rows, kv_heads, 64), want_k[0].transpose(0, 1))
    assert torch.equal(qkv[:, (heads + kv_heads) * 64 :], v)
    with pytest.raises(ValueError):
        kernels.rope_(qkv, heads + kv_heads, cos[:, :32].contiguous(), sin[:, :32].contiguous())


@needs_compiler
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("rows", [1, 16, 130])
def test_silu_product_is_torchs_up_to_exp(dtype: torch.dtype, rows: int) -> None:
    """silu(gate) * up of gate_up rows, as F.silu(gate).mul_(up): fp32 within float rounding; bf16 with
    torch's roundings, so only a SiLU on a rounding boundary (another exp) can land one bf16 step away."""
    import torch.nn.functional as F

    kernels = load_native_kernels(64, 3)
    assert kernels is not None
    inter = 1536
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # exp's clamp, and zero
    want = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
    got = kernels.silu_mul(gate_up)
    assert got.shape == (rows, inter) and got.dtype == dtype and torch.isfinite(got).all()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert (got != want).float().mean() < 5e-3
        torch.testing.assert_close(got, want, rtol=2 ** -6, atol=1e-6)  # one SiLU step, then the rounding
    with pytest.raises(ValueError):
        kernels.silu_mul(gate_up[:, 1:])  # odd width, not contiguous


@needs_compiler
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_kv_write_is_index_copy(dtype: torch.dtype) -> None:
    """The new K/V rows of a QKV projection (strided views) land in their slots as index_copy_ puts them;
    layouts it does not take are refused with nothing written."""
    kernels = load_native_kernels(64, 3)
    assert kernels is not None
    heads, kv_heads, rows, num_slots = 9, 3, 20, 64
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * 64, generator=g).to(dtype)
    k_new = qkv[:, heads * 64:(heads + kv_heads) * 64].view(rows, kv_heads, 64)
    v_new = qkv[:, (heads + kv_heads) * 64:].view(rows, kv_heads, 64)
    slots = torch.randperm(num_slots, generator=g)[:rows]
    k_cache, v_cache = (torch.randn(num_slots, kv_heads, 64, generator=g).to(dtype) for _ in range(2))
    want_k, want_v = k_cache.clone().index_copy_(0, slots, k_new), v_cache.clone().index_copy_(0, slots, v_new)
    assert kernels.write_kv(k_cache, v_cache, slots, k_new, v_new)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    before = k_cache.clone()
    transposed = k_new.transpose(1, 2).contiguous().transpose(1, 2)  # heads not contiguous within a row
    assert not kernels.write_kv(k_cache, v_cache, slots, transposed, v_new)
    assert not kernels.write_kv(k_cache, v_cache, slots.int(), k_new, v_new)
    assert torch.equal(k_cache, before)
