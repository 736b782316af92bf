"""oneDNN-packed linear layers give what `F.linear` gives, at every row count, and leave the
model's parameters alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenflow.runtime.cpu.packed_linear import pack_linears, packed_dtypes, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_for_any_row_count(bias: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 160, bias=bias), torch.nn.Linear(160, 48, bias=bias)).to(dtype)
    plain = [(m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone()) for m in model]
    # bf16 is packed only where oneDNN has a bf16 path (AVX512 or AVX-NE-CONVERT); elsewhere it stays plain
    assert pack_linears(model) == (2 if dtype in packed_dtypes() else 0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: a different summation order rounds differently
    with torch.inference_mode():
        for rows in (1, 2, 7, 16, 129, 600):
            x = torch.randn(1, rows, 96, dtype=dtype)
            want = F.linear(F.linear(x, *plain[0]), *plain[1])
            got = model(x)
            assert got.shape == want.shape == (1, rows, 48)
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        # A non-contiguous input (a strided view) is handled too.
        x = torch.randn(40, 2, 96, dtype=dtype)[:, 0]
        torch.testing.assert_close(model(x), F.linear(F.linear(x, *plain[0]), *plain[1]),
                                   rtol=tol, atol=tol)
    for m, (w, b) in zip(model, plain, strict=True):
        assert torch.equal(m.weight, w) and (b is None or torch.equal(m.bias, b))


def test_only_plain_fp32_and_bf16_cpu_linears_are_packed() -> None:
    class MyLinear(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), MyLinear(8, 8), torch.nn.Linear(8, 8).to(torch.float16))
    assert pack_linears(model) == 1
    assert "forward" in vars(model[0]) and "forward" not in vars(model[1]) and "forward" not in vars(model[2])
