"""The forward pass of the `paged` backend: one HF forward per step over a packed batch.

The model stays an unmodified transformers model. The runner registers tokenflow's attention
(`tokenflow.runtime.attention.paged`) and switches the model to it, then each `execute` packs the
step's chunks into `input_ids [1, total_tokens]` with per-token `position_ids`, builds the
step's `PagedAttentionMetadata` once (slot mapping, block index tensors, masks) and calls
the model with `use_cache=False` (otherwise it silently builds its own `DynamicCache`),
`logits_to_keep` = the packed rows to sample (so the vocab projection runs on those rows only)
and the metadata as an extra keyword, which transformers hands down to every layer's attention.

This relies on a convention inside transformers, not a documented API, so the supported
transformers range is pinned in pyproject and every runner checks itself at construction
(`self_check`) against the model's own attention.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from tokenflow.errors import ModelLoadError
from tokenflow.kv.kv_cache import KVCache
from tokenflow.protocols import DeviceTokens, PendingTokens
from tokenflow.runtime.attention.layer import LayerAttention, choose_attention
from tokenflow.runtime.attention.paged import (
    ATTENTION_NAME,
    META_KWARG,
    DecodeGroup,
    PagedAttentionMetadata,
    PrefillSegment,
    UnsupportedAttentionFeature,
    register,
    sdpa_backends,
)
from tokenflow.runtime.attention.sliding import SlidingSegment, build_segment
from tokenflow.runtime.attention.snapkv import select_positions
from tokenflow.runtime.attention.topk import RECENT_BLOCKS, TopkDecode
from tokenflow.runtime.attention.triton_varlen import varlen_step
from tokenflow.runtime.cpu.native_kernels import load_native_kernels
from tokenflow.runtime.decode_graphs import DecodeGraphs
from tokenflow.runtime.fused_layers import fused_decoder_for, runs_own_copies
from tokenflow.runtime.gpu.triton_pointwise import TritonPointwise
from tokenflow.runtime.layer_families import model_window
from tokenflow.runtime.lora import LoraAdapter, step_rows
from tokenflow.runtime.sampler import GreedyTokens, SamplingRow
from tokenflow.runtime.step_graphs import StepGraphs

__all__ = ("PagedModelRunner", "SeqChunk", "all_layers_windowed", "check_model_supported", "own_window")

# RoPE types that depend on the batch's largest position: wrong when sequences are packed.
_UNSUPPORTED_ROPE = frozenset({"dynamic", "longrope"})
DECODE_GROUP_SLACK = 256  # tokens; see PagedModelRunner.decode_group_slack
# bf16/fp16 self-check: a result may differ from the reference by this many times what the model's own two attention
# implementations differ by (see PagedModelRunner.self_check)
ROUNDING_FLOOR_FACTOR = 3.0


@dataclass(slots=True)
class SeqChunk:
    """The work of one sequence in one step."""

    token_ids: list[int]  # tokens to compute now: a prefill chunk or one decode token
    start_pos: int  # this sequence's tokens already in the KV cache (cache positions start_pos .. +len-1)
    block_table: list[int]  # the sequence's blocks, covering at least start_pos + len(token_ids) tokens
    sample: bool  # whether the logits of the last token are wanted
    num_logits: int = 1  # with `sample`: logits of this many last tokens (a draft being verified)
    position_offset: int = 0  # RoPE position minus cache position (tokens dropped by kv_compression)
    adapter: LoraAdapter | None = None  # the LoRA adapter its rows run with (`runtime/lora.py`), None: the base


class _PackedRows:
    """The packed step's rows as chunks are added: token ids, positions and KV cache slots."""

    __slots__ = ("block_size", "ids", "last_row", "pos", "slots")

    def __init__(self, block_size: int, num_chunks: int) -> None:
        self.block_size = block_size
        self.ids: list[int] = []
        self.pos: list[int] = []
        self.slots: list[int] = []
        self.last_row = [0] * num_chunks  # packed row of each chunk's last token

    def add(self, index: int, c: SeqChunk) -> int:
        """Append chunk `index`'s tokens; returns its first row."""
        bs = self.block_size
        first = len(self.ids)
        s, e = c.start_pos, c.start_pos + len(c.token_ids)
        self.ids.extend(c.token_ids)
        self.pos.extend(range(s + c.position_offset, e + c.position_offset))
        table = c.block_table
        for b in range(s // bs, -(-e // bs)):  # slots block by block, not token by token
            base = table[b] * bs - b * bs
            self.slots.extend(range(base + max(s, b * bs), base + min(e, (b + 1) * bs)))
        self.last_row[index] = len(self.ids) - 1
        return first


@dataclass(slots=True)
class PackedStep:
    """Model inputs for one step (what `execute` feeds to the model)."""

    input_ids: torch.Tensor  # [1, num_tokens] long
    position_ids: torch.Tensor  # [1, num_tokens] long
    logits_to_keep: torch.Tensor  # [num_sampled] long: packed rows to project, in chunk order
    meta: PagedAttentionMetadata
    lora_rows: list[tuple[LoraAdapter, torch.Tensor]] = field(default_factory=list)  # packed rows per adapter


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-6)).item()


def check_model_supported(model: torch.nn.Module, max_model_len: int | None = None) -> None:
    """Refuse (ModelLoadError) models whose attention needs features paged attention lacks.

    Config inspection only; `PagedModelRunner.self_check` catches what configs do not say.
    """
    config = model.config
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    mtype = getattr(cfg, "model_type", type(model).__name__)

    def refuse(feature: str) -> ModelLoadError:
        return ModelLoadError(f"model type '{mtype}' uses {feature}, which the paged backend lacks")

    if not getattr(cfg, "is_causal", True) or getattr(cfg, "is_encoder_decoder", False):
        raise refuse("non-causal attention")
    if getattr(cfg, "num_attention_heads", None) is None:
        raise refuse("layers without attention (a state-space or recurrent model: no KV cache to page)")
    alibi = getattr(cfg, "alibi", False) or getattr(getattr(cfg, "attn_config", None), "alibi", False)
    if mtype == "bloom" or alibi:  # biases added to the scores per head and distance, not positions in Q and K
        raise refuse("ALiBi position biases")
    # a model's own sliding window (per layer where `layer_types` mixes them) and Gemma 2's attention logit
    # soft-capping reach the attention as arguments of each layer's call (`attention/model_window.py`)
    layer_types = getattr(cfg, "layer_types", None) or ()
    odd = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if odd:
        raise refuse(f"layer types {odd}")
    if any(hasattr(m, "sinks") and getattr(m, "layer_idx", None) is not None for m in model.modules()):
        raise refuse("attention sinks")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    ropes = rope.values() if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    for r in ropes:
        rtype = (r or {}).get("rope_type", (r or {}).get("type"))
        if rtype in _UNSUPPORTED_ROPE:
            raise refuse(f"'{rtype}' RoPE scaling")
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        raise refuse("a forward without `logits_to_keep`")
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        raise refuse("attention that does not go through transformers' AttentionInterface")


def own_window(config: object, max_model_len: int | None = None) -> int | None:
    """The model's own sliding window where it masks something within `max_model_len` (the model's context when
    None), else None."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = model_window(cfg)
    limit = max_model_len or getattr(cfg, "max_position_embeddings", None)
    return window if window is not None and (limit is None or window < limit) else None


def all_layers_windowed(config: object) -> bool:
    """Whether every layer attends through the model's own window (no full-attention layer keeps old keys)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(cfg, "layer_types", None)
    return model_window(cfg) is not None and (not layer_types or all(t == "sliding_attention" for t in layer_types))


def _rope_inv_freq(model: torch.nn.Module) -> torch.Tensor:
    """The RoPE frequencies of `model` (to re-rotate queries for sink keys); refuses models without
    plain RoPE, whose positions sliding attention cannot move."""
    for name, module in model.named_modules():
        if name.endswith("rotary_emb") and isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            if float(getattr(module, "attention_scaling", 1.0)) != 1.0:
                raise ModelLoadError("sliding attention needs RoPE without attention scaling")
            return module.inv_freq.detach().float().clone()
    raise ModelLoadError(f"{type(model).__name__} has no rotary embedding: sliding attention needs RoPE")


def _check_cache_matches(model: torch.nn.Module, kv_cache: KVCache) -> None:
    """The cache's geometry, dtype and device must be the model's."""
    geometry = KVCache.geometry(model.config)
    ours = (kv_cache.num_layers, kv_cache.num_kv_heads, kv_cache.head_dim)
    if geometry != ours:
        raise ModelLoadError(f"KV cache geometry (layers, kv_heads, head_dim)={ours} does not match the model's "
                             f"{geometry}")
    param = next(model.parameters())
    if param.dtype != kv_cache.dtype or param.device != kv_cache.device:
        raise ModelLoadError(f"model is {param.dtype} on {param.device}, the KV cache is {kv_cache.dtype} on "
                             f"{kv_cache.device}: they must match")


@contextlib.contextmanager
def _attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Temporarily run `model` with another attention implementation."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


class PagedModelRunner:
    """Runs packed steps of an HF causal LM over a `KVCache`.

    Construction switches `model` to paged attention for good (its own `forward`/`generate`
    then need a runner step's metadata) and runs `self_check`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        *,
        max_model_len: int | None = None,
        self_check: bool = True,
        window: int | None = None,
        sinks: int = 0,
        topk_budget: int | None = None,
        native_kernels: bool = True,
        fused_layers: bool = True,
        pack_weights: bool = True,
        release_weights: bool = False,
        triton_ops: bool = False,
        triton_attention: bool = False,
    ) -> None:
        check_model_supported(model, max_model_len)
        _check_cache_matches(model, kv_cache)
        if (window is not None or topk_budget is not None) and own_window(model.config, max_model_len) is not None:
            raise ModelLoadError("this model's own sliding window runs with attention='dense' only")
        self.model = model.eval()
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.dtype = kv_cache.dtype
        self.device = kv_cache.device
        self.num_layers = kv_cache.num_layers
        # bf16 on CPU: attention as bf16 matmuls (see tokenflow.runtime.attention.matmul)
        self.matmul_attention = kv_cache.dtype == torch.bfloat16 and kv_cache.device.type == "cpu"
        # C kernels where they build (tokenflow.runtime.cpu.native_kernels): decodes over the cache itself
        # (bf16 and fp32 on CPU); with matmul attention also the prefill softmax in one pass
        group = model.config.num_attention_heads // kv_cache.num_kv_heads
        on_cpu = kv_cache.device.type == "cpu" and kv_cache.dtype in (torch.bfloat16, torch.float32)
        self.native = load_native_kernels(kv_cache.head_dim, group) if native_kernels and on_cpu else None
        self.native_softmax = self.matmul_attention and self.native is not None
        # fp32 and bf16 on CPU: prefill chunks through the native kernel over the cache (every segment gets its
        # table); over an int8 cache its fp32 form, dequantising as it packs the keys.
        self.native_prefill = self.native is not None and (
            torch.float32 if kv_cache.quantized else kv_cache.dtype) in self.native.prefill_dtypes
        # the fused layers' norms, RoPE, SiLU product and K/V writes as Triton kernels (`cuda_triton_ops`)
        self.pointwise = TritonPointwise(kv_cache.head_dim) if triton_ops and self.native is None else None
        # every row of a step through one Triton kernel per layer over a float cache (`cuda_attention="triton"`)
        self.triton_attention = triton_attention and self.native is None
        self._attention: dict[bool, LayerAttention] = {}  # by cache kind (int8 or not): see `attention_for`
        # attention="sliding": chunks whose context outgrows `window` attend to sinks + window only.
        self.window = window
        self.sinks = sinks
        self.rope_inv_freq = _rope_inv_freq(model) if window is not None else None
        # attention="topk": decodes whose context exceeds the budget read only their best blocks.
        self.topk_budget = topk_budget
        if topk_budget is not None and not kv_cache.track_key_bounds:
            raise ModelLoadError("attention='topk' needs a KV cache that tracks per-block key bounds")
        # Decodes whose contexts differ by at most this many tokens share one padded gather + SDPA;
        # farther apart, the padding would cost more than another (small) attention call. Matmul
        # attention pays more per call than per padded key, and the native kernel reads each context's
        # own length (no padding): all decodes in one group.
        self.decode_group_slack = math.inf if self.matmul_attention or self.native else DECODE_GROUP_SLACK
        # Relative L2 error allowed by self_check: far above rounding, far below a mask off by one token.
        self.self_check_tolerance = 1e-4 if kv_cache.dtype == torch.float32 else 1e-2
        self.last_self_check_error: float | None = None
        previous = model.config._attn_implementation
        self._reference_attention = "sdpa" if previous in (None, ATTENTION_NAME) else previous
        # The self-check's reference: matmul attention is transformers' eager arithmetic (0 error there;
        # against bf16 SDPA any other implementation differs by ~1e-2, as much as a real bug).
        self._check_attention = "eager" if self.matmul_attention else self._reference_attention
        # Llama-family models: one flat loop of fused ops instead of the HF modules (tokenflow.runtime.fused_layers)
        # (few_rows: decode steps' linears through tokenflow.runtime.cpu.few_rows_linear, with the C kernels)
        # (post_ops: prefill chunks' MLP and output projection on oneDNN's fused post-ops, which round bf16 once
        # fewer than transformers' separate ops; torch-ops mode keeps the reference arithmetic)
        fast = pack_weights and native_kernels
        context = max_model_len or getattr(model.config, "max_position_embeddings", None)
        # release_weights: the HF layers' weights go as the fused layers copy them (packed); the self-check's
        # reference, which runs them, comes first
        release = release_weights and fused_layers and runs_own_copies(model, pack_weights)
        references = None
        if self_check and release:
            try:
                references = self._self_check_references()
            except Exception as e:  # the model's own forward fails: the self-check would have said so
                raise ModelLoadError(f"cannot run {type(model).__name__}'s own forward for the self-check: {e}") from e
        self.fused = fused_decoder_for(model, pack=pack_weights, few_rows=fast, post_ops=fast, native=self.native,
                                       pointwise=self.pointwise, max_context=context,
                                       release_layers=release) if fused_layers else None
        self.graphs: DecodeGraphs | None = None  # decode-only steps at fixed shapes (set by the backend)
        self.step_graphs: StepGraphs | None = None  # other steps at fixed shapes (`cuda_graph_prefill_steps`)
        self._switch_to_paged_attention(self_check, references)

    def _switch_to_paged_attention(self, self_check: bool,
                                   references: dict[str, torch.Tensor] | None = None) -> None:
        """Make the model call tokenflow's attention for good, and check it against the model's own;
        a model that refuses is left as it came, so that a caller can fall back to the `hf` backend."""
        model = self.model
        register()
        try:
            model.set_attn_implementation(ATTENTION_NAME)
            if model.config._attn_implementation != ATTENTION_NAME:
                raise ModelLoadError(f"{type(model).__name__} refuses custom attention implementations")
            if self_check:
                self.self_check(references)
        except Exception as e:
            model.set_attn_implementation(self._reference_attention)
            if isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"cannot switch {type(model).__name__} to paged attention: {e}") from e

    @property
    def attention(self) -> LayerAttention:
        """The attention variants for this runner's KV cache."""
        return self.attention_for(self.kv_cache)

    def attention_for(self, cache: KVCache) -> LayerAttention:
        """The attention variants for `cache` (`attention/layer.py`), chosen once per kind of cache (the
        self-check runs over a float cache of its own beside an int8 one)."""
        found = self._attention.get(cache.quantized)
        if found is None:
            found = self._attention[cache.quantized] = choose_attention(
                cache, self.native, matmul=self.matmul_attention, native_prefill=self.native_prefill,
                write=self.pointwise)
        return found

    # ------------------------------------------------------------------ step
    def execute(self, chunks: Sequence[SeqChunk], greedy: bool = False,
                sampling: Sequence[SamplingRow] | None = None, chained: Sequence[int] = (), defer: bool = False
                ) -> torch.Tensor | GreedyTokens | DeviceTokens | PendingTokens:
        """One forward over `chunks`; returns float32 logits `[rows, vocab]` on the CPU (the sampler runs
        there): `num_logits` rows per sampling chunk, in chunk order. With `greedy` (each chunk samples one
        row, its argmax, and nothing else reads its logits), the rows' tokens where the fused layers' greedy
        head settles them. With `sampling` (chunk i's sampling row), a step of the fixed-shape
        decode draws its tokens on the device; `chained` and `defer` as `DecodeGraphs.run` (a chained step that
        does not fit its shapes takes the tokens it chains on from the host)."""
        if self.graphs is not None and self.graphs.fits(chunks):
            return self.graphs.run(chunks, sampling, chained, defer)
        if chained:
            assert self.graphs is not None
            tokens = iter(self.graphs.chained_tokens([row for row in chained if row >= 0]))
            chunks = [replace(c, token_ids=[max(next(tokens), 0)]) if row >= 0 else c
                      for c, row in zip(chunks, chained, strict=True)]
        if self.step_graphs is not None and self.step_graphs.fits(chunks):
            return self.step_graphs.run(chunks)
        step = self.prepare(chunks, self.kv_cache)
        out = self._forward(step, greedy)
        return out if isinstance(out, GreedyTokens) else out.cpu()

    def _forward(self, step: PackedStep, greedy: bool = False, hidden: bool = False) -> torch.Tensor | GreedyTokens:
        """The step's logits (`greedy`: its tokens where the greedy head settles them); with `hidden`, the final
        norm's output of its kept rows instead."""
        rows = step_rows(step.lora_rows) if step.lora_rows else contextlib.nullcontext()
        with rows, torch.inference_mode(), sdpa_backends(self.device):
            if self.fused is not None:
                out = self.fused(step.input_ids, step.position_ids, step.logits_to_keep, step.meta, greedy, hidden)
                return out if isinstance(out, GreedyTokens) else out.float()
            inputs = dict(input_ids=step.input_ids, position_ids=step.position_ids, use_cache=False,
                          **{META_KWARG: step.meta})
            if hidden:  # the base model's output is the final norm's
                return self.model.base_model(**inputs).last_hidden_state[0].index_select(0, step.logits_to_keep).float()
            return self.model(**inputs, logits_to_keep=step.logits_to_keep).logits[0].float()  # [num_sampled, vocab]

    def hidden_states(self, token_ids: Sequence[int], chunk: int) -> torch.Tensor:
        """The final norm's output for every token of one sequence, `[len, hidden]` fp32 on the CPU (what
        transformers' base model returns as `last_hidden_state`): prefilled `chunk` tokens at a time over a
        scratch cache of its own, dropped after (embeddings keep no KV and take no block of the pool)."""
        bs = self.block_size
        blocks = -(-len(token_ids) // bs)
        scratch = KVCache(num_layers=self.num_layers, num_kv_heads=self.kv_cache.num_kv_heads,
                          head_dim=self.kv_cache.head_dim, num_blocks=blocks, block_size=bs, dtype=self.dtype,
                          device=self.device)
        table = list(range(blocks))
        rows = []
        for start in range(0, len(token_ids), chunk):
            piece = list(token_ids[start:start + chunk])  # every row kept: num_logits covers the chunk
            out = self._forward(self.prepare([SeqChunk(piece, start, table, True, len(piece))], scratch), hidden=True)
            assert isinstance(out, torch.Tensor)
            rows.append(out.cpu())
        return torch.cat(rows)

    def prepare(self, chunks: Sequence[SeqChunk], kv_cache: KVCache) -> PackedStep:
        """Pack `chunks` (decodes first, then prefill chunks, then sliding and top-k ones) and build the
        step's metadata."""
        decodes, prefills, sliding, sparse = self._classify(chunks)
        rows = _PackedRows(self.block_size, len(chunks))
        # every row in one Triton kernel: no decode groups or prefill segments to build (nor their tensors)
        varlen = self.triton_attention and not (kv_cache.quantized or sliding or sparse)
        groups = self._pack_decodes(chunks, decodes, rows, build_groups=not varlen)
        segments = []
        for i in prefills:
            row = rows.add(i, chunks[i])
            if not varlen:
                segments.append(self._prefill_segment(chunks[i], row))
        windowed = [self._sliding_segment(chunks[i], rows.add(i, chunks[i])) for i in sliding]
        topk = [self._topk_decode(chunks[i], rows.add(i, chunks[i])) for i in sparse]
        context = [chunks[i].start_pos + len(chunks[i].token_ids) for i in [*decodes, *prefills, *sparse]]
        if self.window is not None:
            context += [min(chunks[i].start_pos + len(chunks[i].token_ids), self.window + self.sinks) for i in sliding]
        keep = [r for i, c in enumerate(chunks) if c.sample
                for r in range(rows.last_row[i] - c.num_logits + 1, rows.last_row[i] + 1)]
        meta = PagedAttentionMetadata(
            kv_cache=kv_cache,
            slot_mapping=torch.tensor(rows.slots, dtype=torch.long, device=self.device),
            num_tokens=len(rows.ids),
            max_context=max(context),
            decodes=tuple(groups),
            prefills=tuple(segments),
            sliding=tuple(windowed),
            rope_inv_freq=self.rope_inv_freq,
            topk=tuple(topk),
            attention=self.attention_for(kv_cache),
            native=self.native,
        )
        if varlen:
            meta.varlen = varlen_step([(len(chunks[i].token_ids), chunks[i].start_pos + len(chunks[i].token_ids),
                                        chunks[i].block_table) for i in [*decodes, *prefills]],
                                      self.block_size, self.device)
        by_adapter: dict[int, tuple[LoraAdapter, list[int]]] = {}
        for i, c in enumerate(chunks):
            if c.adapter is not None:
                last = rows.last_row[i]
                by_adapter.setdefault(id(c.adapter), (c.adapter, []))[1].extend(
                    range(last - len(c.token_ids) + 1, last + 1))
        return PackedStep(
            input_ids=torch.tensor([rows.ids], dtype=torch.long, device=self.device),
            position_ids=torch.tensor([rows.pos], dtype=torch.long, device=self.device),
            logits_to_keep=torch.tensor(keep, dtype=torch.long, device=self.device),
            meta=meta,
            lora_rows=[(a, torch.tensor(r, dtype=torch.long, device=self.device)) for a, r in by_adapter.values()],
        )

    def _classify(self, chunks: Sequence[SeqChunk]) -> tuple[list[int], list[int], list[int], list[int]]:
        """Check each chunk; split them into decodes, prefill chunks, sliding-window and top-k ones."""
        if not chunks:
            raise ValueError("execute() needs at least one chunk")
        bs = self.block_size
        decodes: list[int] = []
        prefills: list[int] = []
        sliding: list[int] = []
        sparse: list[int] = []
        for i, c in enumerate(chunks):
            n = len(c.token_ids)
            if n == 0:
                raise ValueError(f"chunk {i} has no tokens")
            if c.start_pos < 0:
                raise ValueError(f"chunk {i} has a negative start_pos")
            if not 1 <= c.num_logits <= n:
                raise ValueError(f"chunk {i} asks for the logits of {c.num_logits} of its {n} tokens")
            if len(c.block_table) * bs < c.start_pos + n:
                raise ValueError(
                    f"chunk {i}: {len(c.block_table)} blocks of {bs} cannot hold {c.start_pos + n} tokens"
                )
            if self.window is not None and c.start_pos + n > self.window:
                sliding.append(i)
            elif self.topk_budget is not None and n == 1 and c.start_pos + 1 > self.topk_budget:
                sparse.append(i)
            else:
                (decodes if n == 1 else prefills).append(i)
        return decodes, prefills, sliding, sparse

    def _pack_decodes(self, chunks: Sequence[SeqChunk], decodes: list[int], rows: _PackedRows,
                      build_groups: bool = True) -> list[DecodeGroup]:
        """One row each, longest context first, cut into groups of similar length (without `build_groups`: the
        rows only)."""
        decodes.sort(key=lambda i: chunks[i].start_pos, reverse=True)
        if not build_groups:
            for i in decodes:
                rows.add(i, chunks[i])
            return []
        groups: list[DecodeGroup] = []
        group: list[int] = []
        for i in decodes:
            if group and chunks[group[0]].start_pos - chunks[i].start_pos > self.decode_group_slack:
                groups.append(self._decode_group(chunks, group, rows.last_row[group[0]]))
                group = []
            group.append(i)
            rows.add(i, chunks[i])
        if group:
            groups.append(self._decode_group(chunks, group, rows.last_row[group[0]]))
        return groups

    def _prefill_segment(self, c: SeqChunk, row: int) -> PrefillSegment:
        """A prefill chunk's contiguous rows, attended as one segment."""
        bs = self.block_size
        s, t = c.start_pos, len(c.token_ids)
        e = s + t
        block_ids = None
        if s > 0 or self.native_prefill:
            block_ids = torch.tensor(c.block_table[: -(-e // bs)], dtype=torch.long, device=self.device)
        mask = None
        # the native softmax and the native prefill mask by position
        if (s > 0 or self.matmul_attention) and not (self.native_softmax or self.native_prefill):
            # [t, e] additive: row i (position s + i) sees keys j <= s + i; two cheap ops
            mask = torch.full((t, e), float("-inf"), dtype=self.dtype, device=self.device).triu_(s + 1)
        return PrefillSegment(row, row + t, s, e, block_ids, mask)

    def _sliding_segment(self, c: SeqChunk, row: int) -> SlidingSegment:
        """A chunk whose context is past the window: the sinks and the window only."""
        assert self.window is not None
        return build_segment(row, c.start_pos, len(c.token_ids), c.block_table, self.block_size, self.window,
                             self.sinks, self.device)

    def _topk_decode(self, c: SeqChunk, row: int) -> TopkDecode:
        """A decode whose context is past the top-k budget: it reads only its best blocks."""
        assert self.topk_budget is not None
        bs = self.block_size
        used = -(-(c.start_pos + 1) // bs)
        return TopkDecode(
            row=row, block_ids=torch.tensor(c.block_table[:used], dtype=torch.long, device=self.device),
            context=c.start_pos + 1, keep_blocks=max(self.topk_budget // bs, RECENT_BLOCKS + 1),
            sink_blocks=-(-self.sinks // bs),
        )

    def _decode_group(self, chunks: Sequence[SeqChunk], members: list[int], q_start: int) -> DecodeGroup:
        """Index tensors and padding mask of decodes `members` (longest context first)."""
        bs = self.block_size
        ctx = [chunks[i].start_pos + 1 for i in members]
        kv_len = ctx[0]
        max_blocks = -(-kv_len // bs)
        flat: list[int] = []
        for i, n_ctx in zip(members, ctx):
            used = -(-n_ctx // bs)
            flat.extend(chunks[i].block_table[:used])
            if used < max_blocks:
                flat.extend([0] * (max_blocks - used))  # padding: block 0's (finite) contents get masked
        lengths = mask = None
        if self.native is not None:  # the kernel (an int8 cache's too) reads each context's own length: no padding
            lengths = torch.tensor(ctx, dtype=torch.long, device=self.device)
        elif ctx[-1] != kv_len:
            # Boolean (True = attend): as fast as an additive mask here, and one op to build.
            ctx_t = torch.tensor(ctx, dtype=torch.long, device=self.device)  # [n]
            seen = torch.arange(kv_len, device=self.device)[None, :] < ctx_t[:, None]  # [n, kv_len]
            if self.matmul_attention:  # additive
                seen = torch.zeros(seen.shape, dtype=self.dtype, device=self.device).masked_fill_(~seen, float("-inf"))
            mask = seen.view(len(members), 1, 1, kv_len)
        return DecodeGroup(
            q_start=q_start,
            q_end=q_start + len(members),
            block_ids=torch.tensor(flat, dtype=torch.long, device=self.device),
            max_blocks=max_blocks,
            kv_len=kv_len,
            mask=mask,
            lengths=lengths,
        )

    def compress(self, window: SeqChunk, table: list[int], keep: int, sinks: int) -> None:
        """kv_compression: run `window` (the prompt's last tokens, computed again) as a scoring step, then copy
        each layer's and KV head's `keep` best prompt positions (`attention.snapkv`) into the blocks `table`."""
        step = self.prepare([window], self.kv_cache)
        step.meta.key_scores = []
        self._forward(step)  # rewrites the window's K/V (the same values) and records every layer's scores
        bs, device = self.block_size, self.device
        old = torch.tensor(window.block_table, dtype=torch.long, device=device)
        new = torch.tensor(table, dtype=torch.long, device=device)
        kept = torch.arange(keep, device=device)
        dst = new[kept // bs] * bs + kept % bs
        for layer, scores in enumerate(step.meta.key_scores):
            positions = select_positions(scores, keep, sinks, len(window.token_ids))  # [KVH, keep]
            self.kv_cache.copy_positions(layer, old[positions // bs] * bs + positions % bs, dst)

    # ------------------------------------------------------------ self-check
    def _reference_rows(self, attention: str, a: list[int], b: list[int]) -> torch.Tensor:
        """The model's own logits, through `attention`, at the rows the self-check compares."""
        with _attention_implementation(self.model, attention), torch.inference_mode():
            ref_a = self.model(torch.tensor([a], device=self.device), use_cache=False).logits[0].float()  # [11, vocab]
            ref_b = self.model(torch.tensor([b], device=self.device), use_cache=False).logits[0].float()  # [7, vocab]
        return torch.stack([ref_b[4], ref_b[5], ref_a[9], ref_a[10], ref_b[6]])

    def _self_check_prompts(self) -> tuple[list[int], list[int]]:
        """The self-check's two prompts (11 and 7 tokens, seeded)."""
        vocab = int(self.model.config.get_text_config().vocab_size)
        gen = torch.Generator().manual_seed(0)
        a = torch.randint(0, vocab, (11,), generator=gen).tolist()
        return a, torch.randint(0, vocab, (7,), generator=gen).tolist()

    def _self_check_references(self) -> dict[str, torch.Tensor]:
        """The model's own rows for `self_check`, through each attention it may compare with (the second only in
        bf16 and fp16, where it measures the rounding floor): computed while the HF modules can still run."""
        a, b = self._self_check_prompts()
        names = [self._check_attention]
        if self.dtype != torch.float32:
            names.append("sdpa" if self._check_attention != "sdpa" else "eager")
        return {name: self._reference_rows(name, a, b) for name in names}

    def self_check(self, references: dict[str, torch.Tensor] | None = None) -> None:
        """Compare paged logits with the model's own attention on a short mixed workload.

        Two sequences over three steps in a private scratch cache: a first prefill chunk,
        a second chunk at an offset next to a whole short prompt, then decodes with different
        context lengths. Raises ModelLoadError when the model sends arguments paged attention
        does not implement, bypasses it, or the logits differ beyond tolerance. `references`: the model's own
        rows by attention (`_self_check_references`), where they were computed before its weights were released.
        """
        a, b = self._self_check_prompts()
        references = references or {}
        bs = self.block_size
        need_a, need_b = -(-len(a) // bs), -(-len(b) // bs)
        scratch = KVCache(
            num_layers=self.num_layers,
            num_kv_heads=self.kv_cache.num_kv_heads,
            head_dim=self.kv_cache.head_dim,
            num_blocks=need_a + need_b + 1,
            block_size=bs,
            dtype=self.dtype,
            device=self.device,
        )
        # Interleaved, reversed block ids so a wrong slot mapping cannot pass by luck.
        table_a = list(range(need_a + need_b, 0, -1))[0::2][:need_a]
        rest = [x for x in range(1, need_a + need_b + 1) if x not in table_a]
        table_b = rest[:need_b]
        steps = [
            [SeqChunk(a[:6], 0, table_a, False), SeqChunk(b[:5], 0, table_b, True)],
            [SeqChunk(b[5:6], 5, table_b, True), SeqChunk(a[6:10], 6, table_a, True)],
            [SeqChunk(a[10:11], 10, table_a, True), SeqChunk(b[6:7], 6, table_b, True)],
        ]
        ours: list[torch.Tensor] = []
        calls: list[int] = []
        exact = self.fused.without_few_rows_kernel() if self.fused is not None else contextlib.nullcontext()
        try:
            with exact:
                for chunks in steps:
                    step = self.prepare(chunks, scratch)
                    step.meta.calls = calls
                    ours.append(self._forward(step))
        except UnsupportedAttentionFeature as e:
            raise ModelLoadError(f"{type(self.model).__name__}: {e}") from e
        if sorted(set(calls)) != list(range(self.num_layers)) or len(calls) != len(steps) * self.num_layers:
            raise ModelLoadError(
                f"{type(self.model).__name__} did not route every layer's attention through paged attention "
                f"(layers seen: {sorted(set(calls))})"
            )
        got = torch.cat(ours)  # rows: b4 | b5, a9 | a10, b6
        want = references.get(self._check_attention)
        if want is None:
            want = self._reference_rows(self._check_attention, a, b)
        err = _relative_error(got, want)
        tol = self.self_check_tolerance
        if not err <= tol and self.dtype != torch.float32:
            # The model's own two attention implementations differ by rounding too, and in a deep model it grows
            # past the fixed bound: allow a few times that measured floor (a wrong mask or slot is ~100x it).
            other = "sdpa" if self._check_attention != "sdpa" else "eager"
            floor = references.get(other)
            if floor is None:
                floor = self._reference_rows(other, a, b)
            tol = max(tol, ROUNDING_FLOOR_FACTOR * _relative_error(floor, want))
        if not err <= tol:
            raise ModelLoadError(
                f"{type(self.model).__name__}: paged attention logits differ from the model's own "
                f"(relative error {err:.2e} > {tol:.0e}); the model is not supported by the paged backend"
            )
        self.last_self_check_error = err
