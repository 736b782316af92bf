"""`fuse_rms_norms` leaves every logit bit-identical, in fp32 and bf16, and touches nothing else;
with the native kernels, norms within one bf16 rounding (fp32: float rounding) of transformers' own."""

from __future__ import annotations

import shutil
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenflow.runtime.cpu.native_kernels import load_native_kernels
from tokenflow.runtime.cpu.rms_norm import fuse_rms_norms
from tokenflow.testing import tiny_config


def _model(arch: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config(arch, hidden_size=256, intermediate_size=512, num_attention_heads=4)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():  # norm weights start as ones, which would hide how the weight is applied
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.5)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("arch", "norms"), [("llama", 5), ("qwen2", 5), ("qwen3", 9), ("mistral", 5)])
def test_fused_rms_norm_logits_are_bit_identical(arch: str, norms: int, dtype: torch.dtype) -> None:
    model = _model(arch, dtype)
    ids = torch.randint(3, 500, (2, 37))
    with torch.inference_mode():
        want = model(ids).logits
        assert fuse_rms_norms(model) == norms  # 2 per layer + the final one (+ q/k norms per layer in Qwen3)
        got = model(ids).logits
    assert torch.equal(got, want)


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("cc") is None,
                    reason="the native kernels build on Linux with a C compiler (elsewhere norms stay on torch ops)")
@pytest.mark.parametrize(("arch", "norms"), [("llama", 5), ("qwen3", 9)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_rms_norm_is_transformers_arithmetic(arch: str, norms: int, dtype: torch.dtype) -> None:
    """Each norm module against its own HF forward on the same inputs: bf16 mostly the very same
    numbers, the rest a rounding step apart (the sum of squares runs in another order); fp32 equal
    to float rounding."""
    kernels = load_native_kernels(64, 1)
    assert kernels is not None  # where a compiler exists, a failed build must not pass unnoticed
    model = _model(arch, dtype)
    modules = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    g = torch.Generator().manual_seed(1)
    inputs = [(torch.randn(3, 7, m.weight.shape[0], generator=g) * 3).to(dtype) for m in modules]
    with torch.inference_mode():
        want = [m(x) for m, x in zip(modules, inputs)]
        assert fuse_rms_norms(model, kernels) == norms
        got = [m(x) for m, x in zip(modules, inputs)]
        got_strided = modules[0](inputs[0].transpose(0, 1).contiguous().transpose(0, 1))  # torch path fallback
    for a, b in zip(got, want):
        assert a.dtype == dtype and a.shape == b.shape
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            continue
        assert (a == b).float().mean() > 0.95
        two_ulps = 2.0**-6 * b.float().abs()  # at least one bf16 step at |b|, at most two
        assert ((a.float() - b.float()).abs() <= two_ulps).all()
    assert torch.equal(got_strided, want[0])  # a non-contiguous input takes the bit-identical torch path


def test_other_norms_keep_their_forward() -> None:
    class OtherRMSNorm(torch.nn.Module):  # same shape, a class not known to compute the same thing
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))
            self.variance_epsilon = 1e-6

    model = torch.nn.Sequential(OtherRMSNorm(), torch.nn.LayerNorm(8))
    assert fuse_rms_norms(model) == 0
    assert not any("forward" in vars(m) for m in model.modules())
