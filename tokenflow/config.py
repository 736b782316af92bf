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


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Every engine setting. Field names are public (DESIGN §3).

    `None` means "derive at start": `max_model_len` from the model config,
    the KV pool from `num_kv_blocks`, else `kv_cache_bytes`, else a share of the available memory.
    """

    model: str | None = None
    backend: str = "paged"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    max_model_len: Positive | None = None
    block_size: Positive = 16
    num_kv_blocks: Positive | None = None
    kv_cache_bytes: Positive | None = None
    kv_cache_memory_fraction: Annotated[float, msgspec.Meta(gt=0.0, le=0.95)] | None = None
    max_num_seqs: Positive = 32
    max_batch_tokens: Positive | None = None  # tokens per step; None: per device (`DEFAULT_BATCH_TOKENS`)
    max_queue: Positive = 4096
    priority_aging_s: Annotated[float, msgspec.Meta(gt=0.0)] | None = 30.0  # waiting this long = one priority level
    # queue place: each prompt token counts as this much later arrival, so of requests arriving together the
    # shorter prompts start first (their first tokens sooner); a long prompt is passed only by requests that
    # arrive within its tokens x this after it (0: arrival order)
    prompt_token_wait_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0005
    kv_high_watermark: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.95  # KV use above which prefills wait
    kv_low_watermark: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.7  # KV use below which the batch regrows
    max_queue_tokens: Positive | None = None
    breaker_error_rate: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.5
    breaker_step_p95_ms: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    breaker_window: Annotated[int, msgspec.Meta(ge=4)] = 50
    breaker_open_s: Annotated[float, msgspec.Meta(gt=0.0)] = 5.0
    breaker_probes: Positive = 2
    timeout: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    # your middleware on the request path, in order, after admission (queue bounds, breaker) and before the
    # response cache and tokenizing, which the engine runs itself
    request_stages: list[str] = msgspec.field(default_factory=list)
    kv_tiers: list[str] = msgspec.field(default_factory=lambda: ["disk"])  # below the KV pool, in order
    prefetch: bool = True  # load a queued request's cached prefix from the tiers as it is queued
    scheduler: str = "scheduler"  # the step loop's scheduler (entry-point group `tokenflow.schedulers`)
    batcher: str | None = None  # the old name of `scheduler`; when set, it wins (deprecated)
    kv_pool: str = "token_pool"
    prefix_caching: bool = True
    eviction_policy: str = "lfu_lru"
    eviction_half_life: Annotated[float, msgspec.Meta(gt=0.0)] = 64.0  # lfu_lru: requests after which a use counts half
    cache_dir: str | None = None  # the disk tier's folder (KV blocks and cached responses); off when unset
    disk_cache_bytes: Positive = 4 * 2**30
    disk_retry_s: Annotated[float, msgspec.Meta(gt=0.0)] = 30.0  # the disk tier stays off this long after an I/O error
    prefetch_concurrency: Positive = 2
    response_cache: bool = False  # serve repeated deterministic requests from a cache (per request: cache_response)
    response_cache_size: Positive = 1024
    response_cache_ttl_s: Annotated[float, msgspec.Meta(gt=0.0)] = 3600.0
    length_buckets: list[Positive] = msgspec.field(default_factory=lambda: [32, 64, 128, 256, 512, 1024, 2048])
    tokenizer_window_ms: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    tokenizer_cache_size: Annotated[int, msgspec.Meta(ge=0)] = 1024
    tokenizer_cache_bytes: Annotated[int, msgspec.Meta(ge=0)] = 64 * 2**20  # prompt text + ids kept in that LRU
    # -- request limits (every field of a request is untrusted) --
    default_max_tokens: Positive = 128  # a request without max_tokens: this many, fewer when the context is shorter
    clamp_max_tokens: bool = False  # an explicit max_tokens past the context: clamp it (True) or refuse it
    max_prompt_chars: Positive | None = None  # None: max_model_len x the longest token's characters
    max_stop_strings: Positive = 16
    max_stop_string_chars: Positive = 256
    max_stop_token_ids: Positive = 256
    max_logprobs: Annotated[int, msgspec.Meta(ge=0)] = 20  # top alternatives per token a request may ask for
    max_grammar_chars: Positive = 65536  # a request's json_schema / regex / grammar / choices, as text
    grammar_cache_size: Positive = 256  # compiled output constraints kept for reuse
    max_logit_bias: Positive = 1024  # tokens one request's logit_bias may name
    max_n: Positive = 16  # samples one generate_many / chat_many (HTTP `n`) may ask for
    max_embed_inputs: Positive = 256  # texts (or token-id lists) one `embed` call (HTTP `input`) may hold
    allow_special_tokens_in_chat: bool = False  # chat content spelling control tokens is tokenized as text unless True
    # -- tiers --
    cache_secret: str | None = None  # HMAC key of disk/Redis entries; disk default: a random secret kept in cache_dir
    tier_load_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 5.0  # a slower tier load is dropped: recompute
    disk_flush_timeout_s: Annotated[float, msgspec.Meta(ge=0.0)] = 10.0  # aclose() writes hottest blocks first
    num_threads: Positive | None = None  # CPU threads of the model (None: torch's default, the physical cores)
    # CPU: "adaptive" runs on up to num_threads, one fewer while other work holds the cores, one more when one
    # is idle (`runtime/cpu/core_share.py`); "fixed" always num_threads
    thread_policy: Literal["adaptive", "fixed"] = "adaptive"
    self_check: bool = True
    attention: Literal["dense", "sliding", "topk"] = "dense"
    window: Positive = 1024  # sliding: recent tokens each query sees
    sink_tokens: Annotated[int, msgspec.Meta(ge=0)] = 4  # sliding / topk: first tokens every query also sees
    topk_budget: Positive = 1024  # topk: tokens (whole blocks) each decode query attends to
    warmup: bool = False  # run short requests at start (each decode batch size) so the first user request is fast
    compile: bool = False  # torch.compile the decoder layers' MLPs on padded, static decode batch sizes
    # keep only the prompt K/V its last window attends to most (SnapKV), 1/ratio of it, for prompts this long
    kv_compression: Literal["snapkv"] | None = None
    kv_compression_ratio: Annotated[float, msgspec.Meta(ge=1.0)] = 4.0
    kv_compression_min_tokens: Positive = 1024
    kv_compression_window: Annotated[int, msgspec.Meta(ge=2)] = 32  # last prompt tokens: they score, and are kept
    kv_cache_dtype: Literal["auto", "int8"] = "auto"  # auto: the model's dtype; int8: per token and KV head scales
    quantization: Literal["int8"] | None = None  # paged, Llama-family; CPU: int8 weights+activations, CUDA: torchao
    # a .gguf model: "quantized" runs its tensors as the file holds them (paged on CPU; Llama, Qwen2, Qwen3 files),
    # "dequantized" converts them once to fp32 (every other case takes that too, with a log line)
    gguf_weights: Literal["quantized", "dequantized"] = "quantized"
    cuda_graphs: bool = True  # paged on CUDA, Llama-family models: decode steps replayed from CUDA graphs
    # paged, greedy requests: n-gram (prompt lookup) draft tokens verified per step (0: off)
    speculative_tokens: Annotated[int, msgspec.Meta(ge=0, le=16)] = 0
    speculative_max_seqs: Positive = 4  # speculate only while at most this many requests run
    # LoRA (PEFT folders): adapters by name, loaded at start; enable_lora also without any, for `load_lora` later.
    # Requests of several adapters and none share a batch; the model runs its transformers modules then (not the
    # fused CPU layers) in fp32/bf16, with no int8, GGUF-quantised weights or compile
    lora_adapters: dict[str, str] = msgspec.field(default_factory=dict)
    enable_lora: bool = False
    max_loras: Positive = 8  # adapters served at once
    pack_cpu_weights: bool = True  # paged on CPU in fp32 or bf16: linear layers also keep a oneDNN-packed weight copy
    fused_layers: bool = True  # paged, Llama-family models: tokenflow's fused layer loop instead of the HF modules
    native_kernels: bool = True  # paged, bf16/fp32 on CPU: C kernels (attention, RMSNorm, RoPE, ...), needs cc
    cpu_keep_freed_memory: bool = True  # on CPU: glibc keeps freed memory for reuse (process-wide mallopt)
    freeze_gc: bool = True  # after start, objects then alive leave the cyclic GC's scans (process-wide gc.freeze)
    plugin_settings: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)  # by stage name, for plugins
    debug_leaks: bool = False  # an idle engine holding KV blocks dies (EngineError) instead of only logging

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
