"""The one-kernel-per-layer attention of packed steps (`attention.triton_varlen`, `cuda_attention="triton"`), run on
the CPU by Triton's interpreter: against a plain causal softmax per sequence, then in the runner's mixed steps,
beside the fixed-shape decode kernel and in fixed-shape prefill steps (`step_graphs.py`) against transformers.
Compiled for a GPU: test_triton_compile.py. Needs `scripts/install.sh --dev-all` (triton); conftest.py chooses
the interpreter where no GPU is.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import PreTrainedModel

from tests.runtime.test_decode_graphs import decodes_equal_transformers, runner_with_graphs
from tests.runtime.test_paged_runner import BLOCK, build, make_runner, mixed_batch_matches_forward, reference_logits
from tokenflow.kv.block_pool import BlockPool
from tokenflow.kv.kv_cache import KVCache
from tokenflow.runtime.attention import layer as attention_layer
from tokenflow.runtime.attention.triton_varlen import varlen_attention, varlen_step
from tokenflow.runtime.paged_runner import PagedModelRunner, SeqChunk
from tokenflow.runtime.step_graphs import StepGraphs


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sequences: list[tuple[int, int, list[int]]],
               scale: float) -> torch.Tensor:
    """fp32 causal softmax attention of each sequence's rows over its own keys, gathered by its table."""
    _, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k.shape
    out = torch.zeros(q.shape)
    row = 0
    for count, keys, table in sequences:
        used = -(-keys // block_size)
        k_seq = k[table[:used]].reshape(-1, kv_heads, head_dim)[:keys].float()
        v_seq = v[table[:used]].reshape(-1, kv_heads, head_dim)[:keys].float()
        for t in range(count):
            seen = keys - count + t + 1
            queries = q[row + t].float().view(kv_heads, num_heads // kv_heads, head_dim)
            probs = (torch.einsum("hgd,nhd->hgn", queries, k_seq[:seen]) * scale).softmax(-1)
            out[row + t] = torch.einsum("hgn,nhd->hgd", probs, v_seq[:seen]).reshape(num_heads, head_dim)
        row += count
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "dtype"), [
    (9, 3, 64, 16, torch.float32),  # SmolLM2's grouping
    (8, 2, 80, 12, torch.float32),  # a head width and a block size that are no powers of two
    (4, 4, 32, 16, torch.bfloat16),  # no grouping; bf16 as the GPU runs it
])
def test_every_row_equals_causal_softmax_over_its_sequence(heads: int, kv_heads: int, head_dim: int,
                                                           block_size: int, dtype: torch.dtype) -> None:
    """Decodes with 1, 17 and 40 keys, a prompt chunk from position 0, one after 40 cached keys, a short one;
    every slot no row may read is NaN (past each sequence's length, and every block it does not own)."""
    g = torch.Generator().manual_seed(0)
    num_blocks = 64
    k = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan")).to(dtype)
    v = k.clone()
    order = torch.randperm(num_blocks, generator=g).tolist()
    sequences, taken = [], 0
    for count, keys in [(1, 40), (1, 1), (1, 17), (37, 37), (20, 60), (5, 5)]:
        used = -(-keys // block_size)
        table = order[taken : taken + used]
        taken += used
        for values in (k, v):
            slots = values[table].reshape(-1, kv_heads, head_dim)
            slots[:keys] = torch.randn(keys, kv_heads, head_dim, generator=g).to(dtype)
            values[table] = slots.view(used, block_size, kv_heads, head_dim)
        sequences.append((count, keys, table))
    tokens = sum(c for c, _, _ in sequences)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # strided rows, as the fused layers pass them
    out = varlen_attention(q, k, v, varlen_step(sequences, block_size, torch.device("cpu")), 0.125)
    expected = _reference(q, k, v, sequences, 0.125)
    assert out.dtype == dtype and expected.isfinite().all()
    tolerance = 2e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def _counting_varlen(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return varlen_attention(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(attention_layer, "varlen_attention", counted)
    return calls


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_mixed_steps_through_the_kernel_equal_transformers(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's mixed steps (a prompt in chunks beside decoding sequences) with every layer's attention in the
    kernel, and the pointwise Triton kernels too, as `cuda_attention="triton"`, `cuda_triton_ops=True` run them:
    every sampled row equals transformers' forward (fp32). The load's self-check ran the kernel as well."""
    calls = _counting_varlen(monkeypatch)
    model = build(name)
    ref = copy.deepcopy(model)
    runner, pool = make_runner(model, native_kernels=False, triton_ops=True, triton_attention=True)
    assert calls  # the self-check at load
    calls.clear()
    mixed_batch_matches_forward(name, ref, runner, pool)
    assert len(calls) >= 2 * 6 and len(calls) % 2 == 0  # both layers of each of the 6+ steps


def test_prompts_through_the_kernel_and_decodes_through_the_graph_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both Triton attentions in one run: prompts through the varlen kernel (dynamic steps), decode steps at fixed
    shapes through the split decode kernel, as a CUDA-graph engine with `cuda_attention="triton"` runs them."""
    calls = _counting_varlen(monkeypatch)
    runner, pool, ref = runner_with_graphs(runner_options=dict(native_kernels=False, triton_attention=True),
                                           kernel="triton", programs=16)
    calls.clear()
    decodes_equal_transformers(runner, pool, ref)
    assert calls  # the prompts


def _runner_with_step_graphs(name: str, max_tokens: int, max_model_len: int = 512
                             ) -> tuple[PagedModelRunner, BlockPool, PreTrainedModel]:
    model = build(name)
    ref = copy.deepcopy(model)
    num_blocks = 96
    cache = KVCache.for_model(model.config, num_blocks=num_blocks + 1, block_size=BLOCK, dtype=torch.float32)
    runner = PagedModelRunner(model, cache, native_kernels=False, triton_attention=True, triton_ops=True)
    assert runner.fused is not None
    runner.step_graphs = StepGraphs(runner.fused, cache, runner.attention, max_seqs=4, max_tokens=max_tokens,
                                    max_model_len=max_model_len, scratch_block=num_blocks, capture=False)
    return runner, BlockPool(num_blocks, BLOCK), ref


def test_prefill_steps_at_fixed_shapes_equal_transformers() -> None:
    """The runner's mixed steps (a 37-token prompt in chunks of 10 beside sequences decoding) padded to token
    buckets of 16 and 32 and run at fixed shapes, as `cuda_graph_prefill_steps` replays them: every sampled row
    equals transformers' forward, so no padding token wrote where a sequence reads."""
    runner, pool, ref = _runner_with_step_graphs("llama", max_tokens=32)
    step_graphs = runner.step_graphs
    assert step_graphs is not None and step_graphs.buckets == [16, 32]
    mixed_batch_matches_forward("llama", ref, runner, pool)
    assert step_graphs.num_steps >= 6  # every step of it


def test_steps_past_the_buffers_take_the_dynamic_path() -> None:
    runner, pool, ref = _runner_with_step_graphs("llama", max_tokens=32)
    graphs = runner.step_graphs
    assert graphs is not None
    prompt = list(range(3, 43))
    logits = runner.execute([SeqChunk(prompt, 0, pool.allocate(10), True)])  # 40 tokens: the dynamic path
    torch.testing.assert_close(logits[0], reference_logits(ref, prompt)[-1], atol=1e-4, rtol=1e-4)
    assert graphs.num_steps == 0
    assert graphs.fits([SeqChunk(list(range(20)), 0, list(range(5)), True), SeqChunk([1], 7, [9, 10], True)])
    assert not graphs.fits([SeqChunk(list(range(33)), 0, list(range(9)), True)])  # past the largest bucket
    assert not graphs.fits([SeqChunk([1], i, [i // BLOCK], True) for i in range(5)])  # more sequences than 4
    assert not graphs.fits([SeqChunk(list(range(8)), 0, [0, 1], True, num_logits=8)])  # scores prompt tokens
    assert not graphs.fits([SeqChunk([1], 512, list(range(129)), True)])  # past max_model_len


def test_padding_longer_than_the_longest_context_stays_in_the_scratch_block() -> None:
    """`max_batch_tokens` past `max_model_len`: a step of 17 tokens pads to 32, so the padding sequence has more
    keys (15) than a real one may (8); its table row holds them all, and the three sequences' logits are
    transformers' (the capture's warm-up, all padding, too leaves their blocks alone)."""
    runner, pool, ref = _runner_with_step_graphs("llama", max_tokens=32, max_model_len=8)
    graphs = runner.step_graphs
    assert graphs is not None
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (8, 8, 1)]
    chunks = [SeqChunk(p, 0, pool.allocate(-(-len(p) // BLOCK)), True) for p in prompts]
    kv_before = [t.clone() for t in runner.kv_cache.k]
    with torch.inference_mode():
        graphs._stage([], 32)
        graphs._forward(32)  # what a capture's warm-up runs
    real = [b for c in chunks for b in c.block_table]
    assert all(torch.equal(a[real], b[real]) for a, b in zip(kv_before, runner.kv_cache.k))
    logits = runner.execute(chunks)
    assert graphs.num_steps == 1
    for row, prompt in zip(logits, prompts):
        torch.testing.assert_close(row, reference_logits(ref, prompt)[-1], atol=1e-4, rtol=1e-4)
