"""The GPU path's pointwise Triton kernels (`gpu.triton_pointwise`, `cuda_triton_ops`), run on the CPU by Triton's
interpreter: each against the torch ops it replaces (bf16 bit for bit on the interpreter: the kernels round where
those ops round; a GPU's fast exp and rsqrt may move the last bit),
then inside the fused layers against transformers. Compiling them for a GPU: test_triton_compile.py. Needs
`scripts/install.sh --dev-all` (triton); conftest.py chooses the interpreter where no GPU is.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.runtime.test_paged_runner import build, make_runner, mixed_batch_matches_forward
from tokenflow.runtime.cpu.rms_norm import fuse_rms_norms
from tokenflow.runtime.gpu.triton_pointwise import TritonPointwise

HEAD_DIM = 64
DTYPES = [torch.float32, torch.bfloat16]


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    # fp32: a sum in another order (the norm's mean of squares) or exp's last bit; bf16: the same bits
    return {"atol": 2e-6, "rtol": 2e-6} if dtype == torch.float32 else {"atol": 0.0, "rtol": 0.0}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 4096])  # four rows a program, and one
def test_rms_norm_is_transformers_norm(dtype: torch.dtype, width: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, width, generator=g).to(dtype)  # 7 rows: the last program's rows partly past the end
    weight = (torch.rand(width, generator=g) + 0.5).to(dtype)
    if dtype == torch.float32:
        want = F.rms_norm(x, (width,), weight, 1e-5)
    else:  # transformers: the fp32 norm rounded to bf16, then times the weight
        want = weight * F.rms_norm(x.float(), (width,), None, 1e-5).to(dtype)
    torch.testing.assert_close(TritonPointwise(HEAD_DIM).rms_norm(x, weight, 1e-5), want, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 4096])
def test_residual_add_and_norm_are_transformers_two_steps(dtype: torch.dtype, width: int) -> None:
    g = torch.Generator().manual_seed(6)
    x, residual = (torch.randn(7, width, generator=g).to(dtype) for _ in range(2))
    weight = (torch.rand(width, generator=g) + 0.5).to(dtype)
    total, normed = TritonPointwise(HEAD_DIM).add_rms_norm(x, residual, weight, 1e-5)
    want_total = residual + x  # transformers' residual add, rounded to the dtype
    assert torch.equal(total, want_total)
    if dtype == torch.float32:
        want = F.rms_norm(want_total, (width,), weight, 1e-5)
    else:
        want = weight * F.rms_norm(want_total.float(), (width,), None, 1e-5).to(dtype)
    torch.testing.assert_close(normed, want, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_norms_touch_only_their_heads(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    heads, rows = 9, 5
    qkv = torch.randn(rows, (heads + 6) * HEAD_DIM, generator=g).to(dtype)
    weight = (torch.rand(HEAD_DIM, generator=g) + 0.5).to(dtype)
    got = qkv.clone()
    TritonPointwise(HEAD_DIM).head_rms_norm_(got, heads, weight, 1e-6)
    per_head = qkv[:, : heads * HEAD_DIM].view(rows, heads, HEAD_DIM)
    if dtype == torch.float32:
        want = F.rms_norm(per_head, (HEAD_DIM,), weight, 1e-6)
    else:
        want = weight * F.rms_norm(per_head.float(), (HEAD_DIM,), None, 1e-6).to(dtype)
    torch.testing.assert_close(got[:, : heads * HEAD_DIM].view(rows, heads, HEAD_DIM), want, **_tolerance(dtype))
    assert torch.equal(got[:, heads * HEAD_DIM :], qkv[:, heads * HEAD_DIM :])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_is_transformers_rotation_on_q_and_k_only(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, rows = 9, 3, 6
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * HEAD_DIM, generator=g).to(dtype)
    cos, sin = torch.randn(rows, HEAD_DIM, generator=g).to(dtype), torch.randn(rows, HEAD_DIM, generator=g).to(dtype)
    got = qkv.clone()
    TritonPointwise(HEAD_DIM).rope_(got, heads + kv_heads, cos, sin)
    end = (heads + kv_heads) * HEAD_DIM
    qk = qkv[:, :end].view(rows, heads + kv_heads, HEAD_DIM)
    half = HEAD_DIM // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)  # transformers' rotate_half
    want = qk * cos[:, None] + rotated * sin[:, None]
    torch.testing.assert_close(got[:, :end].view(rows, heads + kv_heads, HEAD_DIM), want, **_tolerance(dtype))
    assert torch.equal(got[:, end:], qkv[:, end:])  # V untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_product_is_torchs(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    gate_up = (3 * torch.randn(5, 2 * 1536, generator=g)).to(dtype)  # 1536: two column programs of 1024
    want = F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    torch.testing.assert_close(TritonPointwise(HEAD_DIM).silu_mul(gate_up), want, **_tolerance(dtype))


def test_kv_write_lands_in_its_slots_only() -> None:
    g = torch.Generator().manual_seed(4)
    heads, kv_heads, rows = 9, 3, 7
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * HEAD_DIM, generator=g).to(torch.bfloat16)
    k = qkv[:, heads * HEAD_DIM : (heads + kv_heads) * HEAD_DIM].view(rows, kv_heads, HEAD_DIM)
    v = qkv[:, (heads + kv_heads) * HEAD_DIM :].view(rows, kv_heads, HEAD_DIM)
    k_cache, v_cache = (torch.zeros(40, kv_heads, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
    slots = torch.tensor([3, 9, 0, 39, 17, 5, 6])
    assert TritonPointwise(HEAD_DIM).write_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v)
    others = torch.ones(40, dtype=torch.bool)
    others[slots] = False
    assert not k_cache[others].any() and not v_cache[others].any()
    assert not TritonPointwise(HEAD_DIM).write_kv(k_cache, v_cache, slots, k.float(), v.float())  # dtype differs


def test_refuses_what_it_does_not_compute() -> None:
    ops = TritonPointwise(HEAD_DIM)
    with pytest.raises(ValueError, match="bf16 or fp32"):
        ops.rms_norm(torch.zeros(2, 64, dtype=torch.float16), torch.ones(64, dtype=torch.float16), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        ops.rms_norm(torch.zeros(64, 2).t(), torch.ones(64), 1e-5)
    with pytest.raises(ValueError, match="cos, sin"):
        ops.rope_(torch.zeros(2, 4 * HEAD_DIM), 2, torch.zeros(2, HEAD_DIM), torch.zeros(3, HEAD_DIM))
    with pytest.raises(ValueError, match="even width"):
        ops.silu_mul(torch.zeros(2, 7))


@pytest.mark.parametrize("name", ["llama", "qwen3"])  # qwen3: the Q and K head norms
def test_fused_layers_with_the_kernels_equal_transformers(name: str) -> None:
    """The runner's fused layers with every pointwise kernel in place of torch ops (norms, head norms, RoPE,
    SiLU product, K/V writes), in mixed prefill and decode steps, against the model's own forward (fp32)."""
    model = build(name)
    ref = copy.deepcopy(model)
    runner, pool = make_runner(model, native_kernels=False, triton_ops=True)
    assert runner.pointwise is not None and runner.fused is not None and runner.fused.pointwise is runner.pointwise
    assert runner.attention.native_write is runner.pointwise
    calls: dict[str, int] = {}
    assert runner.fused.fused_adds  # plain RMSNorms around attention and MLP: each residual add with its norm
    for op in ("rms_norm", "add_rms_norm", "head_rms_norm_", "rope_", "silu_mul", "write_kv"):
        kernel = getattr(runner.pointwise, op)

        def counted(*args: object, _op: str = op, _kernel: object = kernel) -> object:
            calls[_op] = calls.get(_op, 0) + 1
            return _kernel(*args)  # type: ignore[operator]

        setattr(runner.pointwise, op, counted)
    fuse_rms_norms(model, runner.pointwise)  # as the backend routes the model's norms
    mixed_batch_matches_forward(name, ref, runner, pool)
    expected = {"rms_norm", "add_rms_norm", "rope_", "silu_mul", "write_kv"} | (
        {"head_rms_norm_"} if name == "qwen3" else set())
    assert expected <= set(calls), calls
    assert calls["add_rms_norm"] == 2 * calls["rope_"]  # two a layer (after attention, after the MLP)


def test_the_model_norms_run_the_kernel_when_given() -> None:
    """`fuse_rms_norms` with the Triton ops (as the backend passes them on CUDA) routes the model's norms to its
    kernel; their output is transformers'."""
    model = build("llama", torch.bfloat16)
    ref = copy.deepcopy(model)
    ops = TritonPointwise(16)
    used = []
    kernel = ops.rms_norm
    ops.rms_norm = lambda *args: used.append(1) or kernel(*args)  # type: ignore[method-assign]
    assert fuse_rms_norms(model, ops) == 2 * 2 + 1
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(model.model.norm(x), ref.model.norm(x)) and used
