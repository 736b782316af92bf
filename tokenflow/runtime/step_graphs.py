"""Steps with prefill chunks replayed from CUDA graphs (`cuda_graph_prefill_steps`, with `cuda_attention="triton"`).

Why: a step that holds a prefill chunk runs eagerly, launching every layer's kernels from Python; for a small
model that launching, not the GPU's work, sets the step's time, and at concurrency 16 most steps hold a chunk
of some arriving prompt. The decode graphs (`decode_graphs.py`) cannot take these steps: their attention has
one shape per (batch, context) bucket. The varlen Triton kernel (`attention.triton_varlen`) takes any mix of
decodes and chunks with the step's shape in device tensors, so such a step replays one graph per bucket of its
token count (vLLM's full CUDA graphs with its unified attention):

- tokens: the step's total, padded to a bucket (`token_buckets`: powers of two from 16 to `max_batch_tokens`);
  padding tokens form one extra sequence of their own over the scratch block, whose K/V they write;
- sequences: `max_seqs` of them and that one, their rows, lengths and whole block tables in fixed buffers (the
  kernel reads each sequence's keys to its own length, so there is no context bucket); unused ones have no rows;
- logits: one row per sequence (`max_seqs`), the sampled chunks' last rows first; the host samples them.

With `capture=False` the same fixed-shape path runs eagerly: that is how the CPU tests check it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tokenflow.kv.kv_cache import KVCache
from tokenflow.runtime.attention.layer import LayerAttention
from tokenflow.runtime.attention.paged import PagedAttentionMetadata
from tokenflow.runtime.attention.triton_varlen import VarlenStep
from tokenflow.runtime.compiled import doubling_buckets
from tokenflow.runtime.decode_graphs import capture_graph

if TYPE_CHECKING:
    from tokenflow.runtime.fused_layers import FusedDecoder
    from tokenflow.runtime.paged_runner import SeqChunk

__all__ = ("StepGraphs", "token_buckets")

log = logging.getLogger("tokenflow")

MIN_TOKENS = 16  # the smallest token bucket


def token_buckets(max_tokens: int) -> list[int]:
    """Powers of two from `MIN_TOKENS` below `max_tokens`, and `max_tokens` itself."""
    return doubling_buckets(max_tokens, MIN_TOKENS)


class StepGraphs:
    """Runs steps with prefill chunks of a `FusedDecoder` at fixed shapes, replayed from CUDA graphs."""

    def __init__(self, decoder: FusedDecoder, kv_cache: KVCache, attention: LayerAttention, *, max_seqs: int,
                 max_tokens: int, max_model_len: int, scratch_block: int, capture: bool) -> None:
        self.decoder = decoder
        self.kv_cache = kv_cache
        self.attention = attention
        self.block_size = kv_cache.block_size
        self.max_seqs = max_seqs
        self.buckets = token_buckets(max(max_tokens, MIN_TOKENS))
        self.max_context = max_model_len
        # a table row holds a sequence's blocks, or the padding sequence's (as many keys as the largest bucket)
        self.max_blocks = max(-(-max_model_len // self.block_size), -(-self.buckets[-1] // self.block_size))
        self.scratch_block = scratch_block
        self.capture = capture
        device = kv_cache.device
        tokens, seqs, blocks = self.buckets[-1], max_seqs + 1, self.max_blocks  # + 1: the padding tokens' sequence
        # int64, per token and kept row: ids | positions | slots (tokens each) | kept rows (max_seqs)
        self._host_long = torch.empty(3 * tokens + max_seqs, dtype=torch.long, pin_memory=device.type == "cuda")
        # int32, per sequence: query starts (seqs + 1) | lengths (seqs) | block tables (seqs x blocks)
        self._host_int = torch.empty(2 * seqs + 1 + seqs * blocks, dtype=torch.int32,
                                     pin_memory=device.type == "cuda")
        self._long_np, self._int_np = self._host_long.numpy(), self._host_int.numpy()
        self._long = torch.empty_like(self._host_long, device=device)
        self._int = torch.empty_like(self._host_int, device=device)
        self.ids, self.positions, self.slots = self._long[: 3 * tokens].view(3, tokens)
        self.keep = self._long[3 * tokens:]
        self.query_start = self._int[: seqs + 1]
        self.seq_lens = self._int[seqs + 1 : 2 * seqs + 1]
        self.table = self._int[2 * seqs + 1:].view(seqs, blocks)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor]] = {}
        self._pool: tuple[int, int] | None = None
        self.capture_seconds = 0.0
        self.capture_disabled_by_oom = False
        self.num_steps = 0

    def fits(self, chunks: Sequence[SeqChunk]) -> bool:
        """Whether the step fits the buffers: at most `max_seqs` chunks of at most the largest bucket's tokens in
        all, each sampling at most its last row, none past the longest context."""
        tokens = sum(len(c.token_ids) for c in chunks)
        return (0 < len(chunks) <= self.max_seqs and tokens <= self.buckets[-1]
                and all((not c.sample or c.num_logits == 1) and c.start_pos + len(c.token_ids) <= self.max_context
                        for c in chunks))

    def run(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """float32 logits `[sampled chunks, vocab]` on the CPU, in chunk order, of a step that `fits`."""
        used = sum(len(c.token_ids) for c in chunks)
        tokens = next(size for size in self.buckets if size >= used)
        if self.capture and tokens not in self._graphs:
            self._capture_bucket(tokens)
        sampled = self._stage(chunks, tokens)
        self.num_steps += 1
        graph, out = self._graphs.get(tokens, (None, None))
        if graph is not None and out is not None:
            graph.replay()
        else:
            with torch.inference_mode():
                out = self._forward(tokens)
        return out[:sampled].cpu()  # a copy: the next replay overwrites `out`

    def _stage(self, chunks: Sequence[SeqChunk], tokens: int) -> int:
        """Pack the step's rows (each chunk's tokens in order, then the padding sequence) and copy them to the
        device; returns how many rows are sampled."""
        bs, cap, seqs, width = self.block_size, self.buckets[-1], self.max_seqs + 1, self.max_blocks
        ids, positions, slots = self._long_np[: 3 * cap].reshape(3, cap)
        keep = self._long_np[3 * cap:]
        starts, lengths = self._int_np[: seqs + 1], self._int_np[seqs + 1 : 2 * seqs + 1]
        table = self._int_np[2 * seqs + 1:].reshape(seqs, width)
        row = sampled = 0
        for i, c in enumerate(chunks):
            n, start = len(c.token_ids), c.start_pos
            ids[row : row + n] = c.token_ids
            positions[row : row + n] = range(start + c.position_offset, start + c.position_offset + n)
            slots[row : row + n] = [c.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
            starts[i] = row
            lengths[i] = start + n
            blocks = -(-(start + n) // bs)
            table[i, :blocks] = c.block_table[:blocks]
            row += n
            if c.sample:
                keep[sampled] = row - 1
                sampled += 1
        real = len(chunks)
        starts[real : seqs] = row  # the unused sequences: no rows
        lengths[real : seqs - 1] = 0
        pad = tokens - row  # the padding tokens: the last sequence, over the scratch block
        ids[row:tokens], positions[row:tokens] = 0, range(pad)
        slots[row:tokens] = [self.scratch_block * bs + p % bs for p in range(pad)]
        starts[seqs] = tokens
        lengths[seqs - 1] = pad
        table[seqs - 1, :] = self.scratch_block
        keep[sampled:] = 0
        self._long.copy_(self._host_long, non_blocking=True)
        self._int.copy_(self._host_int, non_blocking=True)
        return sampled

    def _forward(self, tokens: int) -> torch.Tensor:
        """The fixed-shape step over the device buffers; float32 logits `[max_seqs, vocab]`."""
        step = VarlenStep(self.query_start, self.seq_lens, self.table, max_rows=tokens)
        meta = PagedAttentionMetadata(
            kv_cache=self.kv_cache, slot_mapping=self.slots[:tokens], num_tokens=tokens,
            max_context=self.max_context, decodes=(), prefills=(), attention=self.attention, varlen=step,
        )
        ids, positions = self.ids[:tokens].view(1, tokens), self.positions[:tokens].view(1, tokens)
        out = self.decoder(ids, positions, self.keep, meta)
        assert isinstance(out, torch.Tensor)
        return out.float()

    # -------------------------------------------------------------- capture
    def release(self) -> None:
        """Drop the graphs and their memory (before the KV cache's tensors change)."""
        self._graphs.clear()
        self._pool = None
        if self.kv_cache.device.type == "cuda":
            torch.cuda.empty_cache()

    def capture_all(self, pool: tuple[int, int] | None = None) -> None:
        """Capture every token bucket's graph, largest first, into one memory pool (`pool`: the decode graphs',
        which never run at the same time as these)."""
        started = time.perf_counter()
        self._pool = pool
        for tokens in reversed(self.buckets):
            self._capture_bucket(tokens)
        self.capture_seconds = time.perf_counter() - started
        log.info("CUDA graphs: %d prefill-step buckets captured in %.1f s (tokens %s)", len(self._graphs),
                 self.capture_seconds, self.buckets)

    def _capture_bucket(self, tokens: int) -> None:
        """Capture one bucket (a step of padding only writes the scratch block); out of memory turns capturing
        off, and steps run at fixed shapes eagerly."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        self._stage([], tokens)
        try:
            self._graphs[tokens] = capture_graph(self.kv_cache.device, lambda _: self._forward(tokens), self._pool)
        except torch.OutOfMemoryError:
            log.warning("out of memory capturing a CUDA graph for a step of %d tokens: steps with prefill chunks "
                        "run without graphs from now on", tokens)
            self.release()
            self.capture = False
            self.capture_disabled_by_oom = True

    def stats(self) -> dict[str, float | int]:
        return {"cuda_graphs_prefill_steps": len(self._graphs),
                "cuda_graph_prefill_capture_s": round(self.capture_seconds, 2),
                "fixed_shape_prefill_steps": self.num_steps}
