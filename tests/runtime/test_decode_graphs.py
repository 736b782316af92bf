"""DecodeGraphs: decode steps at fixed (batch, context) shapes, as CUDA graphs replay them.

On the CPU the fixed-shape path runs eagerly (`capture=False`): the same tensors, padding and masks a
graph records, so its arithmetic is checked here against transformers' forward; the capture itself
runs only on CUDA (scripts/gpu_check.py).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from tests.runtime.test_paged_runner import BLOCK, Seq, build, reference_logits
from tokenflow.kv.block_pool import BlockPool
from tokenflow.kv.kv_cache import KVCache
from tokenflow.params import SamplingParams
from tokenflow.protocols import DeviceTokens, PendingTokens
from tokenflow.runtime.decode_graphs import MIN_CONTEXT_BLOCKS, DecodeGraphs, context_buckets
from tokenflow.runtime.device_sampler import variant_of
from tokenflow.runtime.paged_runner import PagedModelRunner, SeqChunk
from tokenflow.runtime.sampler import Sampler, SamplingRow, make_generator


def test_context_buckets() -> None:
    assert context_buckets(128) == [8, 16, 32, 64, 128]
    assert context_buckets(100) == [8, 16, 32, 64, 100]
    assert context_buckets(5) == [5]


def runner_with_graphs(name: str = "llama", num_blocks: int = 96, runner_options: dict[str, Any] | None = None,
                       **graph_options: Any) -> tuple[PagedModelRunner, BlockPool, torch.nn.Module]:
    model = build(name)
    ref = copy.deepcopy(model)
    cache = KVCache.for_model(model.config, num_blocks=num_blocks + 1, block_size=BLOCK, dtype=torch.float32)
    runner = PagedModelRunner(model, cache, **(runner_options or {}))
    assert runner.fused is not None
    runner.graphs = DecodeGraphs(runner.fused, cache, batch_sizes=[1, 2, 4, 8], max_model_len=512,
                                 scratch_block=num_blocks, capture=False, attention=runner.attention, vocab_size=256,
                                 **graph_options)
    return runner, BlockPool(num_blocks, BLOCK), ref


def test_fixed_shape_decodes_equal_transformers_across_buckets() -> None:
    decodes_equal_transformers(*runner_with_graphs())


def decodes_equal_transformers(runner: PagedModelRunner, pool: BlockPool, ref: torch.nn.Module) -> None:
    """Five sequences decode side by side from prompts of 3 to 70 tokens, so the batch is padded (5 -> 8,
    later fewer) and contexts cross block boundaries and the 8-block context bucket."""
    graphs = runner.graphs
    assert graphs is not None
    g = torch.Generator().manual_seed(3)
    lengths = [3, 17, 31, 45, 70]
    full = [torch.randint(0, 256, (n + 24,), generator=g).tolist() for n in lengths]
    refs = [reference_logits(ref, tokens) for tokens in full]
    seqs = [Seq(tokens[:n]) for tokens, n in zip(full, lengths)]
    runner.execute([s.chunk(pool, 128) for s in seqs])  # the prompts, through the dynamic path
    for s, tokens in zip(seqs, full):
        s.tokens.append(tokens[len(s.tokens)])
    compared = 0
    for step in range(23):
        active = [i for i in range(len(seqs)) if step < 23 - 4 * (i % 2)]  # odd ones stop early: 5 -> 3 rows
        chunks = [seqs[i].chunk(pool, 1) for i in active]
        assert graphs.fits(chunks)
        logits = runner.execute(chunks)
        assert logits.shape == (len(chunks), 256)
        for row, i, c in zip(logits, active, chunks):
            torch.testing.assert_close(row, refs[i][c.start_pos], atol=1e-4, rtol=1e-4, msg=f"seq {i} step {step}")
            seqs[i].tokens.append(full[i][len(seqs[i].tokens)])
            compared += 1
    assert compared == 23 * 3 + 19 * 2
    assert max(len(s.blocks) for s in seqs) > MIN_CONTEXT_BLOCKS  # a larger context bucket was used


def test_padding_rows_write_only_the_scratch_block() -> None:
    runner, pool, _ = runner_with_graphs()
    assert runner.graphs is not None
    seqs = [Seq(list(range(5 + 7 * i, 14 + 7 * i))) for i in range(3)]
    runner.execute([s.chunk(pool, 64) for s in seqs])
    for s in seqs:
        s.tokens.append(11)
    before = [t.clone() for t in (*runner.kv_cache.k, *runner.kv_cache.v)]
    chunks = [s.chunk(pool, 1) for s in seqs]  # 3 rows, padded to 4
    runner.execute(chunks)
    written = {c.block_table[c.start_pos // BLOCK] * BLOCK + c.start_pos % BLOCK for c in chunks}
    scratch = runner.graphs.scratch_block
    for old, new in zip(before, (*runner.kv_cache.k, *runner.kv_cache.v)):
        changed = (old != new).flatten(1).any(1).nonzero().flatten().tolist()  # [blocks] changed
        slots = {b * BLOCK + o for b in changed for o in range(BLOCK) if not torch.equal(old[b, o], new[b, o])}
        assert slots - written <= {scratch * BLOCK}


def test_steps_that_do_not_fit_take_the_dynamic_path() -> None:
    runner, pool, _ = runner_with_graphs()
    graphs = runner.graphs
    assert graphs is not None
    seq = Seq(list(range(20)))
    chunk = seq.chunk(pool, 8)
    assert not graphs.fits([chunk])  # a prefill chunk
    assert not graphs.fits([SeqChunk([1], 3, [0], False)])  # not sampled
    assert not graphs.fits([SeqChunk([1], 600, list(range(151)), True)])  # past max_model_len
    assert not graphs.fits([SeqChunk([1], 3, [0], True)] * 9)  # more rows than the largest bucket


def test_device_sampled_steps_draw_what_the_host_sampler_draws_from_their_logits() -> None:
    """Each decode step runs twice (the second writes the same K/V again): once handing its logits to the
    host sampler, once drawing on the device with generators seeded alike. Every row's token is the same,
    through padding (5 rows in the 8-row bucket) and all three sampling variants."""
    runner, pool, _ = runner_with_graphs()
    graphs = runner.graphs
    assert graphs is not None
    drawn = [dict(temperature=0.8), dict(temperature=1.0, top_p=0.9), dict(temperature=1.3, top_k=5, min_p=0.05)]
    kinds_of_step = [  # greedy only, whole-distribution draws, top_k / top_p draws
        [dict(temperature=0.0)] * 5, [dict(temperature=0.0), drawn[0], drawn[0], dict(temperature=0.0), drawn[0]],
        [dict(temperature=0.0), *drawn, drawn[0]],
    ]

    def rows(step: int) -> list[SamplingRow]:
        kinds = kinds_of_step[step % 3]
        return [SamplingRow(SamplingParams(**k), [], [], make_generator(1000 * step + j)) for j, k in enumerate(kinds)]

    host = Sampler(256, eos_token_ids=[0])
    seqs = [Seq(list(range(3 + 9 * i, 12 + 11 * i))) for i in range(5)]
    runner.execute([s.chunk(pool, 64) for s in seqs])
    for s in seqs:
        s.tokens.append(5)
    variants = set()
    for step in range(24):
        chunks = [s.chunk(pool, 1) for s in seqs]
        logits = runner.execute(chunks)
        assert isinstance(logits, torch.Tensor)
        expected = host.sample(logits, rows(step))
        sampling = rows(step)
        variants.add(variant_of(sampling, 256))
        got = runner.execute(chunks, sampling=sampling)
        assert isinstance(got, DeviceTokens)
        assert got.token_ids == expected.token_ids, f"step {step}"
        for s, token in zip(seqs, got.token_ids):
            s.tokens.append(token)
    assert variants == {"greedy", "random", "truncated"}
    assert graphs.num_device_sampled == 24 and graphs.num_steps == 48


def test_a_sampling_graph_that_cannot_be_captured_leaves_sampling_to_the_host() -> None:
    """A capture error in a sampling graph (any error, not only out of memory) turns device sampling off: the
    step, and every later one, returns its logits for the host sampler instead of failing; uniforms are drawn
    only for steps that do sample on the device, so seeded streams stay the host's."""
    runner, pool, _ = runner_with_graphs()
    graphs = runner.graphs
    assert graphs is not None
    graphs.capture, graphs._pool = True, (0, 0)  # capture on demand, as on CUDA (the pool is never used here)
    attempts = []

    def capture(step, pool):  # eager stand-in: a sampling graph fails to capture, a logits graph "captures"
        out = step(False)
        attempts.append(type(out).__name__)
        if isinstance(out, tuple):
            raise RuntimeError("operation not permitted when stream is capturing")
        return None, None

    graphs._capture = capture  # type: ignore[method-assign]
    seqs = [Seq(list(range(3 + 5 * i, 20 + 5 * i))) for i in range(3)]
    runner.execute([s.chunk(pool, 64) for s in seqs])
    for s in seqs:
        s.tokens.append(5)
    generator = make_generator(9)
    rows = [SamplingRow(SamplingParams(temperature=0.8, seed=9), [], [], generator)] + [
        SamplingRow(SamplingParams(temperature=0.0), [], [])] * 2
    state = generator.get_state()
    for step in range(3):
        chunks = [s.chunk(pool, 1) for s in seqs]
        out = runner.execute(chunks, sampling=rows)
        assert isinstance(out, torch.Tensor) and out.shape == (3, 256), f"step {step}"
        for s in seqs:
            s.tokens.append(7)
    assert attempts == ["tuple", "Tensor"]  # the sampling graph once, then the logits graph, never again
    assert not graphs.device_sampling and "capturing" in graphs.stats()["device_sampling_error"]
    assert graphs.num_device_sampled == 0 and torch.equal(generator.get_state(), state)  # no uniform drawn


def test_steps_chained_on_the_device_take_the_tokens_of_the_step_before() -> None:
    """Async scheduling's decode steps on the device (`defer`, `chained`): a step returns before its tokens reach
    the host, and the step queued behind it takes them as its inputs on the device. Each step runs twice (the
    second writes the same K/V again): given its inputs from the host, then chained on the step before; the
    tokens are the same, through padding (5 rows in the 8-row bucket) and a row of the step before that drew
    none (-1: it reads token 0, as its request is failed); a chained step that does not fit the fixed shapes
    takes the tokens from the host."""
    runner, pool, _ = runner_with_graphs()
    graphs = runner.graphs
    assert graphs is not None
    greedy = [SamplingRow(SamplingParams(temperature=0.0), [], []) for _ in range(5)]
    seqs = [Seq(list(range(3 + 9 * i, 12 + 11 * i))) for i in range(5)]
    runner.execute([s.chunk(pool, 64) for s in seqs])
    for s in seqs:
        s.tokens.append(5)
    first = runner.execute([s.chunk(pool, 1) for s in seqs], sampling=greedy, defer=True)
    assert isinstance(first, PendingTokens)
    for s, token in zip(seqs, first.wait().token_ids, strict=True):
        s.tokens.append(token)
    real_fits = graphs.fits
    for step in range(12):
        chunks = [s.chunk(pool, 1) for s in seqs]
        given = runner.execute(chunks, sampling=greedy)
        assert isinstance(given, DeviceTokens)
        placeholders = [SeqChunk([0], c.start_pos, c.block_table, True) for c in chunks]
        if step == 7:  # the rows past the shapes' limits: the dynamic path, its logits on the host
            graphs.fits = lambda chunks: False  # type: ignore[method-assign]
            logits = runner.execute(placeholders, sampling=greedy, chained=range(5), defer=True)
            graphs.fits = real_fits  # type: ignore[method-assign]
            assert isinstance(logits, torch.Tensor) and logits.argmax(-1).tolist() == given.token_ids
            graphs.previous[:5] = torch.tensor(given.token_ids)
        else:
            chained = runner.execute(placeholders, sampling=greedy, chained=range(5), defer=True)
            assert isinstance(chained, PendingTokens)
            assert chained.wait().token_ids == given.token_ids, f"step {step}"
        for s, token in zip(seqs, given.token_ids, strict=True):
            s.tokens.append(token)
    graphs.previous[2] = -1  # the step before drew no token for row 2
    chunks = [s.chunk(pool, 1) for s in seqs]
    chunks[2] = SeqChunk([0], chunks[2].start_pos, chunks[2].block_table, True)
    given = runner.execute(chunks, sampling=greedy)
    placeholders = [SeqChunk([0], c.start_pos, c.block_table, True) for c in chunks]
    chained = runner.execute(placeholders, sampling=greedy, chained=range(5), defer=True)
    assert isinstance(given, DeviceTokens) and isinstance(chained, PendingTokens)
    assert chained.wait().token_ids == given.token_ids
    for s, token in zip(seqs, given.token_ids, strict=True):
        s.tokens.append(token)
    with_logprobs = [SamplingRow(SamplingParams(temperature=0.0, logprobs=3 if j % 2 else None), [], [])
                     for j in range(5)]
    chunks = [s.chunk(pool, 1) for s in seqs]
    given = runner.execute(chunks, sampling=with_logprobs)
    deferred = runner.execute(chunks, sampling=with_logprobs, defer=True)  # the logprobs come with the tokens
    assert isinstance(given, DeviceTokens) and isinstance(deferred, PendingTokens)
    assert deferred.wait() == given and given.logprobs is not None and given.logprobs[1] is not None
    assert graphs.num_chained == 12 and graphs.num_deferred == 14
