"""Decode-only steps replayed from CUDA graphs (`cuda_graphs`, on by default on CUDA).

Why: a decode step of a small model on a GPU is bound by launching its ~20 kernels per layer from
Python, not by the GPU's work. A CUDA graph records the step's kernels once and replays them in one
launch. vLLM and gpt-fast do the same for the same reason.

A graph replays fixed shapes on fixed buffers, so each step is padded to a bucket:
- batch: the decode batch sizes of `decode_buckets` (1, 2, 4, ... `max_num_seqs`); padding rows
  write their K/V into a scratch block that no sequence owns and are never sampled;
- context: a power-of-two count of blocks (at least `MIN_CONTEXT_BLOCKS`); each row gathers that
  many blocks from its row of a padded block table, and a mask hides keys past its own length
  (`attention.static_decode`); or, with `cuda_attention="triton"`, a Triton kernel reads each row's
  blocks in place to its own length (`attention.triton_decode`), split over as many programs as fill the GPU.
A step's inputs (token, position, slot, length and block table of each row) are packed on the host
into one pinned buffer and copied to the device in one transfer; the graph reads them from there.

When every row of a step can be sampled on the device (`device_sampler.device_rows`), the graph also
draws the tokens (`DeviceSampler`, whose parameters and uniforms are staged the same way) and only the
rows' token ids come back, not `[rows, vocab]` logits. Each (batch, context) bucket then has a graph per
sampling `Draw`: its variant ("greedy", "random", "truncated": top_k / top_p), with the rows' logit
adjustments (bias, min_tokens, penalties) applied first and the drawn tokens counted into the rows' penalty
state last or not, and with the top logprobs of a width some row asks for; and one that returns the logits
(the host samples).

With async scheduling (`defer`), a step drawn without logit adjustments returns as soon as it is queued, its
tokens' copy to the host under way (`PendingTokens`), and the step planned behind it takes them as its inputs
on the device (`chained`): the GPU does not wait for the host between chained steps. The pinned input buffers
are rewritten only once the last step's copy of them ran.

Every (batch, context) bucket's logits graph is captured at start, largest first, into one shared
memory pool (graphs of one engine never run at the same time); a draw's when a step first needs it.
Graphs point at the KV cache's tensors, so the backend drops them (`release`) before an out-of-memory shrink
replaces those tensors; each bucket is then captured again when a step first needs it, and out of memory
while capturing turns graphs off.
With `capture=False` the same fixed-shape path runs eagerly: that is how the CPU tests check its
arithmetic against the dynamic path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, TypeVar

import torch

from tokenflow.kv.kv_cache import KVCache
from tokenflow.protocols import DeviceTokens, PendingTokens
from tokenflow.runtime.attention.layer import LayerAttention
from tokenflow.runtime.attention.paged import PagedAttentionMetadata, sdpa_backends
from tokenflow.runtime.attention.static_decode import StaticDecode
from tokenflow.runtime.attention.triton_decode import decode_splits
from tokenflow.runtime.compiled import doubling_buckets
from tokenflow.runtime.device_sampler import DeviceSampler, Draw, draw_of

if TYPE_CHECKING:
    from tokenflow.runtime.fused_layers import FusedDecoder
    from tokenflow.runtime.paged_runner import SeqChunk
    from tokenflow.runtime.sampler import SamplingRow

__all__ = ("MIN_CONTEXT_BLOCKS", "DecodeGraphs", "capture_graph", "context_buckets")

log = logging.getLogger("tokenflow")

MIN_CONTEXT_BLOCKS = 8  # the smallest context bucket: shorter contexts share one graph
StepOut = torch.Tensor | tuple[torch.Tensor, ...]  # a graph's logits, or the tokens it drew (and their logprobs)
T = TypeVar("T")


def context_buckets(max_blocks: int) -> list[int]:
    """Powers of two from `MIN_CONTEXT_BLOCKS` below `max_blocks`, and `max_blocks` itself."""
    return doubling_buckets(max_blocks, MIN_CONTEXT_BLOCKS)


def capture_graph(device: torch.device, step: Callable[[bool], T], pool: tuple[int, int]
                  ) -> tuple[torch.cuda.CUDAGraph, T]:
    """`step` captured as a CUDA graph into `pool`, after one warm-up run on a side stream outside the graph
    (lazy initialisation: cuBLAS handles, workspaces, Triton's compiles); `step(record)` is told which run
    counts (the warm-up's False). Returns the graph and the captured run's output (its buffers). Captured in
    "thread_local" mode: another thread's CUDA calls meanwhile (a chained step's tokens waited for on a helper
    thread) would invalidate a "global" capture."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), torch.inference_mode():
        step(False)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"), torch.inference_mode():
        out = step(True)
    return graph, out


def _device_programs(device: torch.device) -> int:
    """Twice the streaming multiprocessors of a CUDA device; elsewhere (the CPU tests) a small fixed count."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 16


def _bucket(n: int, sizes: list[int]) -> int:
    return next(size for size in sizes if size >= n)


class DecodeGraphs:
    """Runs decode-only steps of a `FusedDecoder` at fixed shapes, replayed from CUDA graphs."""

    def __init__(
        self, decoder: FusedDecoder, kv_cache: KVCache, *, batch_sizes: list[int], max_model_len: int,
        scratch_block: int, capture: bool, attention: LayerAttention, vocab_size: int,
        eos_token_ids: Sequence[int] = (), kernel: Literal["gathered", "triton"] = "gathered",
        programs: int | None = None,
    ) -> None:
        self.decoder = decoder
        self.attention = attention  # the runner's (KV write + the fixed-shape decode)
        self.kernel = kernel  # how a step's attention reads the blocks (`StaticDecode.kernel`)
        # triton: programs a layer's attention should run to fill the device (twice its SMs)
        self.programs = programs or _device_programs(kv_cache.device)
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.batch_sizes = sorted(batch_sizes)
        self.max_rows = self.batch_sizes[-1]
        self.max_blocks = -(-max_model_len // self.block_size)
        self.context_sizes = context_buckets(self.max_blocks)
        self.scratch_block = scratch_block
        self.capture = capture
        device = kv_cache.device
        rows, blocks = self.max_rows, self.max_blocks
        # One int64 buffer: ids | positions | slots | lengths | chained (rows each) | block table (rows x blocks).
        self._size = 5 * rows + rows * blocks
        cuda = device.type == "cuda"
        self._host = torch.empty(self._size, dtype=torch.long, pin_memory=cuda)
        self._host_np = self._host.numpy()  # numpy writes from Python lists are far cheaper than tensor ones
        self._device = torch.empty(self._size, dtype=torch.long, device=device)
        self.ids, self.positions, self.slots, self.lengths, self.chained = self._device[: 5 * rows].view(5, rows)
        self.table = self._device[5 * rows:].view(rows, blocks)
        # Steps chained on the device (`defer`): the last such step's tokens, which the next step's rows named in
        # `chained` take as their inputs; and when the last step's inputs were copied (the pinned buffers are
        # rewritten only after).
        self.previous = torch.zeros(rows, dtype=torch.long, device=device)
        self._inputs_copied = torch.cuda.Event() if cuda else None
        self.rows = torch.arange(rows, device=device)
        self.key_positions = torch.arange(blocks * self.block_size, device=device)
        self.sampler = DeviceSampler(rows, vocab_size, device, eos_token_ids)
        # (batch, context, the draw: None for the graph that returns logits) -> the graph and its output
        self._graphs: dict[tuple[int, int, Draw | None], tuple[torch.cuda.CUDAGraph | None, StepOut]] = {}
        self._pool: tuple[int, int] | None = None  # one memory pool shared by every graph
        self.capture_disabled_by_oom = False
        self.capture_seconds = 0.0
        self.num_steps = 0  # steps run at fixed shapes (replayed, or eager without graphs)
        self.num_device_sampled = 0  # of those, steps whose tokens were drawn on the device
        self.num_deferred = 0  # ... returned before their tokens reached the host (`defer`)
        self.num_chained = 0  # steps whose inputs were the tokens of a deferred step, taken on the device
        self.device_sampling = True  # off after a sampling graph could not be captured
        self.device_sampling_error = ""

    # ----------------------------------------------------------------- step
    def fits(self, chunks: Sequence[SeqChunk]) -> bool:
        """Whether the step is decode-only (one sampled token per chunk) and within the buckets."""
        if not 0 < len(chunks) <= self.max_rows:
            return False
        limit = self.max_blocks * self.block_size
        return all(len(c.token_ids) == 1 and c.sample and c.num_logits == 1 and c.start_pos < limit for c in chunks)

    def run(self, chunks: Sequence[SeqChunk], sampling: Sequence[SamplingRow] | None = None,
            chained: Sequence[int] = (), defer: bool = False) -> torch.Tensor | DeviceTokens | PendingTokens:
        """float32 logits `[len(chunks), vocab]` on the CPU, of a step that `fits`; with `sampling` (chunk
        i's row is `sampling[i]`), the rows' tokens (and asked-for logprobs) drawn on the device instead.
        `chained[i] >= 0` (when given): chunk i's input is that row's token of the last deferred step, taken on the
        device (its own token is a placeholder).
        With `defer`, a step drawn without logit adjustments returns at once with its tokens' copy to the host
        under way (`PendingTokens`), and the next step may chain on them.
        After the KV cache changed (`release`), each bucket is captured again when a step first needs it."""
        n = len(chunks)
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()  # the last step's inputs left the pinned buffers rewritten below
        rows = _bucket(n, self.batch_sizes)
        blocks = _bucket(max(-(-(c.start_pos + 1) // self.block_size) for c in chunks), self.context_sizes)
        draw = None
        if sampling is not None and self.device_sampling:
            draw = draw_of(sampling, self.sampler.vocab_size)
            if draw.adjusted and not self._prepare_adjustments():
                draw = None
        if self.capture and (rows, blocks, draw) not in self._graphs:
            draw = self._capture_bucket(rows, blocks, draw)
        if draw is None:
            sampling = None  # the host samples the logits
        else:
            assert sampling is not None
            self.sampler.stage(sampling)  # the uniforms are drawn here, once the step is sure to sample here
            self.num_device_sampled += 1
        self._stage(chunks, rows, chained)
        if chained:
            self._take_chained(rows)
            self.num_chained += 1
        if self._inputs_copied is not None:
            self._inputs_copied.record(torch.cuda.current_stream(self.kv_cache.device))
        self.num_steps += 1
        graph, out = self._graphs.get((rows, blocks, draw), (None, None))
        try:
            if graph is not None and out is not None:
                graph.replay()
            else:
                with torch.inference_mode():
                    out = self._step(rows, blocks, draw)
            if draw is None:
                assert isinstance(out, torch.Tensor)
                return out[:n].cpu()  # a copy: the next replay overwrites `out`; it waits for the graph
            if defer and not draw.adjusted:
                assert isinstance(out, tuple) and sampling is not None
                return self._deferred(out, n, sampling)
            assert isinstance(out, tuple)
            tokens = out[0][:n].tolist()  # waits for the graph: a device error shows here
            logprobs = [t[:n].tolist() for t in out[1:]]
        except BaseException:
            if draw is not None and draw.adjusted:
                self.sampler.forget_staged()  # its penalty counts may hold a token no request took
            raise
        assert sampling is not None
        if draw.adjusted:
            self.sampler.recorded()
        if draw.logprobs < 0:
            return DeviceTokens(tokens)
        chosen, top_v, top_i = logprobs
        return DeviceTokens(tokens, self.sampler.token_logprobs(sampling, tokens, chosen, top_v, top_i))

    def _stage(self, chunks: Sequence[SeqChunk], rows: int, chained: Sequence[int] = ()) -> None:
        """Pack the step's inputs (padding rows after the real ones) and copy them to the device at once.
        The host buffer is free to rewrite: the last step's copy finished (`run` waited for it)."""
        bs, width, scratch = self.block_size, self.max_blocks, self.scratch_block
        cap = self.max_rows
        ids, positions, slots, lengths, chain = self._host_np[: 5 * cap].reshape(5, cap)
        table = self._host_np[5 * cap:].reshape(cap, width)
        chain[: len(chunks)] = chained if chained else -1
        for i, c in enumerate(chunks):
            pos = c.start_pos
            ids[i] = c.token_ids[0]
            positions[i] = pos + c.position_offset
            slots[i] = c.block_table[pos // bs] * bs + pos % bs
            lengths[i] = pos + 1
            used = pos // bs + 1
            table[i, :used] = c.block_table[:used]
            table[i, used:] = scratch
        if len(chunks) < rows:
            self._pad(len(chunks), rows)
        self._device.copy_(self._host, non_blocking=True)

    def _pad(self, start: int, end: int) -> None:
        """Rows `start:end` of the host buffer: token 0 at position 0 in the scratch block."""
        cap = self.max_rows
        ids, positions, slots, lengths, chain = self._host_np[: 5 * cap].reshape(5, cap)
        ids[start:end] = 0
        positions[start:end] = 0
        slots[start:end] = self.scratch_block * self.block_size
        lengths[start:end] = 1
        chain[start:end] = -1
        self._host_np[5 * cap:].reshape(cap, self.max_blocks)[start:end] = self.scratch_block

    def _take_chained(self, rows: int) -> None:
        """Device work before the step: each chained row's input becomes the last deferred step's token of the
        row it names (a row that drew none, -1, reads token 0: its request ends with that failure, and this
        row's output is dropped)."""
        chain, ids = self.chained[:rows], self.ids[:rows]
        ids.copy_(torch.where(chain >= 0, self.previous[chain.clamp(min=0)].clamp(min=0), ids))

    def _deferred(self, out: tuple[torch.Tensor, ...], n: int, sampling: Sequence[SamplingRow]) -> PendingTokens:
        """The step's `n` tokens kept for the next step to chain on, and they (and their logprobs) copied to the
        host without waiting: into pinned memory (`to(non_blocking=True)`), read once the copy's event passed."""
        self.num_deferred += 1
        tokens = out[0]
        self.previous[:n].copy_(tokens[:n])
        cuda = tokens.is_cuda
        copies = [t[:n].to("cpu", non_blocking=True) if cuda else t[:n].clone() for t in out]
        arrived = None
        if cuda:
            arrived = torch.cuda.Event()
            arrived.record(torch.cuda.current_stream(tokens.device))
        rows = list(sampling)

        def wait() -> DeviceTokens:
            if arrived is not None:
                arrived.synchronize()  # a device error in the step shows here
            ids = copies[0].tolist()
            if len(copies) == 1:
                return DeviceTokens(ids)
            chosen, top_v, top_i = (c.tolist() for c in copies[1:])
            return DeviceTokens(ids, DeviceSampler.token_logprobs(rows, ids, chosen, top_v, top_i))

        return PendingTokens(wait)

    def chained_tokens(self, rows: Sequence[int]) -> list[int]:
        """The last deferred step's tokens of `rows`, on the host (waits for that step): for a chained step that
        does not fit the fixed shapes."""
        return self.previous[list(rows)].tolist()

    def _forward(self, rows: int, blocks: int) -> torch.Tensor:
        """The fixed-shape decode over the device buffers; float32 logits `[rows, vocab]`."""
        keys = blocks * self.block_size
        table, lengths = self.table[:rows, :blocks], self.lengths[:rows]
        if self.kernel == "triton":
            splits = decode_splits(rows, self.kv_cache.num_kv_heads, blocks, self.programs)
            step = StaticDecode(table, lengths, None, "triton", splits)
        else:
            mask = (self.key_positions[:keys][None, :] < lengths[:, None]).view(rows, 1, 1, keys)
            step = StaticDecode(table, lengths, mask)
        meta = PagedAttentionMetadata(
            kv_cache=self.kv_cache, slot_mapping=self.slots[:rows], num_tokens=rows, max_context=keys,
            decodes=(), prefills=(), static_decode=step, attention=self.attention,
        )
        ids, positions = self.ids[:rows].view(1, rows), self.positions[:rows].view(1, rows)
        with sdpa_backends(self.kv_cache.device):
            return self.decoder(ids, positions, self.rows[:rows], meta).float()

    def _step(self, rows: int, blocks: int, draw: Draw | None, record: bool = True) -> StepOut:
        """What the graph of `draw` returns: the logits (None), or the tokens drawn from them on the device (and
        their logprobs). `record`: count adjusted rows' tokens into their penalty state (not in a capture's
        warm-up run, which would count them once more)."""
        logits = self._forward(rows, blocks)
        if draw is None:
            return logits
        tokens = self.sampler.sample(logits, draw.variant, draw.adjusted)
        if draw.adjusted and record:
            self.sampler.record(tokens)
        if draw.logprobs < 0:
            return (tokens,)
        return (tokens, *self.sampler.logprobs(logits, tokens, draw.logprobs))

    # -------------------------------------------------------------- capture
    @property
    def pool(self) -> tuple[int, int] | None:
        """The memory pool the graphs were captured into (None before a capture)."""
        return self._pool

    def release(self) -> None:
        """Drop the graphs and their memory (before the KV cache's tensors change); the next step
        captures them again."""
        self._graphs.clear()
        self._pool = None
        if self.kv_cache.device.type == "cuda":
            torch.cuda.empty_cache()

    def capture_all(self) -> None:
        """Capture every (batch, context) bucket's logits graph, largest first, into one memory pool."""
        started = time.perf_counter()
        self._graphs.clear()
        torch.cuda.synchronize(self.kv_cache.device)
        self._pool = torch.cuda.graph_pool_handle()
        self._pad(0, self.max_rows)  # capturing writes only into the scratch block
        self._device.copy_(self._host)
        for rows in reversed(self.batch_sizes):
            for blocks in reversed(self.context_sizes):
                self._graphs[(rows, blocks, None)] = self._capture(
                    lambda record, r=rows, b=blocks: self._step(r, b, None, record), self._pool)
        torch.cuda.synchronize(self.kv_cache.device)
        self.capture_seconds = time.perf_counter() - started
        log.info("CUDA graphs: %d decode buckets captured in %.1f s (batch %s x context blocks %s)",
                 len(self._graphs), self.capture_seconds, self.batch_sizes, self.context_sizes)

    def _prepare_adjustments(self) -> bool:
        """Make the penalty state a first adjusted step reads (before its graph is captured); out of memory turns
        device sampling off rather than failing the step. False when it is off."""
        try:
            self.sampler.prepare_adjustments()
        except torch.OutOfMemoryError:
            self._device_sampling_off("out of memory for the penalty state")
            return False
        return True

    def _capture_bucket(self, rows: int, blocks: int, draw: Draw | None) -> Draw | None:
        """Capture one bucket on demand; returns the draw the step runs with. A sampling graph that cannot be
        captured turns device sampling off (the step's logits go to the host, through the logits graph: None);
        out of memory capturing a logits graph turns capturing off (steps run at fixed shapes, eagerly).
        Neither fails the step."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        self._pad(0, self.max_rows)
        self._device.copy_(self._host)
        try:
            self._graphs[(rows, blocks, draw)] = self._capture(
                lambda record: self._step(rows, blocks, draw, record), self._pool)
        except Exception as exc:
            if draw is not None:
                self._device_sampling_off(f"capturing a {draw} graph failed: {exc!r}")
                return None if (rows, blocks, None) in self._graphs else self._capture_bucket(rows, blocks, None)
            if not isinstance(exc, torch.OutOfMemoryError):
                raise
            log.warning("out of memory capturing a CUDA graph for %d rows x %d blocks: decode steps run "
                        "without graphs from now on", rows, blocks)
            self.release()
            self.capture = False
            self.capture_disabled_by_oom = True
        return draw

    def _device_sampling_off(self, why: str) -> None:
        log.warning("decode steps sample on the host from now on: %s", why)
        self.device_sampling = False
        self.device_sampling_error = why

    def _capture(self, step: Callable[[bool], StepOut], pool: tuple[int, int]
                 ) -> tuple[torch.cuda.CUDAGraph, StepOut]:
        return capture_graph(self.kv_cache.device, step, pool)

    def stats(self) -> dict[str, float | int]:
        return {"cuda_graphs": len(self._graphs), "cuda_graph_capture_s": round(self.capture_seconds, 2),
                "fixed_shape_decode_steps": self.num_steps, "device_sampled_steps": self.num_device_sampled,
                "deferred_decode_steps": self.num_deferred, "chained_decode_steps": self.num_chained,
                "cuda_graphs_off_after_oom": self.capture_disabled_by_oom,
                **({"device_sampling_error": self.device_sampling_error} if self.device_sampling_error else {})}
