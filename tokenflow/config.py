"""Engine configuration: one msgspec Struct, filled from a TOML file, the
environment (`TOKENFLOW_*`) and keywords, in rising order of precedence.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from tokenflow.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ("AttentionPolicy", "EngineConfig", "did_you_mean")

ENV_PREFIX = "TOKENFLOW_"
# Environment variables with this prefix that are not engine settings (any other is one, or a typo).
_ENV_NOT_SETTINGS = frozenset({
    "TOKENFLOW_HOME",  # the model cache folder
    "TOKENFLOW_PLUGINS",  # which plugins may load
    "TOKENFLOW_CONFIG",  # a TOML file of settings
    "TOKENFLOW_API_KEY",  # `tokenflow serve --api-key`
    "TOKENFLOW_TEST_MODEL",  # the pytest plugin's model
    "TOKENFLOW_INDEX_URL",  # the package index the embedded model's wheel comes from
    "TOKENFLOW_KERNEL_CFLAGS",  # extra compiler flags of the native CPU kernels
    "TOKENFLOW_VLLM_PYTHON",  # `tokenflow bench --peers vllm`: the peer's interpreter
})

Positive = Annotated[int, msgspec.Meta(gt=0)]


@dataclass(frozen=True)
class AttentionPolicy:
    """Which keys each query reads, from the `attention`, `window`, `sink_tokens`, `topk_budget` settings:
    one object for the scheduler (blocks it may free), the runner (what it computes) and cache keys."""

    kind: Literal["dense", "sliding", "topk"] = "dense"
    window: int | None = None  # sliding: recent tokens each query sees
    sink_tokens: int = 0  # sliding / topk: first tokens every query also sees
    topk_budget: int | None = None  # topk: tokens (whole blocks) each decode query reads

    @property
    def fingerprint(self) -> str:
        """What changes the K/V a block holds (part of the prefix-cache keys)."""
        if self.kind == "sliding":
            return f"sliding:{self.window}:{self.sink_tokens}"
        if self.kind == "topk":
            return f"topk:{self.topk_budget}:{self.sink_tokens}"
        return "dense"


# Tokens computed per step by default. On CUDA a small model's step is launch-bound, so 2,048 prompt tokens
# cost about what 512 do (measured: docs/benchmarks.md, On a GPU).
DEFAULT_BATCH_TOKENS = {"cpu": 512, "cuda": 2048}


def _help(meaning: str, *, default: str | None = None) -> msgspec.Meta:
    """A setting's meaning, kept beside its field: the settings reference (`docs/reference/settings.md`) is built
    from it, and `msgspec.json.schema(EngineConfig)` carries it. `default` says in words what a default that is
    derived at start (None, or one that depends on the device) comes to."""
    return msgspec.Meta(description=meaning, extra={"default": default} if default is not None else None)


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Every engine setting. Field names are public (DESIGN §3); each field's meaning is written beside it
    (`_help`), and the settings reference (docs/reference/settings.md) is generated from those.

    `None` means "derive at start": `max_model_len` from the model config,
    the KV pool from `num_kv_blocks`, else `kv_cache_bytes`, else a share of the available memory.
    """

    model: Annotated[str | None, _help(
        "alias (`smollm2-135m`, `smollm2-135m-q4_1`), HF folder, `.gguf` file or hub id",
        default="`smollm2-135m`")] = None
    backend: Annotated[str, _help(
        "`paged` (tokenflow's KV cache, continuous batching) or `hf` (transformers `generate`)")] = "paged"
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], _help(
        "`auto` (bf16 on CUDA and on CPUs with AVX512-BF16 or AMX, fp32 on other CPUs), `float32`, `bfloat16`, "
        "`float16`")] = "auto"
    device: Annotated[str, _help("`auto`, `cpu`, `cuda`, `cuda:N`")] = "auto"
    max_model_len: Annotated[Positive | None, _help(
        "context length (prompt + output)", default="the model's")] = None
    block_size: Annotated[Positive, _help("tokens per KV block")] = 16
    num_kv_blocks: Annotated[Positive | None, _help(
        "KV pool size in blocks; else `kv_cache_bytes`, else `kv_cache_memory_fraction` of the available memory "
        "at start, capped at what `max_num_seqs` full-length sequences need; the rule and figures are logged. A "
        "pool smaller than one `max_model_len` sequence: `ConfigError` when `max_model_len` was set, else the "
        "served context is clamped to the pool (warning)", default="derived")] = None
    kv_cache_bytes: Annotated[Positive | None, _help(
        "KV pool size in bytes, when `num_kv_blocks` is not set", default="derived")] = None
    kv_cache_memory_fraction: Annotated[Annotated[float, msgspec.Meta(gt=0.0, le=0.95)] | None, _help(
        "share of the available memory at start that the KV pool takes when neither `num_kv_blocks` nor "
        "`kv_cache_bytes` is set: of `MemAvailable` on CPU (free plus reclaimable page cache), of the device memory "
        "still free after a profiling step of `max_batch_tokens` tokens on CUDA",
        default="0.05 on CPU, 0.6 on CUDA")] = None
    max_num_seqs: Annotated[Positive, _help("sequences in a step")] = 32
    max_batch_tokens: Annotated[Positive | None, _help(  # None: per device (`DEFAULT_BATCH_TOKENS`)
        "tokens computed per step (prefill chunks + decodes)", default="512 on CPU, 2048 on CUDA")] = None
    max_queue: Annotated[Positive, _help(
        "waiting requests (queued or still on the request path) before `Overloaded`")] = 4096
    priority_aging_s: Annotated[Annotated[float, msgspec.Meta(gt=0.0)] | None, _help(
        "seconds of waiting worth one priority level, so lower-priority work is delayed, never starved "
        "(none: strict priorities)")] = 30.0
    prompt_token_wait_s: Annotated[float, msgspec.Meta(ge=0.0), _help(
        "each prompt token counts as this much later arrival in the queue: of requests arriving together the "
        "shorter prompts start first (lower median time to first token); a long prompt is passed only by requests "
        "arriving within its tokens x this after it (0: arrival order)")] = 0.0005
    kv_high_watermark: Annotated[float, msgspec.Meta(gt=0.0, le=1.0), _help(
        "share of KV blocks in use above which new prefills wait, leaving room for running requests to grow")] = 0.95
    kv_low_watermark: Annotated[float, msgspec.Meta(gt=0.0, le=1.0), _help(
        "below this share, a batch limit lowered by a preemption grows back by one sequence per step")] = 0.7
    max_queue_tokens: Annotated[Positive | None, _help(
        "prompt tokens waiting to be prefilled before `Overloaded` (none: no limit)")] = None
    breaker_error_rate: Annotated[float, msgspec.Meta(gt=0.0, le=1.0), _help(
        "the circuit breaker opens when more than this share of the last `breaker_window` requests failed "
        "(`EngineError`)")] = 0.5
    breaker_step_p95_ms: Annotated[Annotated[float, msgspec.Meta(gt=0.0)] | None, _help(
        "the circuit breaker also opens when the p95 step time over the last `breaker_window` steps is above this "
        "(none: latency check off)")] = None
    breaker_window: Annotated[int, msgspec.Meta(ge=4), _help(
        "outcomes and steps the breaker looks at; it needs half a window (at least 4) before it trips")] = 50
    breaker_open_s: Annotated[float, msgspec.Meta(gt=0.0), _help(
        "how long an open breaker refuses requests (`Overloaded.retry_after` = the time left)")] = 5.0
    breaker_probes: Annotated[Positive, _help(
        "requests a half-open breaker lets through; all succeed: it closes, one fails: it opens again")] = 2
    timeout: Annotated[Annotated[float, msgspec.Meta(gt=0.0)] | None, _help(
        "default per-request timeout (s) (none: no timeout)")] = None
    request_stages: Annotated[list[str], _help(
        "your middleware on the request path, in order (entry points in `tokenflow.stages`); the engine runs it "
        "after admission (queue bounds, breaker) and before the response cache and tokenizing, which it runs "
        "itself. A list from before 0.2 that names `breaker`, `disk_tier`, `tokenizer`, `prefetcher` or "
        "`redis_tier` is read the old way, with a `DeprecationWarning`")] = msgspec.field(default_factory=list)
    kv_tiers: Annotated[list[str], _help(
        "KV tiers below the pool, in order (entry points in `tokenflow.kv_tiers`; `disk` is on with `cache_dir`; "
        "`redis` with the Redis plugin); a tier that keeps responses also serves the response cache"
    )] = msgspec.field(default_factory=lambda: ["disk"])
    prefetch: Annotated[bool, _help(
        "start loading a queued request's cached prefix from the tiers as it is queued (false: when the scheduler "
        "first tries to admit it)")] = True
    scheduler: Annotated[str, _help(
        "the step loop's scheduler (entry points in `tokenflow.schedulers`; `batcher`, its old name, still "
        "works)")] = "scheduler"
    batcher: Annotated[str | None, _help(
        "deprecated: the old name of `scheduler`; when set, it wins (with a `DeprecationWarning`)")] = None
    kv_pool: Annotated[str, _help(
        "the KV pool plugin that keeps the KV block pool's books (entry points in `tokenflow.kv_pools`)"
    )] = "token_pool"
    prefix_caching: Annotated[bool, _help(
        "share the KV of equal prompt prefixes between requests and keep it after they end")] = True
    eviction_policy: Annotated[str, _help(
        "which cached block goes first: `lfu_lru` (decayed use counts) or `lru`; or a plugin's name (entry points "
        "in `tokenflow.eviction_policies`)")] = "lfu_lru"
    eviction_half_life: Annotated[float, msgspec.Meta(gt=0.0), _help(
        "`lfu_lru`: finished requests after which a use of a block counts half")] = 64.0
    cache_dir: Annotated[str | None, _help(
        "the disk tier's folder (KV blocks evicted from the pool, and cached responses); no disk tier when "
        "unset")] = None
    disk_cache_bytes: Annotated[Positive, _help(
        "size limit of `cache_dir` (least recently used entries go first)")] = 4 * 2**30
    disk_retry_s: Annotated[float, msgspec.Meta(gt=0.0), _help(
        "after an I/O error the disk tier is off this long, then reopens the folder")] = 30.0
    prefetch_concurrency: Annotated[Positive, _help(
        "reader threads loading queued requests' prefixes from disk")] = 2
    response_cache: Annotated[bool, _help(
        "answer repeated deterministic requests (greedy, or seeded) from a cache; per request: "
        "`cache_response=True/False`")] = False
    response_cache_size: Annotated[Positive, _help(
        "entries of the in-memory response cache (on disk too with `cache_dir`)")] = 1024
    response_cache_ttl_s: Annotated[float, msgspec.Meta(gt=0.0), _help(
        "seconds a cached response is served")] = 3600.0
    length_buckets: Annotated[list[Positive], _help(
        "prompt-length buckets for static (`hf`) batches")] = msgspec.field(
        default_factory=lambda: [32, 64, 128, 256, 512, 1024, 2048])
    tokenizer_window_ms: Annotated[float, msgspec.Meta(ge=0.0), _help(
        "window in which prompts are coalesced into one batch encode")] = 1.0
    tokenizer_cache_size: Annotated[int, msgspec.Meta(ge=0), _help(
        "entries of the LRU of prompt encodings (only prompts that fit the context are kept)")] = 1024
    tokenizer_cache_bytes: Annotated[int, msgspec.Meta(ge=0), _help(
        "bytes of prompt text and token ids that LRU keeps")] = 64 * 2**20
    # -- request limits (every field of a request is untrusted) --
    default_max_tokens: Annotated[Positive, _help(
        "tokens a request without `max_tokens` may generate (fewer when the context has less room)")] = 128
    clamp_max_tokens: Annotated[bool, _help(
        "an explicit `max_tokens` past the context is refused (`InvalidRequest`); true: clamped to the room "
        "left")] = False
    max_prompt_chars: Annotated[Positive | None, _help(
        "characters of a text prompt (or of chat messages) refused before tokenizing; default `max_model_len` x "
        "the longest vocabulary entry x 2 (a prompt longer than that cannot fit)", default="derived")] = None
    max_stop_strings: Annotated[Positive, _help("stop strings per request")] = 16
    max_stop_string_chars: Annotated[Positive, _help("characters per stop string")] = 256
    max_stop_token_ids: Annotated[Positive, _help("`stop_token_ids` per request")] = 256
    max_logprobs: Annotated[int, msgspec.Meta(ge=0), _help(
        "top alternatives per token a request may ask for")] = 20
    max_grammar_chars: Annotated[Positive, _help(
        "size of a request's `json_schema` / `regex` / `grammar` / `choice`")] = 65536
    grammar_cache_size: Annotated[Positive, _help("compiled output constraints kept for reuse")] = 256
    max_logit_bias: Annotated[Positive, _help("tokens one request's `logit_bias` may name")] = 1024
    max_n: Annotated[Positive, _help(
        "samples one `generate_many` / `chat_many` (HTTP `n`) may ask for")] = 16
    max_embed_inputs: Annotated[Positive, _help(
        "texts or token-id lists one `embed` call (HTTP `input`) may hold")] = 256
    allow_special_tokens_in_chat: Annotated[bool, _help(
        "chat content spelling the model's control tokens is tokenized as plain text; true parses them (the old "
        "behaviour)")] = False
    # -- tiers --
    cache_secret: Annotated[str | None, _help(
        "key of the MAC on every disk and Redis entry (replicas sharing a folder or Redis share it); none: the "
        "disk tier creates a random secret in `cache_dir`")] = None
    tier_load_timeout_s: Annotated[float, msgspec.Meta(gt=0.0), _help(
        "a disk or Redis load still running after this is given up: the request recomputes its prefix")] = 5.0
    disk_flush_timeout_s: Annotated[float, msgspec.Meta(ge=0.0), _help(
        "`aclose()` writes the pool's blocks to disk, hottest first, for at most this long")] = 10.0
    num_threads: Annotated[Positive | None, _help(
        "the model's CPU threads", default="torch's default: the physical cores")] = None
    thread_policy: Annotated[Literal["adaptive", "fixed"], _help(
        "CPU: `adaptive` runs on up to `num_threads`, one fewer while the model's threads wait for cores other "
        "processes hold, one more when a core stays idle (`runtime/cpu/core_share.py`); `fixed` always "
        "`num_threads`")] = "adaptive"
    self_check: Annotated[bool, _help(
        "`paged`: at load, compare the paged attention's logits with the model's own attention on a short mixed "
        "workload, and refuse the model (`ModelLoadError`) when they differ beyond rounding")] = True
    attention: Annotated[Literal["dense", "sliding", "topk"], _help(
        "`dense`; `topk` (see `topk_budget`); or `sliding`: each query sees the first `sink_tokens` tokens and the "
        "last `window` tokens (StreamingLLM); blocks behind the window are freed, so KV memory stays flat and "
        "generation can run past the model's trained context (raise `max_model_len`)")] = "dense"
    window: Annotated[Positive, _help("`sliding`: the recent tokens each query sees")] = 1024
    sink_tokens: Annotated[int, msgspec.Meta(ge=0), _help(
        "`sliding` / `topk`: the first tokens every query also sees (attention sinks; top-k keeps the sink blocks "
        "too)")] = 4
    topk_budget: Annotated[Positive, _help(
        "`attention=\"topk\"`: tokens (whole blocks) each decode query reads: the sink blocks, the two most recent "
        "blocks, and the blocks with the highest upper bound of q·k from per-block key minima/maxima (Quest); "
        "prefill stays dense")] = 1024
    warmup: Annotated[bool, _help(
        "at start, run short requests at each decode batch size so the first user request pays no one-time "
        "costs")] = False
    compile: Annotated[bool, _help(
        "pad decode batches to static sizes (1, 2, 4, … `max_num_seqs`) and run the gated MLPs through "
        "`torch.compile` (`reduce-overhead` on CUDA); off by default: on the 2-core CPU it measured no faster "
        "(`tokenflow bench-step`)")] = False
    kv_compression: Annotated[Literal["snapkv"] | None, _help(
        "`snapkv`: after the prefill of a prompt of at least `kv_compression_min_tokens`, keep only "
        "~1/`kv_compression_ratio` of its K/V: the positions its last `kv_compression_window` tokens attend to "
        "most, per layer and KV head, with the `sink_tokens` and the window; dense attention only")] = None
    kv_compression_ratio: Annotated[float, msgspec.Meta(ge=1.0), _help(
        "`snapkv`: a compressed prompt keeps about 1/this of its K/V")] = 4.0
    kv_compression_min_tokens: Annotated[Positive, _help(
        "`snapkv`: prompts at least this long are compressed")] = 1024
    kv_compression_window: Annotated[int, msgspec.Meta(ge=2), _help(
        "`snapkv`: the last prompt tokens whose attention scores the positions to keep; they are kept too")] = 32
    kv_cache_dtype: Annotated[Literal["auto", "int8"], _help(
        "`auto`: the model's dtype; `int8`: K/V stored as int8 with an fp32 scale per token and KV head (1.88× the "
        "blocks in the same bytes at head_dim 64); the native decode and prefill kernels read it in place, "
        "dequantising as they read; tiers store the int8 form; not with `attention=\"topk\"`")] = "auto"
    quantization: Annotated[Literal["int8"] | None, _help(
        "`int8`, paged backend, Llama-family models. CPU: int8 weights (per output channel) and int8 activations "
        "(per token, SmoothQuant-smoothed) in the linear layers, through tokenflow's AVX512-VNNI kernel, "
        "calibrated at the first load and saved under `$TOKENFLOW_HOME/quantized`. CUDA: weight-only int8 through "
        "torchao (`pip install 'tokenflow-engine[cuda-int8]'`), activations bf16")] = None
    gguf_weights: Annotated[Literal["quantized", "dequantized"], _help(
        "a `.gguf` model's tensors as the file holds them (`paged` on CPU; Llama, Mistral, Qwen2, Qwen3 files), or "
        "`dequantized` once to fp32 (every other case takes that too, with a log line)")] = "quantized"
    async_scheduling: Annotated[bool, _help(
        "`paged`: plan each decode step while the one before runs (vLLM's async scheduling, SGLang's overlap "
        "scheduler), so the step's host work (applying its output, streaming, planning) is off the model's "
        "critical path; the next step's input tokens are handed over on the model thread (on CUDA, where the "
        "graphs draw them, on the device: the next step is queued before they reach the host). Chains plain decode "
        "steps only (no waiting request, grammar, penalties, min_tokens, logit_bias, prompt logprobs, "
        "speculation, sliding window or kv_compression; those steps plan as usual). A request that stops on EOS "
        "or a stop string computes one token more, which is dropped, and a new request is admitted one step "
        "later. On the 2-core CPU at concurrency 16, requests/s within run-to-run noise and TTFT p50 7-38% "
        "worse (docs/benchmarks.md), so off by default; on CUDA unmeasured (`scripts/gpu_check.py` times it)")] = False
    cuda_graphs: Annotated[bool, _help(
        "on CUDA, Llama-family models: decode-only steps replayed from CUDA graphs captured at start, one per "
        "(batch, context) bucket (see How it works); 4.7x the requests/s of eager steps at concurrency 16 on an "
        "H200")] = True
    cuda_attention: Annotated[Literal["sdpa", "triton"], _help(
        "on CUDA, how attention reads the paged KV cache: `sdpa` gathers the blocks it needs into a contiguous copy "
        "and runs torch's SDPA (per decode group and prefill chunk; in CUDA-graph decode steps, over each row's "
        "context bucket with a length mask); `triton` reads them in place through the block tables, to each "
        "row's own length: one kernel per layer for every row of a step (decodes and prefill chunks alike), and "
        "in CUDA-graph decode steps a kernel split over enough programs to fill the GPU (flash-decoding). Needs "
        "the triton package (`sdpa` serves where it is missing). Tested on the CPU under Triton's interpreter and "
        "compiled for sm_80 and sm_90 there; not yet run on a GPU (`scripts/gpu_check.py` times both), so "
        "`sdpa` stays the default")] = "sdpa"
    cuda_graph_prefill_steps: Annotated[bool, _help(
        "with `cuda_graphs` and `cuda_attention=\"triton\"`: steps that hold prefill chunks replay CUDA graphs too, "
        "one per bucket of their token count (16, 32, … `max_batch_tokens`), their attention in the varlen Triton "
        "kernel: a step that holds part of a prompt is otherwise launched kernel by kernel from Python. Tested on "
        "the CPU at fixed shapes against transformers; not yet run on a GPU, so off by default")] = False
    cuda_triton_ops: Annotated[bool, _help(
        "on CUDA, the fused layers' RMSNorms (each with the residual add before it), Q/K head norms, RoPE, SiLU "
        "product and K/V writes as one Triton kernel each instead of chains of torch ops (~11 kernels a layer "
        "instead of ~29: a small model's decode step is bound by kernel count), with the torch ops' bf16 "
        "roundings. Needs the triton package. Their "
        "arithmetic is tested on the CPU under Triton's interpreter and they compile for sm_80 and sm_90 there; "
        "not yet run on a GPU (`scripts/gpu_check.py` times them), so off by default")] = False
    speculative_tokens: Annotated[int, msgspec.Meta(ge=0, le=16), _help(
        "`paged`, greedy requests without penalties or logprobs: each step proposes up to this many draft tokens "
        "by n-gram lookup in the request's own context (prompt lookup decoding) and verifies them in the same "
        "forward, keeping the verified prefix; output equals plain greedy decoding (up to the near ties any change "
        "of batch shape can flip). 3 is a good value on CPU for a single stream (see the benchmarks); needs "
        "`attention=\"dense\"`")] = 0
    speculative_max_seqs: Annotated[Positive, _help(
        "speculate only while at most this many requests run: past a few rows per step the draft rows cost real "
        "compute")] = 4
    # Requests of several adapters and none share a batch; the model runs its transformers modules then (not the
    # fused CPU layers) in fp32/bf16, with no int8, GGUF-quantised weights or compile
    lora_adapters: Annotated[dict[str, str], _help(
        "LoRA adapters (PEFT folders) by name, served from the start; requests pick one with `lora=` (HTTP "
        "`model`)")] = msgspec.field(default_factory=dict)
    enable_lora: Annotated[bool, _help(
        "LoRA without adapters at start, for `load_lora` later (the model runs its transformers modules)")] = False
    max_loras: Annotated[Positive, _help("LoRA adapters served at once")] = 8
    pack_cpu_weights: Annotated[bool, _help(
        "`paged` on CPU in fp32 or bf16: linear layers also keep a copy of their weight packed in oneDNN's blocked "
        "layout and use it for every input (on the 2-core CPU a one-row fp32 product reads weights at ~17 GB/s "
        "through the BLAS path and 30–48 GB/s packed, so a batch-1 fp32 decode step goes from 37.8 to 20.7 ms; "
        "1.6–2x faster GEMMs at 16 rows; bf16: 9–13% off decode and prefill steps); with the C kernels "
        "(`native_kernels`), decode steps of up to 64 rows use a third copy, packed for tokenflow's few-rows kernel "
        "(bf16 batch-1 decode steps 1.7× faster than oneDNN's, batch 16 1.3×), and in fp32 with AVX512-BF16 a bf16 "
        "copy of the head for steps whose rows are all plain greedy (`runtime/cpu/greedy_head.py`); costs those "
        "copies of the linear weights, so turn it off when RAM is tight")] = True
    fused_layers: Annotated[bool, _help(
        "`paged`: the decoders of the families the fused loop knows (Llama, Mistral, Qwen2/3, Gemma/Gemma 3, "
        "Phi-3, Granite, OLMo2) run as one flat loop of fused operations over the HF model's own weights instead "
        "of the HF modules (see How it works)")] = True
    native_kernels: Annotated[bool, _help(
        "`paged`, bf16 and fp32 on CPU: build `runtime/cpu/cpu_kernels.c` with the system C compiler (`$CC`, "
        "default `cc`, with OpenMP) at first use, ~0.3 s, cached in `~/.cache/tokenflow/kernels`; decodes then "
        "attend over the paged blocks without gathering them, prefill tiles do their softmax in one pass, and each "
        "RMSNorm, RoPE, SiLU product and KV write is one call (see How it works); with `pack_cpu_weights`, decode "
        "steps' linears (up to 64 rows, bf16 or fp32) run `runtime/cpu/few_rows_linear.c` and prefill chunks' MLP "
        "and output projection run oneDNN's fused post-ops. Without a working compiler everything stays on torch "
        "ops (logged once); `false` also keeps transformers' eager bf16 bits exactly")] = True
    cpu_keep_freed_memory: Annotated[bool, _help(
        "on CPU (Linux, glibc): raise glibc's mmap/trim thresholds so memory freed by one step is reused by the "
        "next instead of going back to the kernel (a 512-token fp32 prefill step measured ~68,000 page faults and "
        "~135 ms of kernel CPU time without it, none with it); process-wide, and memory freed after a peak stays "
        "with the process")] = True
    freeze_gc: Annotated[bool, _help(
        "once the engine has started, `gc.freeze()` takes the objects then alive (~400,000 after loading torch "
        "and transformers) out of Python's cyclic collector scans, as vLLM does; without it each full collection "
        "holds the GIL ~0.2 s, a pause in every stream (a bench pass's throughput is the same within noise either "
        "way). The last engine to close unfreezes them; process-wide")] = True
    plugin_settings: Annotated[dict[str, dict[str, Any]], _help(
        "settings of plugin stages, by stage name (e.g. `{\"redis_tier\": {\"urls\": [...]}}`; env: "
        "`TOKENFLOW_PLUGIN_SETTINGS` as JSON)")] = msgspec.field(default_factory=dict)
    debug_leaks: Annotated[bool, _help(
        "when the engine goes idle with KV blocks still referenced, die (`EngineError`) instead of only logging "
        "the holders")] = False

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu") and not self.device.startswith(("cuda", "mps")):
            raise ValueError(f"`device` must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.speculative_tokens and self.attention != "dense":
            raise ValueError("`speculative_tokens` needs attention='dense'")
        if self.kv_compression and self.attention != "dense":
            raise ValueError("`kv_compression` needs attention='dense'")
        if self.lora_enabled and self.backend != "paged":
            raise ValueError(f"LoRA adapters run on the `paged` backend, not {self.backend!r}")
        if self.lora_enabled and (self.quantization or self.compile):
            raise ValueError("LoRA adapters run on the float weights: not with `quantization` or `compile`")
        if len(self.lora_adapters) > self.max_loras:
            raise ValueError(f"{len(self.lora_adapters)} lora_adapters; `max_loras` is {self.max_loras}")
        if self.kv_cache_dtype == "int8" and self.attention == "topk":
            raise ValueError("kv_cache_dtype='int8' does not run with attention='topk' (whose bounds read the cache)")

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_adapters)

    def for_device(self, device_type: str) -> EngineConfig:
        """This config with its device-dependent defaults filled in (the engine calls it once the model
        is on its device)."""
        if self.max_batch_tokens is None:
            tokens = DEFAULT_BATCH_TOKENS.get(device_type, DEFAULT_BATCH_TOKENS["cpu"])
            return msgspec.structs.replace(self, max_batch_tokens=tokens)
        return self

    @property
    def attention_policy(self) -> AttentionPolicy:
        sinks = self.sink_tokens if self.attention != "dense" else 0
        return AttentionPolicy(
            self.attention, window=self.window if self.attention == "sliding" else None, sink_tokens=sinks,
            topk_budget=self.topk_budget if self.attention == "topk" else None,
        )

    @classmethod
    def load(
        cls,
        *,
        config_file: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> EngineConfig:
        """Merge file < environment < keywords and validate the result.

        `config_file` defaults to `$TOKENFLOW_CONFIG`. Raises `ConfigError`
        naming the setting that is unknown or invalid.
        """
        environ = os.environ if environ is None else environ
        config_file = config_file or environ.get("TOKENFLOW_CONFIG")
        merged: dict[str, Any] = {}
        if config_file:
            merged.update(_read_toml(Path(config_file)))
        merged.update(_read_environ(environ))
        merged.update({k: v for k, v in overrides.items()})
        return cls.from_dict(merged)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> EngineConfig:
        values = _legacy_request_stages(values)
        unknown = [name for name in values if name not in cls.__struct_fields__]
        if unknown:
            raise ConfigError(f"unknown engine setting {unknown[0]!r}{did_you_mean(unknown[0], cls.__struct_fields__)}",
                              field=unknown[0])
        try:
            return msgspec.convert(dict(values), cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"invalid engine setting: {exc}", field=_field_of(str(exc))) from None


# request_stages entries that are the engine's own work since 0.2 (and the tier plugins it knows)
_BUILTIN_STAGES = frozenset({"breaker", "tokenizer", "prefetcher", "disk_tier"})
_LEGACY_TIERS = {"disk_tier": "disk", "redis_tier": "redis"}


def _legacy_request_stages(values: Mapping[str, Any]) -> Mapping[str, Any]:
    """A `request_stages` list from before the engine ran its required path itself (`["breaker", "disk_tier",
    "tokenizer", "prefetcher"]` and friends): keep only the user middleware, turn tier stages into
    `kv_tiers`, and `prefetch` off when such a list left the prefetcher out. Warns once per config."""
    stages = values.get("request_stages")
    if not isinstance(stages, list) or not (set(stages) & (_BUILTIN_STAGES | set(_LEGACY_TIERS))):
        return values
    warnings.warn("request_stages lists the engine's own stages (breaker, disk_tier, tokenizer, prefetcher) or a "
                  "tier stage: the engine runs its required path itself, request_stages is for your middleware "
                  "only, and tiers go in kv_tiers; this list is read the old way for now",
                  DeprecationWarning, stacklevel=4)
    mapped = dict(values)
    mapped["request_stages"] = [s for s in stages if s not in _BUILTIN_STAGES and s not in _LEGACY_TIERS]
    mapped.setdefault("kv_tiers", [_LEGACY_TIERS[s] for s in stages if s in _LEGACY_TIERS])
    if set(stages) & _BUILTIN_STAGES:
        mapped.setdefault("prefetch", "prefetcher" in stages)
    return mapped


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """"; did you mean 'x'?" for the known name closest to a mistyped one, or "" when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _field_of(text: str) -> str | None:
    for marker in ("at `$.", "unknown field `"):
        if marker in text:
            return text.split(marker, 1)[1].split("`", 1)[0].split("[", 1)[0]
    return None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    # Settings may sit at the top level or under a [tokenflow] table.
    table = data.get("tokenflow", data)
    if not isinstance(table, dict):
        raise ConfigError(f"config file {path}: [tokenflow] must be a table")
    return table


def _read_environ(environ: Mapping[str, str]) -> dict[str, Any]:
    """`TOKENFLOW_MAX_NUM_SEQS=8` -> {"max_num_seqs": "8"}; JSON for lists (`["a","b"]`) or commas,
    JSON for tables (`TOKENFLOW_PLUGIN_SETTINGS='{"redis_tier": {"urls": [...]}}'`)."""
    known = set(EngineConfig.__struct_fields__)
    values: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key in _ENV_NOT_SETTINGS:
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name not in known:
            raise ConfigError(f"unknown setting {name!r} in environment variable {key}{did_you_mean(name, known)}",
                              field=name)
        values[name] = _parse_env_value(name, raw)
    return values


def _parse_env_value(name: str, raw: str) -> Any:
    field_type = EngineConfig.__annotations__.get(name, "")
    if "dict[" in str(field_type):
        return json.loads(raw)
    if "list[" in str(field_type):
        if raw.strip().startswith("["):
            return json.loads(raw)
        return [item.strip() for item in raw.split(",") if item.strip()]
    if raw.lower() in ("none", "null", ""):
        return None
    return raw
