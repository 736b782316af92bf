"""GGUF's ggml blocks on CPU (tokenflow.runtime.cpu.gguf_linear): dequantised exactly as the `gguf` package
(llama.cpp's own Python reader) dequantises them, and products as exact as torch's on those values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from tokenflow.runtime.cpu.gguf_linear import (
    DENSE_FORMATS,
    FEW_ROWS,
    FORMATS,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    StackedLinear,
    load_gguf_kernels,
)
from tokenflow.testing import random_ggml_blocks

kernels = load_gguf_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler (or another OpenMP runtime) here")

def random_blocks(format: int, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    """A `[n, k]` weight of random blocks of `format` (`tokenflow.testing.random_ggml_blocks`; the dense formats
    random normal values)."""
    name = FORMATS[format][0]
    if format in DENSE_FORMATS:
        w = torch.from_numpy(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05)
        dense = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
        return QuantizedWeight(w.to(dense).view(torch.uint8).reshape(n, -1).contiguous(), format, n, k)
    return QuantizedWeight(torch.from_numpy(random_ggml_blocks(name, n, k, seed)), format, n, k)


def reference(weight: QuantizedWeight) -> torch.Tensor:
    """The `gguf` package's dequantisation (fp32)."""
    qtype = GGMLQuantizationType(weight.format)
    values = quants.dequantize(weight.data.numpy(), qtype)
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(weight.n, weight.k)


@pytest.fixture
def float_rows():
    """The float tiles at every row count (bf16 rows against Q4_K / Q6_K otherwise go through int8 and VNNI)."""
    kernels.int8_rows = False
    yield
    kernels.int8_rows = True


FORMAT_IDS = sorted(FORMATS)
QUANTIZED_IDS = sorted(set(FORMATS) - DENSE_FORMATS)


@pytest.mark.parametrize("format", FORMAT_IDS, ids=[FORMATS[f][0] for f in FORMAT_IDS])
def test_dequantised_exactly_as_the_gguf_package(format: int) -> None:
    weight = random_blocks(format, 7, 512, seed=format)
    want = reference(weight)
    assert torch.equal(kernels.dequantize(weight, torch.float32), want)
    assert torch.equal(kernels.dequantize(weight, torch.bfloat16), want.bfloat16())
    ids = torch.tensor([6, 0, 6, 3])  # an embedding's lookup: rows in any order, repeated
    assert torch.equal(kernels.dequantize(weight, torch.float32, ids), want[ids])
    with pytest.raises(IndexError):
        kernels.dequantize(weight, torch.float32, torch.tensor([7]))


@pytest.mark.skipif(kernels is None or not kernels.has_few_rows, reason="the few-rows kernel needs AVX-512")
@pytest.mark.parametrize("format", QUANTIZED_IDS, ids=[FORMATS[f][0] for f in QUANTIZED_IDS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_products_as_exact_as_torch(format: int, dtype: torch.dtype, float_rows: None) -> None:
    n, k = 37, 768  # n not a multiple of the kernel's four weight rows
    weight = random_blocks(format, n, k, seed=format + 1)
    dense = reference(weight)
    gen = torch.Generator().manual_seed(format)
    assert kernels.few_rows(torch.empty(0, k, dtype=dtype), weight, torch.empty(0, n, dtype=dtype))  # no rows
    for m in (1, 3, 4, 5, FEW_ROWS):
        x = torch.randn(m, k, generator=gen).to(dtype)
        out = torch.empty(m, n, dtype=dtype)
        assert kernels.few_rows(x, weight, out)
        want = x.double() @ dense.double().T
        torch_err = ((F.linear(x.float(), dense).to(dtype).double() - want).norm() / want.norm()).item()
        err = ((out.double() - want).norm() / want.norm()).item()
        # fp32: summation order only; bf16: the output's rounding (2^-9), as torch's
        assert err <= max(1.01 * torch_err, 1e-6 if dtype == torch.float32 else 3e-3), (m, err, torch_err)


def int8_rows_reference(x: torch.Tensor, block: int = 256) -> torch.Tensor:
    """x's rows as the int8 path sees them: per `block` values (256 for the K-quants as Q8_K, 32 for Q8_0),
    q = round(x * 127 / max|x|), then q * max|x| / 127."""
    blocks = x.float().reshape(x.shape[0], -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse)
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


@pytest.mark.skipif(kernels is None or not kernels.has_int8_rows, reason="the int8 rows need AVX512-VNNI")
@pytest.mark.parametrize("format", [int(GGMLQuantizationType.Q4_K), int(GGMLQuantizationType.Q6_K),
                                    int(GGMLQuantizationType.Q8_0)], ids=["Q4_K", "Q6_K", "Q8_0"])
def test_bf16_rows_against_k_quants_and_q8_0_run_in_int8(format: int) -> None:
    """Up to 16 bf16 rows against Q4_K / Q6_K / Q8_0: the rows quantised to int8 as llama.cpp does for each (per 256
    values, Q8_K; per 32, Q8_0), the products exact on those values (but for fp32 sums and the bf16 output), within
    1.5% of the bf16 rows' own; more rows and fp32 rows keep the float tiles."""
    n, k = 37, 1024
    block = 32 if format == GGMLQuantizationType.Q8_0 else 256
    weight = random_blocks(format, n, k, seed=format + 7)
    dense = reference(weight).double()
    gen = torch.Generator().manual_seed(format)
    for m in (1, 2, 3, 4, 5, 11, 16, 17):
        x = (torch.randn(m, k, generator=gen) * torch.rand(m, k, generator=gen) * 3).bfloat16()
        x[0, :256] = 0  # a block of zeros: scale 0, no division by it
        out = torch.empty(m, n, dtype=torch.bfloat16)
        assert kernels.few_rows(x, weight, out)
        exact = x.double() @ dense.T
        err = ((out.double() - exact).norm() / exact.norm()).item()
        on_int8 = ((out.double() - int8_rows_reference(x, block) @ dense.T).norm() / exact.norm()).item()
        if m <= 16:
            assert on_int8 < 3e-3 and 1e-3 < err < 1.5e-2, (m, on_int8, err)  # int8 rows: their own rounding
        else:
            assert err < 3e-3, (m, err)  # float tiles
    x = torch.randn(2, k, generator=gen)
    out = torch.empty(2, n)
    assert kernels.few_rows(x, weight, out)
    exact = x.double() @ dense.T
    assert ((out.double() - exact).norm() / exact.norm()).item() < 1e-6  # fp32 rows: exact products


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modules_over_blocks_match_dense_modules(dtype: torch.dtype, float_rows: None) -> None:
    """QuantizedLinear (every row count: the few-rows kernel and the dequantised product), a stacked QKV of
    three formats with a bias, and the embedding, against torch's modules over the dequantised weights."""
    q8, q4k, q6k = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K)
    parts = [random_blocks(int(f), n, 512, seed=n) for f, n in ((q8, 64), (q4k, 32), (q6k, 32))]
    bias = torch.randn(32)
    modules = [QuantizedLinear(p, kernels, dtype, bias if i == 2 else None) for i, p in enumerate(parts)]
    assert modules[0].weight.shape == (64, 512) and modules[0].weight.untyped_storage().nbytes() <= 4
    stacked = StackedLinear(modules)
    dense_w = torch.cat([reference(p) for p in parts]).to(dtype)
    dense_b = torch.cat([torch.zeros(96), bias]).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 5e-3  # bf16: the outputs' rounding, summed in another order

    def error(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got.double() - want.double()).norm() / want.double().norm()).item()

    assert stacked(torch.empty(0, 512, dtype=dtype)).shape == (0, 128)  # a step that samples no row
    for m in (1, FEW_ROWS, FEW_ROWS + 1, 70):
        x = torch.randn(m, 512).to(dtype)
        assert error(stacked(x), F.linear(x, dense_w, dense_b)) < tol
        got = modules[1](x.view(1, m, 512))
        assert got.shape == (1, m, 32) and error(got, F.linear(x, dense_w[64:96]).view(1, m, 32)) < tol
    embedding = QuantizedEmbedding(parts[0], kernels, dtype)
    ids = torch.tensor([[3, 63, 3]])
    assert torch.equal(embedding(ids), reference(parts[0]).to(dtype)[ids])


def test_a_format_or_width_the_kernel_does_not_take_is_refused() -> None:
    weight = random_blocks(int(GGMLQuantizationType.Q4_K), 2, 256)
    odd = QuantizedWeight(weight.data, weight.format, 2, 512)  # rows hold 256 values, not 512
    with pytest.raises(ValueError, match="refused"):
        kernels.dequantize(odd, torch.float32)
    assert not kernels.few_rows(torch.randn(1, 512), odd, torch.empty(1, 2))
    for dense in DENSE_FORMATS:  # F32, F16, BF16 load as plain tensors: the few-rows kernel does not take them
        assert not kernels.few_rows(torch.randn(1, 64), random_blocks(dense, 2, 64), torch.empty(1, 2))
    unknown = QuantizedWeight(weight.data, 99, 2, 256)
    with pytest.raises(ValueError, match="refused"):
        kernels.dequantize(unknown, torch.float32)
