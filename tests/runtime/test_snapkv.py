"""kv_compression (SnapKV): the selection keeps sinks, the scoring window and the best-scored positions; the
compaction copies each layer's and head's kept K/V into fresh blocks, and decoding after it continues at the
right positions."""

from __future__ import annotations

import torch

from tests.runtime.test_paged_runner import BLOCK, Seq, build, make_runner
from tokenflow.runtime.attention.snapkv import key_scores, select_positions
from tokenflow.runtime.paged_runner import SeqChunk


def test_selection_keeps_sinks_window_and_the_best_positions() -> None:
    scores = torch.zeros(2, 100)
    scores[0, 40] = 5.0  # head 0 looks at 40, head 1 at 70
    scores[1, 70] = 5.0
    chosen = select_positions(scores, keep=20, sinks=4, window=8)
    assert chosen.shape == (2, 20) and torch.equal(chosen, chosen.sort(dim=1).values)
    for head, peak in ((0, 40), (1, 70)):
        kept = set(chosen[head].tolist())
        assert {0, 1, 2, 3} <= kept and set(range(92, 100)) <= kept  # sinks and window
        assert {peak - 3, peak, peak + 3} <= kept  # the peak with its pooled neighbours
    assert torch.equal(select_positions(scores, keep=100, sinks=4, window=8)[0], torch.arange(100))


def test_key_scores_are_each_query_rows_causal_attention() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 8, generator=g)  # 3 queries at positions 5, 6, 7; 4 heads over 2 KV heads
    k = torch.randn(8, 2, 8, generator=g)
    got = key_scores(q, k, 0.5, start=5)
    assert got.shape == (2, 8)
    torch.testing.assert_close(got.sum(1), torch.full((2,), 6.0))  # 2 query heads x 3 rows, each summing to 1
    want = torch.zeros(2, 8)
    for h in range(4):
        for i in range(3):
            w = (q[i, h] @ k[: 6 + i, h // 2].T * 0.5).softmax(-1)
            want[h // 2, : 6 + i] += w
    torch.testing.assert_close(got, want)


def _prefilled(length: int):
    model = build("llama")
    runner, pool = make_runner(model)
    tokens = torch.randint(0, 256, (length + 1,), generator=torch.Generator().manual_seed(7)).tolist()
    seq = Seq(tokens[:length])
    runner.execute([seq.chunk(pool, 128)])
    return runner, pool, seq, tokens


def test_keeping_every_position_decodes_exactly_as_before() -> None:
    """A compaction that keeps all positions must give the same next logits: copies, tables and offsets line up."""
    length = 50
    runner, pool, seq, tokens = _prefilled(length)
    before = runner.execute([SeqChunk([tokens[length]], length, seq.blocks + pool.allocate(1), True)])
    table = pool.allocate(-(-length // BLOCK) + 1)
    window = SeqChunk(tokens[length - 8:length], length - 8, seq.blocks, False)
    runner.compress(window, table, keep=length, sinks=4)
    after = runner.execute([SeqChunk([tokens[length]], length, table, True)])
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_compaction_copies_each_heads_kept_rows_and_decodes_at_the_true_position() -> None:
    length, keep = 60, 24
    runner, pool, seq, tokens = _prefilled(length)
    cache = runner.kv_cache
    old = [(k.clone(), v.clone()) for k, v in zip(cache.k_slots, cache.v_slots)]
    window = SeqChunk(tokens[length - 8:length], length - 8, seq.blocks, False)
    scored = runner.prepare([window], cache)
    scored.meta.key_scores = []
    runner._forward(scored)
    table = pool.allocate(-(-keep // BLOCK) + 1)
    runner.compress(window, table, keep=keep, sinks=4)
    dst = torch.tensor([table[j // BLOCK] * BLOCK + j % BLOCK for j in range(keep)])
    for layer, scores in enumerate(scored.meta.key_scores):
        chosen = select_positions(scores, keep, 4, 8)
        for head in range(cache.num_kv_heads):
            src = torch.tensor([seq.blocks[p // BLOCK] * BLOCK + p % BLOCK for p in chosen[head].tolist()])
            assert torch.equal(cache.k_slots[layer][dst, head], old[layer][0][src, head])
            assert torch.equal(cache.v_slots[layer][dst, head], old[layer][1][src, head])
    # the next token: cache position `keep`, RoPE position `length`
    logits = runner.execute([SeqChunk([tokens[length]], keep, table, True, 1, length - keep)])
    assert torch.isfinite(logits).all() and logits.shape == (1, 256)


def test_decoding_after_dropped_positions_matches_a_masked_forward() -> None:
    """Drop the K/V of positions 16..31 (whole blocks) and decode the next token at its true position: the
    logits equal transformers' forward whose last row may not see those positions (RoPE position offset)."""
    import copy

    length = 50
    model = build("llama")
    ref = copy.deepcopy(model)
    runner, pool = make_runner(model)
    tokens = torch.randint(0, 256, (length + 1,), generator=torch.Generator().manual_seed(3)).tolist()
    seq = Seq(tokens[:length])
    runner.execute([seq.chunk(pool, 128)])
    dropped = range(16 // BLOCK, 32 // BLOCK)
    table = [b for i, b in enumerate(seq.blocks) if i not in dropped] + pool.allocate(1)
    logits = runner.execute([SeqChunk([tokens[length]], length - 16, table, True, 1, 16)])[0]
    n = length + 1
    mask = torch.full((n, n), float("-inf")).triu(1)
    mask[-1, 16:32] = float("-inf")
    with torch.inference_mode():
        want = ref(torch.tensor([tokens]), attention_mask=mask[None, None]).logits[0, -1].float()
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
