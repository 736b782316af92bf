"""The few-rows linear kernel (tokenflow.runtime.cpu.few_rows_linear) against fp64 products and oneDNN."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenflow.runtime.cpu.few_rows_linear import FEW_ROWS, few_rows_linear, load_few_rows_kernels
from tokenflow.runtime.cpu.packed_linear import packed_linear

kernels = load_few_rows_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="this CPU has no AVX512 (the kernel's only target)")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(100, 64), (960, 576), (64, 96), (130, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_products_as_exact_as_torch_for_every_row_count(dtype: torch.dtype, n: int, k: int, bias: bool) -> None:
    if dtype not in kernels.dtypes:
        pytest.skip(f"no {dtype} kernel on this CPU")
    gen = torch.Generator().manual_seed(n * k)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    calls: list[int] = []
    linear = few_rows_linear(w, b, lambda x: calls.append(x.shape[0]) or F.linear(x, w, b))
    assert linear is not None
    for m in (1, 2, 5, 6, 7, 12, 13, 16, FEW_ROWS):  # the 6-row tile; bf16 tall passes from 7 to 12
        x = torch.randn(m, k, generator=gen).to(dtype)
        got, torch_out = linear(x), F.linear(x, w, b)
        assert got.shape == (m, n) and got.dtype == dtype
        want = _reference(x, w, b)
        err = ((got.double() - want).norm() / want.norm()).item()
        torch_err = ((torch_out.double() - want).norm() / want.norm()).item()
        # fp32: summation order only; bf16: the output's rounding (2^-9) dominates both
        assert err <= max(1.01 * torch_err, 1e-6 if dtype == torch.float32 else 2e-3), (m, err, torch_err)
    assert calls == []  # every row count up to FEW_ROWS ran in the kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_whatever_rows_share_its_product(dtype: torch.dtype) -> None:
    """Each row's output is bit for bit the same alone and among 2 .. FEW_ROWS rows (the 6-row tile, bf16's tall
    passes, bias and residual forms alike): a prompt's tokens get the same numbers in any batch."""
    if dtype not in kernels.dtypes:
        pytest.skip(f"no {dtype} kernel on this CPU")
    gen = torch.Generator().manual_seed(11)
    w = (torch.randn(200, 576, generator=gen) * 0.05).to(dtype)
    b = torch.randn(200, generator=gen).to(dtype)
    linear = few_rows_linear(w, b, lambda x: F.linear(x, w, b))
    assert linear is not None
    x = torch.randn(FEW_ROWS, 576, generator=gen).to(dtype)
    residual = torch.randn(FEW_ROWS, 200, generator=gen).to(dtype)
    alone = torch.cat([linear(x[i:i + 1]) for i in range(FEW_ROWS)])
    alone_added = torch.cat([linear.add_to(x[i:i + 1], residual[i:i + 1]) for i in range(FEW_ROWS)])
    for m in (2, 6, 7, 9, 12, 13, 17, FEW_ROWS):
        assert torch.equal(linear(x[:m]), alone[:m]), m
        assert torch.equal(linear.add_to(x[:m], residual[:m]), alone_added[:m]), m


def test_more_rows_and_other_inputs_take_the_fallback() -> None:
    dtype = next(iter(kernels.dtypes))
    w = torch.randn(70, 32).to(dtype)
    calls: list[tuple[int, ...]] = []

    def fallback(x: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return F.linear(x.to(w.dtype), w)

    linear = few_rows_linear(w, None, fallback)
    assert linear is not None
    linear(torch.randn(FEW_ROWS + 1, 32).to(dtype))
    linear(torch.randn(2, 3, 32).to(dtype))  # not a plain batch of rows
    other = torch.float64
    linear(torch.randn(2, 32, dtype=other))
    linear.enabled = False
    linear(torch.randn(1, 32).to(dtype))
    assert calls == [(FEW_ROWS + 1, 32), (2, 3, 32), (2, 32), (1, 32)]


def test_a_non_contiguous_input_is_read_as_its_values() -> None:
    dtype = next(iter(kernels.dtypes))
    w = torch.randn(64, 32).to(dtype)
    linear = few_rows_linear(w, None, lambda x: F.linear(x, w))
    x = torch.randn(32, 6).to(dtype).T  # [6, 32], strided
    assert torch.allclose(linear(x).double(), _reference(x, w, None), rtol=1e-2, atol=1e-2)


def test_where_the_kernel_does_not_apply() -> None:
    assert few_rows_linear(torch.randn(8, 8, dtype=torch.float64), None, F.linear) is None
    if torch.bfloat16 in kernels.dtypes:
        assert few_rows_linear(torch.randn(8, 7).bfloat16(), None, F.linear) is None  # odd k: pairs of bf16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_results_as_onednn_up_to_summation_order(dtype: torch.dtype) -> None:
    """What the engine swaps: oneDNN's packed product for the kernel, on a decode step's row counts."""
    packed = packed_linear(torch.zeros(1, 1, dtype=dtype), None)
    if dtype not in kernels.dtypes or packed is None:
        pytest.skip(f"no {dtype} kernel or oneDNN packing here")
    w = (torch.randn(576, 1536) * 0.05).to(dtype)
    onednn = packed_linear(w, None)
    linear = few_rows_linear(w, None, onednn)
    for m in (1, 16):
        x = torch.randn(m, 1536).to(dtype)
        a, b = linear(x).double(), onednn(x).double()
        assert ((a - b).norm() / b.norm()).item() < (1e-6 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_add_is_the_separate_add_bit_for_bit(dtype: torch.dtype) -> None:
    """`add_to(x, residual)` adds as the kernel stores: the product rounded to the dtype, then the add, as
    `residual + linear(x)`; rows the kernel does not take add after the fallback."""
    if dtype not in kernels.dtypes:
        pytest.skip(f"no {dtype} kernel on this CPU")
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(130, 96, generator=gen) * 0.05).to(dtype)
    b = torch.randn(130, generator=gen).to(dtype)
    linear = few_rows_linear(w, b, lambda x: F.linear(x, w, b))
    assert linear is not None
    for m in (1, 7, FEW_ROWS, FEW_ROWS + 3):
        x = torch.randn(m, 96, generator=gen).to(dtype)
        residual = torch.randn(m, 130, generator=gen).to(dtype) * 4
        got = linear.add_to(x, residual)
        assert torch.equal(got, residual + linear(x)), m
        assert got.data_ptr() != residual.data_ptr()


@pytest.mark.parametrize(("n", "k"), [(100, 64), (960, 576), (130, 1536), (64, 96)])
def test_tiles_are_as_exact_as_the_register_tile_and_add_residuals_alike(n: int, k: int) -> None:
    """`tiles` (decode-only steps): AMX tiles past a few bf16 rows where the CPU has them, the register tile
    elsewhere (k not a multiple of 32, fewer rows, no AMX). Same accuracy against fp64 either way, and the
    residual form is the separate add's roundings on both."""
    if torch.bfloat16 not in kernels.dtypes:
        pytest.skip("no bf16 kernel on this CPU")
    gen = torch.Generator().manual_seed(k)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    linear = few_rows_linear(w, b, lambda x: F.linear(x, w, b))
    assert linear is not None
    for m in (1, 4, 5, 16, 17, 40, FEW_ROWS):
        x = torch.randn(m, k, generator=gen).bfloat16()
        residual = torch.randn(m, n, generator=gen).bfloat16()
        linear.tiles = False
        plain = linear(x)
        linear.tiles = True
        tiled = linear(x)
        want = _reference(x, w, b)
        errors = [((y.double() - want).norm() / want.norm()).item() for y in (plain, tiled)]
        assert errors[1] <= max(1.01 * errors[0], 2e-3), (m, errors)
        assert torch.equal(linear.add_to(x, residual), residual + tiled), m
        if m <= 4 or k % 32 or not kernels.has_tiles:
            assert torch.equal(tiled, plain), m  # the register tile ran both
