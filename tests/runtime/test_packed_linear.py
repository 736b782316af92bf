"""oneDNN-packed linear layers give what `F.linear` gives, at every row count, and leave the
model's parameters alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenflow.runtime.cpu.packed_linear import (
    PackedGatedMLP,
    PackedLinear,
    pack_linears,
    packed_dtypes,
    packing_available,
    post_ops_available,
)

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


@pytest.mark.skipif(not post_ops_available(), reason="this torch build's packed linear has no post-ops")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_post_op_mlp_and_residual_projection_are_the_separate_ops(dtype: torch.dtype) -> None:
    """`PackedGatedMLP` is residual + down(silu(gate(x)) * up(x)) and `PackedLinear.add_to` residual + x W^T:
    fp32 equal to the separate ops up to oneDNN's exp; bf16 no further from the exact (fp64) result than
    transformers' separate ops, which round the gate, its SiLU, the up projection and the product each."""
    if dtype not in packed_dtypes():
        pytest.skip("oneDNN has no bf16 path on this CPU")
    torch.manual_seed(0)
    hidden, inter, rows = 96, 160, 200
    gate, up, down = (torch.randn(*shape) * 0.1 for shape in ((inter, hidden), (inter, hidden), (hidden, inter)))
    x, residual = torch.randn(rows, hidden), torch.randn(rows, hidden)

    def separate(t: torch.dtype) -> torch.Tensor:
        xs, rs = x.to(t), residual.to(t)
        return rs + F.linear(F.silu(F.linear(xs, gate.to(t))) * F.linear(xs, up.to(t)), down.to(t))

    exact_mlp = (residual.double() + F.linear(F.silu(F.linear(x.double(), gate.double()))
                                              * F.linear(x.double(), up.double()), down.double()))
    with torch.inference_mode():
        got_mlp = PackedGatedMLP(gate.to(dtype), up.to(dtype), down.to(dtype))(x.to(dtype), residual.to(dtype))
        square = torch.randn(hidden, hidden) * 0.1
        got_add = PackedLinear(square.to(dtype)).add_to(x.to(dtype), residual.to(dtype))
        want_add = residual.to(dtype) + F.linear(x.to(dtype), square.to(dtype))
        want_mlp = separate(dtype)
        gate_up = PackedGatedMLP(gate.to(dtype), up.to(dtype), down.to(dtype)).gate_up(x.to(dtype))
    assert got_mlp.dtype == got_add.dtype == dtype and got_mlp.shape == got_add.shape == (rows, hidden)
    torch.testing.assert_close(gate_up, torch.cat((F.linear(x.to(dtype), gate.to(dtype)),
                                                   F.linear(x.to(dtype), up.to(dtype))), dim=-1),
                               rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(got_mlp, want_mlp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_add, want_add, rtol=1e-5, atol=1e-5)
        return
    error = (got_mlp.double() - exact_mlp).norm() / exact_mlp.norm()
    separate_error = (want_mlp.double() - exact_mlp).norm() / exact_mlp.norm()
    assert error <= 1.05 * separate_error, (error, separate_error)
    assert error < 1e-2
    torch.testing.assert_close(got_add, want_add, rtol=2e-2, atol=2e-2)
