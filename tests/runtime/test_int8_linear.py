"""int8 linear layers: the VNNI kernel equals its torch-ops reference, and the int8 product stays close to
the float one."""

from __future__ import annotations

import pytest
import torch

from tokenflow.runtime.cpu.int8_linear import Int8Linear, load_int8_kernels, quantize_weight, reference_linear

kernels = load_int8_kernels()
needs_vnni = pytest.mark.skipif(kernels is None, reason="no AVX512-VNNI or no C compiler on this machine")


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("m", "k", "n"), [  # up to 4 rows: 64-channel tiles where n_pad allows (not 96)
    (1, 576, 960), (3, 64, 40), (2, 96, 96), (4, 576, 1000), (16, 1536, 576), (37, 100, 70), (512, 576, 96)])
def test_kernel_equals_its_reference(m: int, k: int, n: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    w = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g)
    x = (torch.randn(m, k, generator=g) * torch.linspace(0.1, 8.0, k)).to(dtype)  # outlier channels
    act_max = x.float().abs().amax(0)
    weight = quantize_weight(w, bias, act_max)
    got = Int8Linear(weight, kernels)(x)
    want = reference_linear(x, weight)
    assert got.shape == (m, n) and got.dtype == dtype
    # same integers, same scales; only the order of fp32 ops (and a tie in rounding) may differ
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-4,
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-4)


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 1536, 576), (5, 100, 70), (16, 64, 96), (64, 1536, 576), (300, 64, 96)])
def test_gated_down_projection_equals_silu_product_then_the_linear(m: int, k: int, n: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m + k + n)
    weight = quantize_weight(torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g),
                             torch.linspace(0.5, 4.0, k))
    gate_up = (torch.randn(m, 2 * k, generator=g) * 4).to(dtype)  # gates far into both tails of silu
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -30.0, 0.0, 1e-3, 30.0, 90.0, 200.0])
    layer = Int8Linear(weight, kernels)
    hidden = torch.nn.functional.silu(gate_up[:, :k]).mul_(gate_up[:, k:])  # the fused layers' torch ops
    got, want = layer.gated(gate_up), layer(hidden)
    assert got.shape == (m, n) and got.dtype == dtype and torch.isfinite(got).all()
    # the same rows up to the last bit of exp (a bf16 rounding, then an int8 code or an output's last bf16
    # bit, may flip here and there: 2^-9 of it); swapping gate and up, or dropping silu, is off by ~1
    error = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert error < (5e-3 if dtype == torch.bfloat16 else 1e-3), error
    strided = torch.cat([gate_up, gate_up], 1)[:, : 2 * k]  # not contiguous: the torch-ops fallback
    torch.testing.assert_close(layer.gated(strided), want)


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 576, 960), (7, 100, 70), (300, 576, 96)])
def test_normed_projection_equals_the_norm_then_the_linear(m: int, k: int, n: int, dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(m + k + n)
    weight = quantize_weight(torch.randn(n, k, generator=g) * 0.05, None, torch.linspace(0.5, 4.0, k))
    norm = LlamaRMSNorm(k, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k, generator=g) * 2)
    x = (torch.randn(m, k, generator=g) * torch.linspace(0.1, 30.0, k)).to(dtype)
    layer = Int8Linear(weight, kernels)
    with torch.no_grad():
        got, want = layer.normed(x, norm), layer(norm(x))  # transformers' own RMSNorm forward
    assert got.shape == (m, n) and got.dtype == dtype
    # the sum of squares in another order (a last bit of the norm, then an int8 code, may flip); a norm
    # missed or applied twice, or its weight dropped, is off by ~1
    error = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert error < (5e-3 if dtype == torch.bfloat16 else 1e-3), error


@needs_vnni
def test_int8_product_is_close_to_the_float_one() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g) * 0.05
    x = torch.randn(8, 512, generator=g) * torch.linspace(0.1, 8.0, 512)
    exact = x @ w.T
    for act_max in (None, x.abs().amax(0)):
        got = Int8Linear(quantize_weight(w, None, act_max), kernels)(x)
        err = ((got - exact).norm() / exact.norm()).item()
        assert err < 0.02, err


@needs_vnni
def test_rows_of_zeros_and_padding_give_exact_zeros() -> None:
    w = torch.randn(33, 10)
    weight = quantize_weight(w)
    x = torch.zeros(2, 10, dtype=torch.bfloat16)
    assert torch.equal(Int8Linear(weight, kernels)(x), torch.zeros(2, 33, dtype=torch.bfloat16))


def test_packing_round_trips() -> None:
    w = torch.randn(45, 19)
    weight = quantize_weight(w)
    assert weight.n_pad == 64 and weight.k_pad == 20 and weight.packed.shape == (4, 5, 16, 4)
    dequantized = weight.unpacked().float() * weight.scale[:45, None]
    torch.testing.assert_close(dequantized, w, atol=w.abs().max().item() / 127, rtol=0)
    assert torch.equal(weight.sums[:45], weight.unpacked().sum(1, dtype=torch.int32))
