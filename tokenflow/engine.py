"""The Engine: lifecycle and the public async API.

    caller ─► request stages (config order) ─► batcher queue
    step loop task: batcher.schedule ─► model (worker thread) ─► sampler ─► outputs ─► caller

One background task (the step loop, in `step_loop.py`) owns the model. Each
caller waits on its request's `OutputCollector`. Leaving a `stream()` early,
cancelling `generate()`, or a deadline aborts the request; its KV blocks are
freed at the next step boundary.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import threading
import time
import warnings
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import msgspec

from tokenflow import registry
from tokenflow.background import BackgroundTask, current_event_loop, serve_portal, spawn
from tokenflow.config import EngineConfig
from tokenflow.errors import (
    ConfigError,
    DeadlineExceeded,
    EngineClosed,
    EngineError,
    InvalidRequest,
    Overloaded,
    TokenflowError,
    WrongEventLoop,
)
from tokenflow.hub import resolve_model
from tokenflow.kv.block_hash import model_key
from tokenflow.limits import RequestLimits
from tokenflow.output.processor import OutputProcessor, usage_of
from tokenflow.output.stored_responses import ResponseStore, serving_key
from tokenflow.params import STRUCTURED_FIELDS, Chunk, Completion, SamplingParams, ToolCall
from tokenflow.progress import steps
from tokenflow.protocols import CompressingBackend, DeviceOutOfMemory, EngineContext, NextStage
from tokenflow.request import Request, Wakeup
from tokenflow.runtime.cpu.core_share import CoreSharing
from tokenflow.runtime.cpu.malloc_tuning import return_freed_memory
from tokenflow.runtime.cpu.openmp_team import release_openmp_team
from tokenflow.runtime.gc_heap import freeze_heap, release_heap
from tokenflow.runtime.loader import LoadedModel, load_model
from tokenflow.runtime.lora import LoraAdapter, load_adapter
from tokenflow.runtime.model_thread import ModelThread
from tokenflow.runtime.pooling import POOLING_MODES, Pooling, pooling_for
from tokenflow.runtime.sampler import make_generator
from tokenflow.runtime.worker import ModelWorker
from tokenflow.stages.breaker import BreakerStage
from tokenflow.stages.prefetcher import prefetch
from tokenflow.stages.response_cache import ResponseCacheStage
from tokenflow.stages.tokenizer import ChatTemplate, TokenizerStage
from tokenflow.step_loop import StepLoop
from tokenflow.structured.grammar import GrammarCompiler, constraint_field
from tokenflow.structured.tools import check_tools, parse_tool_calls, tool_schema

if TYPE_CHECKING:
    from tokenflow.sync_engine import SyncEngine

__all__ = ("Engine",)

log = logging.getLogger("tokenflow")

Prompt = str | Sequence[int]


class Engine:
    """An in-process LLM engine. Use as `async with Engine(model, **settings) as engine:`.

    Settings are `EngineConfig` fields; keywords win over `TOKENFLOW_*`
    environment variables, which win over `config_file` (TOML).
    """

    def __init__(
        self, model: str | os.PathLike[str] | None = None, *, config_file: str | os.PathLike[str] | None = None,
        **settings: Any,
    ) -> None:
        if model is not None:
            settings["model"] = os.fspath(model)
        self.config = EngineConfig.load(config_file=config_file, **settings)
        self._state = "new"
        self._loop: StepLoop | None = None
        self._background: BackgroundTask | None = None
        self._chain: NextStage | None = None
        self._stages: list[Any] = []  # the request path's chain: admission, the caller's middleware, responses
        self._tiers: list[Any] = []  # KV tiers below the pool (`kv_tiers`)
        self._tokenizer: TokenizerStage | None = None  # the configured stage, else the engine's own
        self._started: list[Any] = []  # stages whose start() ran, in order: stopped at close or after a failed start
        self.scheduler: Any = None
        self._model_thread: ModelThread | None = None
        self._model_thread_task: BackgroundTask | None = None
        self.limits: RequestLimits | None = None
        self.model_name = ""
        self.pooling = Pooling()  # `embed`'s default: the model folder's own (sentence-transformers), set at start
        self.adapters: dict[str, LoraAdapter] = {}  # LoRA adapters served, by name (`load_lora`, `lora_adapters`)
        self._froze_heap = False  # this engine's start froze the GC heap (`freeze_gc`); its close releases it
        self._home: object | None = None  # the event loop that started the engine: the only one it serves
        self._home_thread = 0
        self._portal: Any = None  # an anyio BlockingPortal on the home loop, for `portal()`
        self._portal_task: BackgroundTask | None = None
        self.ctx: EngineContext | None = None
        self.loaded: LoadedModel | None = None
        self.grammars: GrammarCompiler | None = None
        self._last_stats: dict[str, Any] = {}

    # -- lifecycle -----------------------------------------------------------
    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Load the model and start the step loop (idempotent). A start that fails stops whatever it
        had started and leaves the engine as new: closable, or startable again."""
        if self._state != "new":
            self._check_loop()
            return
        self._state = "starting"
        self._home, self._home_thread = current_event_loop(), threading.get_ident()
        config = self.config
        try:
            self._portal_task = spawn(lambda: serve_portal(self._set_portal), "tokenflow-portal")
            release_openmp_team()  # this thread's idle OpenMP helpers would slow every step of the model thread
            resolved = await anyio.to_thread.run_sync(resolve_model, config.model)
            self.model_name = resolved.name
            model_thread = self._model_thread = ModelThread()
            self._model_thread_task = spawn(model_thread.serve, "tokenflow-model-thread")
            await self._start_on(model_thread, resolved.path, resolved.gguf_file)
            if config.warmup:
                await self._warm_up()
            if config.freeze_gc:
                freeze_heap()
                self._froze_heap = True
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._teardown(EngineClosed("the engine failed to start"))
            self._state = "new"
            raise

    async def _start_on(self, model_thread: ModelThread, path: Any, gguf_file: Any = None) -> None:
        loaded = await model_thread.run(load_model, path, self.config, gguf_file)
        self.pooling = pooling_for(path)
        config = self.config = self.config.for_device(loaded.device.type)
        policy = config.attention_policy.fingerprint  # the KV each block holds depends on these too
        if config.quantization:
            policy += f";quantization={config.quantization}"
        # kv_compression leaves the shared prefix blocks whole (compacted blocks are never hashed): no key change
        if config.kv_cache_dtype != "auto":
            policy += f";kv_cache_dtype={config.kv_cache_dtype}"
        fingerprint = await model_thread.run(model_key, loaded.model, config.block_size, policy)
        ctx = EngineContext(
            config, loaded.tokenizer, loaded.max_model_len, loaded.eos_token_ids, loaded.vocab_size, fingerprint
        )
        backend = registry.load_backend(config.backend, config)
        await model_thread.run(backend.load, ctx, loaded.model)
        for name, folder in config.lora_adapters.items():
            self._check_lora_name(name)
            self.adapters[name] = await model_thread.run(load_adapter, name, folder, loaded.model)
        if config.kv_compression and (ctx.pool is None or not isinstance(backend, CompressingBackend)):
            log.warning("kv_compression needs a backend that compresses its KV (`paged`); it is off")
            config = self.config = msgspec.structs.replace(config, kv_compression=None)
        if ctx.pool is not None:
            loaded.max_model_len = ctx.max_model_len = context_the_pool_holds(config, ctx.pool, loaded.max_model_len,
                                                                              ctx.model_window)
        ctx.serving_key = await model_thread.run(
            serving_key, fingerprint, loaded.tokenizer, loaded.max_model_len, loaded.eos_token_ids, config
        )
        # The required path is the engine's own: admission (queue bounds, circuit breaker), the caller's
        # middleware (`request_stages`), the response cache, then tokenizing and prefetching (`_enqueue`).
        tiers = [registry.load_tier(name, config) for name in config.kv_tiers]
        middleware = [registry.load_stage(name, config, kinds=("request",)) for name in config.request_stages]
        if config.batcher is not None:
            warnings.warn("the `batcher` setting is now `scheduler`", DeprecationWarning, stacklevel=2)
        scheduler = registry.load_scheduler(config.batcher or config.scheduler, config)
        ctx.scheduler = scheduler
        admission = BreakerStage(config)
        responses = ResponseCacheStage(config, [t for t in tiers if isinstance(t, ResponseStore)])
        self._tokenizer = TokenizerStage(config)
        for part in [*tiers, admission, self._tokenizer, responses, *middleware, scheduler]:
            self._started.append(part)  # stopped after a failure, even a failure inside its own start()
            if hasattr(part, "start"):
                await part.start(ctx)
        self._stages = [admission, *middleware, responses]
        self._tiers = tiers
        self.scheduler = scheduler
        self.ctx = ctx
        self.loaded = loaded
        self.limits = RequestLimits.from_config(config, loaded.max_model_len, loaded.tokenizer)
        self.output = OutputProcessor(loaded.tokenizer, loaded.eos_token_ids, loaded.max_model_len)
        self.grammars = GrammarCompiler(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids,
                                        config.grammar_cache_size)
        cores = None
        if loaded.device.type == "cpu" and config.thread_policy == "adaptive":
            threads = await model_thread.run(torch_threads)
            cores = CoreSharing(threads, model_thread.native_id or 0)
        worker = ModelWorker(backend, loaded, model_thread, cores)
        self._loop = StepLoop(worker, scheduler, self.output, ctx.observers, pool=ctx.pool,
                              debug_leaks=config.debug_leaks, async_scheduling=config.async_scheduling)
        self._chain = _build_chain(self._stages, self._enqueue)
        self._background = spawn(self._loop.run, "tokenflow-step-loop")
        self._state = "running"

    async def _warm_up(self) -> None:
        """Run short requests at each decode batch size the engine will see, so one-time costs
        (kernel selection, allocator growth, compilation with `compile=True`) are paid now."""
        sizes = self._loop.worker.warmup_batch_sizes()
        started = time.perf_counter()
        vocab = self.loaded.vocab_size
        for size in steps(sizes, "tokenflow: warm-up (decode batch sizes)"):
            async with anyio.create_task_group() as tg:
                for i in range(size):
                    prompt = [(37 * i + 11 * j) % (vocab - 10) + 5 for j in range(24)]
                    tg.start_soon(self._warm_request, prompt)
        log.info("warm-up done in %.1f s (batch sizes %s)", time.perf_counter() - started, sizes)

    async def _warm_request(self, prompt: list[int]) -> None:
        await self.generate(prompt, max_tokens=4, temperature=0.0, ignore_eos=True, cache_salt="tokenflow-warmup",
                            cache_response=False)

    def _set_portal(self, portal: Any) -> None:
        self._portal = portal

    def portal(self) -> SyncEngine:
        """A blocking bridge to this running engine for other threads (sync code: Django views, Celery
        tasks, sync tests): `bridge.generate(...)`, `bridge.chat(...)`, `for chunk in bridge.stream(...)`.
        Each call runs on the engine's own event loop and waits for it. From another event loop, call the
        bridge in a worker thread (`await asyncio.to_thread(bridge.generate, ...)`)."""
        from tokenflow.sync_engine import SyncEngine

        if self._state != "running" or self._portal is None:
            raise EngineClosed("portal() needs a running engine: start it first (on its own event loop)")
        return SyncEngine.bridge(self, self._portal, self._home_thread)

    async def aclose(self, drain_timeout: float = 30.0) -> None:
        """Stop admission, let running requests finish (up to `drain_timeout` s), abort the rest."""
        if self._state in ("closed", "new"):
            self._state = "closed"
            return
        self._check_loop()
        self._state = "closing"
        if self._loop is not None:
            with anyio.move_on_after(drain_timeout):
                await self._loop.wait_idle()
        await self._teardown(EngineClosed("the engine was closed before this request finished"))
        self._state = "closed"
        self._release()

    def _release(self) -> None:
        """A closed engine lets go of its model, KV cache and stages (`stats()` keeps their last figures) and
        hands the memory they held back to the OS: an app that closes an engine gets its RAM back, and a
        test suite that opens hundreds of engines does not pile them up."""
        if self._loop is not None:
            self._last_stats = self.stats()
        self._loop = self._chain = self.scheduler = self._tokenizer = self.grammars = None
        self._stages = []
        self._tiers = []
        self.ctx = None
        if self.loaded is not None:
            self.loaded.model = None
        gc.collect()  # modules and tensors in reference cycles
        return_freed_memory()

    async def _teardown(self, error: Exception) -> None:
        """Stop whatever runs, in reverse order of starting: step loop, stages, model thread."""
        if self._loop is not None:
            self._loop.fail_all(error)
        if self._background is not None:
            await self._background.stop()
            self._background = None
        started, self._started = self._started, []
        for stage in started:
            if hasattr(stage, "stop"):  # e.g. the disk tier flushes the pool's cached blocks
                try:
                    await stage.stop()
                except Exception:
                    log.exception("stopping stage %r failed", stage)
        if self._model_thread is not None and self._model_thread_task is not None:
            self._model_thread.close()
            await self._model_thread_task.wait()
        self._model_thread = self._model_thread_task = None
        if self._portal_task is not None:
            await self._portal_task.stop()
            self._portal_task = self._portal = None
        if self._froze_heap:
            self._froze_heap = False
            release_heap()

    # -- public API ----------------------------------------------------------
    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any) -> Completion:
        """Generate a completion for `prompt` (text or token ids)."""
        request = self._new_request(params, kwargs, prompt=prompt)
        return await self._collect(request)

    async def chat(
        self, messages: Sequence[dict[str, Any]], params: SamplingParams | None = None, *,
        tools: Sequence[dict[str, Any]] | None = None, tool_choice: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Completion:
        """Generate the assistant's reply to `messages` through the model's chat template. With `tools`
        (OpenAI's function tools) the template shows them and `Completion.tool_calls` holds the calls;
        `tool_choice` as OpenAI's (see `tokenflow.structured.tools`)."""
        request = self._new_request(params, kwargs, messages=messages, tools=tools, tool_choice=tool_choice)
        return await self._collect(request)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any) -> AsyncIterator[Chunk]:
        """Yield text deltas as they are generated; the last chunk carries finish_reason and usage."""
        return self._results(self._new_request(params, kwargs, prompt=prompt))

    def stream_chat(
        self, messages: Sequence[dict[str, Any]], params: SamplingParams | None = None, *,
        tools: Sequence[dict[str, Any]] | None = None, tool_choice: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[Chunk]:
        """Stream the reply; with tools the chunks carry the text as written (calls are read at the end
        by `chat`)."""
        return self._results(self._new_request(params, kwargs, messages=messages, tools=tools,
                                               tool_choice=tool_choice))

    async def tokenize(self, prompt: str | Sequence[dict[str, Any]], *, add_special_tokens: bool = True,
                       tools: Sequence[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                       continue_final_message: bool = False) -> list[int]:
        """The token ids a request would get for `prompt`: a text, or chat messages through the model's
        chat template (with the generation prompt, or the last message continued), exactly as `generate` /
        `chat` tokenize them."""
        self._check_open()
        assert self.limits is not None
        messages = None if isinstance(prompt, str) else prompt
        if messages is not None and not (isinstance(messages, Sequence) and all(isinstance(m, dict) for m in messages)
                                         and messages):
            raise InvalidRequest("messages must be a non-empty list of message dicts", field="messages")
        self.limits.check_prompt(prompt, messages)
        stage = self._tokenizer
        assert stage is not None
        if messages is not None:
            checked = check_tools(tools, None)[0] if tools is not None else None
            template = ChatTemplate(bool(add_generation_prompt), bool(continue_final_message))
            return await stage.encode_chat(messages, checked, template)
        return await stage.encode(prompt, add_special_tokens=add_special_tokens)  # type: ignore[arg-type]

    async def load_lora(self, name: str, folder: str | os.PathLike[str]) -> None:
        """Serve the PEFT LoRA folder `folder` as `name` from now on (needs `enable_lora` or `lora_adapters` at
        start): requests with `lora=name` (HTTP `"model": name`) run with it, beside every other."""
        self._check_open()
        assert self.loaded is not None and self._model_thread is not None
        if not self.config.lora_enabled:
            raise InvalidRequest("this engine was started without LoRA: start it with enable_lora=True", field="lora")
        self._check_lora_name(name)
        if name in self.adapters:
            raise InvalidRequest(f"a LoRA adapter named {name!r} is already served: unload it first", field="lora")
        if len(self.adapters) >= self.config.max_loras:
            raise InvalidRequest(f"{len(self.adapters)} LoRA adapters are served, max_loras is "
                                 f"{self.config.max_loras}: unload one first", field="lora")
        self.adapters[name] = await self._model_thread.run(load_adapter, name, folder, self.loaded.model)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name`: new requests naming it are refused; requests already admitted finish
        with it."""
        if self.adapters.pop(name, None) is None:
            raise InvalidRequest(f"no LoRA adapter named {name!r} is served", field="lora")

    def _check_lora_name(self, name: str) -> None:
        if not isinstance(name, str) or not name or len(name) > 256 or name == self.model_name:
            raise InvalidRequest(f"a LoRA adapter needs a name (up to 256 characters) other than the model's, got "
                                 f"{name!r}", field="lora")

    async def embed(self, inputs: str | Sequence[int] | Sequence[str | Sequence[int]], *,
                    pooling: str | None = None, normalize: bool | None = None) -> list[list[float]]:
        """One vector per input (a text, a token-id list, or a list of either): the model's final hidden states
        pooled as its folder says (sentence-transformers' `modules.json`; else the last token, unit length),
        `pooling` ("last", "mean", "cls", "max") and `normalize` overriding. Computed on the model thread between
        generation steps: prefill only, no KV kept."""
        return (await self.embed_with_usage(inputs, pooling=pooling, normalize=normalize))[0]

    async def embed_with_usage(self, inputs: str | Sequence[int] | Sequence[str | Sequence[int]], *,
                               pooling: str | None = None, normalize: bool | None = None
                               ) -> tuple[list[list[float]], int]:
        """`embed`'s vectors and the number of tokens they read (`/v1/embeddings`' usage)."""
        self._check_open()
        assert self.limits is not None and self.loaded is not None and self._tokenizer is not None
        if pooling is not None and pooling not in POOLING_MODES:
            raise InvalidRequest(f"pooling must be one of {', '.join(POOLING_MODES)}, got {pooling!r}", field="pooling")
        if normalize is not None and not isinstance(normalize, bool):
            raise InvalidRequest("normalize must be true or false", field="normalize")
        chosen = Pooling(mode=pooling or self.pooling.mode,
                         normalize=self.pooling.normalize if normalize is None else normalize)
        if isinstance(inputs, str) or (isinstance(inputs, Sequence) and inputs
                                       and all(isinstance(t, int) and not isinstance(t, bool) for t in inputs)):
            items: list[Any] = [inputs]
        elif isinstance(inputs, Sequence) and not isinstance(inputs, (bytes, bytearray)):
            items = list(inputs)
        else:
            raise InvalidRequest("input must be a text, a list of token ids, or a list of either", field="input")
        limit = self.config.max_embed_inputs
        if not items or len(items) > limit:
            raise InvalidRequest(f"input must hold 1 to {limit} items (max_embed_inputs), got {len(items)}",
                                 field="input")
        vocab, longest = self.loaded.vocab_size, self.loaded.max_model_len
        token_lists = []
        for i, item in enumerate(items):
            if isinstance(item, str):
                self.limits.check_prompt(item, None)
                ids = await self._tokenizer.encode(item, add_special_tokens=True)
            elif isinstance(item, Sequence) and _are_token_ids(item, vocab):
                ids = list(item)
            else:
                raise InvalidRequest(f"input[{i}] must be a text or a list of token ids in [0, {vocab})",
                                     field="input")
            if not 0 < len(ids) <= longest:
                raise InvalidRequest(f"input[{i}] has {len(ids)} tokens; it must have 1 to {longest}", field="input")
            token_lists.append(ids)
        assert self._loop is not None
        try:
            vectors = await self._loop.worker.embed(token_lists, chosen)
        except DeviceOutOfMemory as exc:
            raise Overloaded(f"out of device memory computing embeddings: {exc}") from exc
        return vectors, sum(len(ids) for ids in token_lists)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids`, special tokens spelled out (the inverse of `tokenize`)."""
        self._check_open()
        vocab = self.loaded.vocab_size
        if not _are_token_ids(token_ids, vocab):
            raise InvalidRequest(f"tokens must be ids in [0, {vocab})", field="tokens")
        if len(token_ids) > self.loaded.max_model_len:
            raise InvalidRequest(f"at most {self.loaded.max_model_len} tokens (max_model_len)", field="tokens")
        tokenizer = self.loaded.tokenizer
        return await anyio.to_thread.run_sync(lambda: tokenizer.decode(list(token_ids), skip_special_tokens=False))

    def add_observer(self, observer: Any) -> None:
        """Tell `observer` about every step (`on_step(duration_s, ok)`) and request end
        (`on_request_end(request, outcome)`), e.g. for metrics. Call after `start()`."""
        if self._loop is None:
            raise EngineClosed("add_observer() needs a started engine")
        self.ctx.observers.append(observer)

    def stats(self) -> dict[str, Any]:
        if self._loop is None and self._last_stats:  # closed: the figures it had at its close
            return {**self._last_stats, "state": self._state}
        stats: dict[str, Any] = {"state": self._state, "model": self.model_name}
        if self._loop is not None:
            # what dtype="auto" chose on this machine, and where the model runs
            stats["dtype"] = str(self.loaded.dtype).removeprefix("torch.")
            stats["structured"] = {"grammars_compiled": self.grammars.num_compiled,
                                   "grammar_cache_hits": self.grammars.num_cache_hits}
            stats["device"] = str(self.loaded.device)
            stats.update(self._loop.stats())
        for stage in [*self._stages, *self._tiers, *([self._tokenizer] if self._tokenizer else [])]:
            if hasattr(stage, "stats"):
                stats.update(stage.stats())
        return stats

    # -- internals -----------------------------------------------------------
    def _check_open(self) -> None:
        if self._state == "new":
            raise EngineClosed("the engine is not started: use `async with Engine(...)` or `await engine.start()`")
        self._check_loop()
        if self._state != "running" or (self._loop is not None and self._loop.dead):
            raise EngineClosed(f"the engine is {'dead' if self._loop and self._loop.dead else self._state}")

    def _check_loop(self) -> None:
        """An engine serves the event loop that started it: its events and tasks belong to that loop, so a
        call from another loop or thread would wait for a wake-up that never comes. Refuse it at once."""
        if current_event_loop() is self._home:
            return
        where = "another thread" if threading.get_ident() != self._home_thread else "another event loop"
        raise WrongEventLoop(
            f"this engine runs on the event loop that started it (thread {self._home_thread}); it was called "
            f"from {where}. From other threads use `bridge = engine.portal()` (bridge.generate / chat / "
            f"stream block until done), or `tokenflow.SyncEngine(model)` for an engine on its own thread.")

    def _new_request(self, params: SamplingParams | None, kwargs: dict[str, Any], *, prompt: Any = None,
                     messages: Any = None, tools: Any = None, tool_choice: Any = None) -> Request:
        self._check_open()
        choice: str | dict[str, Any] | None = None
        if tools is not None or tool_choice is not None:
            tools, choice, kwargs = self._with_tools(params, kwargs, tools, tool_choice, messages)
        sampling = SamplingParams.from_kwargs(params, **kwargs)
        assert self.limits is not None
        self.limits.check_params(sampling)
        if sampling.stop_token_ids and not all(0 <= t < self.loaded.vocab_size for t in sampling.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be token ids in [0, {self.loaded.vocab_size})",
                                 field="stop_token_ids")
        if sampling.logit_bias and max(sampling.logit_bias) >= self.loaded.vocab_size:
            raise InvalidRequest(f"logit_bias names token {max(sampling.logit_bias)}, outside the vocabulary "
                                 f"[0, {self.loaded.vocab_size})", field="logit_bias")
        self.limits.check_prompt(prompt, messages)
        request = Request(sampling, messages=messages, arrival_time=anyio.current_time())
        if sampling.lora is not None:
            request.adapter = self.adapters.get(sampling.lora)
            if request.adapter is None:
                served = ", ".join(sorted(self.adapters)) or "none"
                raise InvalidRequest(f"no LoRA adapter named {sampling.lora!r} is served (served: {served})",
                                     field="lora")
        if choice is not None:
            request.tool_choice = choice
            request.tools = None if choice == "none" else tools
        if messages is None:
            if isinstance(prompt, str):
                request.prompt = prompt
            elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                    raise InvalidRequest("a token-id prompt must be a list of ints", field="prompt")
                request.prompt_token_ids = list(prompt)
            else:
                raise InvalidRequest(
                    f"the prompt must be a str or a list of token ids, got {type(prompt).__name__}", field="prompt"
                )
        timeout = sampling.timeout or self.config.timeout
        ends = [t for t in (sampling.deadline, request.arrival_time + timeout if timeout else None) if t]
        request.deadline = min(ends) if ends else None
        return request

    def _with_tools(self, params: SamplingParams | None, kwargs: dict[str, Any], tools: Any, tool_choice: Any,
                    messages: Any) -> tuple[list[dict[str, Any]], str | dict[str, Any], dict[str, Any]]:
        """Checked tools, the tool choice, and the keywords with its constraint (a named or required call)."""
        if messages is None:
            raise InvalidRequest("tools are for chat requests", field="tools")
        if tools is None:
            raise InvalidRequest("tool_choice needs tools", field="tool_choice")
        checked, choice = check_tools(tools, tool_choice)
        assert self.limits is not None
        try:
            size = len(json.dumps(checked))
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidRequest(f"`tools` is not JSON: {exc}", field="tools") from None
        if size > self.limits.max_prompt_chars:
            raise InvalidRequest(f"`tools` has {size} characters; this engine takes at most "
                                 f"{self.limits.max_prompt_chars} (max_prompt_chars)", field="tools")
        schema = tool_schema(checked, choice)
        if schema is not None:
            given = params is not None and params.structured
            if given or any(kwargs.get(name) not in (None, False) for name in STRUCTURED_FIELDS):
                raise InvalidRequest("a named or required tool call is its own output constraint", field="tool_choice")
            kwargs = {**kwargs, "json_schema": schema}
        return checked, choice, kwargs

    async def _enqueue(self, request: Request) -> None:
        """The last link of the request path: tokenize the prompt, start loading its cached prefix from the
        KV tiers (`prefetch`), and hand the request to the step loop. A cancellation or a passed deadline
        whose timer has not fired yet is honoured here, so a cancelled or expired request never reaches
        the model.
        """
        assert self._tokenizer is not None
        await self._tokenizer.prepare(request)
        if self.config.prefetch:
            prefetch(self.ctx.pool, request)
        await anyio.lowlevel.checkpoint_if_cancelled()
        if request.deadline is not None and anyio.current_time() >= request.deadline:
            raise TimeoutError  # `_results` turns it into DeadlineExceeded
        self._check_open()
        assert self._loop is not None and self.limits is not None
        request.max_tokens = self.limits.max_new_tokens(request.params, request.num_prompt_tokens)
        if request.params.prompt_logprobs is not None and self._loop.static:
            raise InvalidRequest("prompt_logprobs need a step backend (`paged`), not a static one",
                                 field="prompt_logprobs")
        if request.params.structured:
            if self._loop.static:
                raise InvalidRequest("structured outputs need a step backend (`paged`), not a static one",
                                     field=constraint_field(request.params))
            # compiled off the event loop (a new grammar takes milliseconds; cached ones are copied)
            request.constraint = await anyio.to_thread.run_sync(self.grammars.matcher, request.params)
        self.output.prepare(request)
        if request.params.seed is not None:
            request.generator = make_generator(request.params.seed)  # on the host: uniforms are staged, never read back
        self._loop.add(request)

    async def generate_many(self, prompt: Prompt, n: int, params: SamplingParams | None = None,
                            **kwargs: Any) -> list[Completion]:
        """`n` samples of one prompt (OpenAI's `n`). The first is prefilled alone; the others start once it
        has its first token, from its prompt blocks in the prefix cache, so the prompt is computed about
        once. Seeded, sample `i` uses `seed + i`: each has a stream of its own."""
        return await self._many(n, params, kwargs, prompt=prompt)

    async def chat_many(self, messages: Sequence[dict[str, Any]], n: int, params: SamplingParams | None = None, *,
                        tools: Sequence[dict[str, Any]] | None = None,
                        tool_choice: str | dict[str, Any] | None = None, **kwargs: Any) -> list[Completion]:
        """`n` replies to `messages`; see `generate_many` and `chat`."""
        return await self._many(n, params, kwargs, messages=messages, tools=tools, tool_choice=tool_choice)

    def stream_many(self, prompt: Prompt, n: int, params: SamplingParams | None = None,
                    **kwargs: Any) -> AsyncIterator[tuple[int, Chunk]]:
        """`(sample index, chunk)` of `n` samples of one prompt as they are generated (OpenAI's streamed
        `n`); each sample's last chunk carries its finish_reason and usage. The prompt is computed about
        once, as in `generate_many`."""
        return self.stream_batch([prompt], n, params, **kwargs)

    def stream_chat_many(self, messages: Sequence[dict[str, Any]], n: int, params: SamplingParams | None = None, *,
                         tools: Sequence[dict[str, Any]] | None = None,
                         tool_choice: str | dict[str, Any] | None = None, **kwargs: Any
                         ) -> AsyncIterator[tuple[int, Chunk]]:
        """`n` replies to `messages`, streamed; see `stream_many` and `stream_chat`."""
        return self._stream_groups([self._n_requests(n, params, kwargs, messages=messages, tools=tools,
                                                     tool_choice=tool_choice)])

    def stream_batch(self, prompts: Sequence[Prompt], n: int = 1, params: SamplingParams | None = None,
                     **kwargs: Any) -> AsyncIterator[tuple[int, Chunk]]:
        """`(p * n + i, chunk)` for sample `i` of `prompts[p]`, every sample streamed at once (a batch of
        prompts on /v1/completions)."""
        if not prompts:
            raise InvalidRequest("give at least one prompt", field="prompt")
        return self._stream_groups([self._n_requests(n, params, kwargs, prompt=p) for p in prompts])

    def _n_requests(self, n: int, params: SamplingParams | None, kwargs: dict[str, Any], *, prompt: Any = None,
                    messages: Any = None, tools: Any = None, tool_choice: Any = None) -> list[Request]:
        """`n` requests of one prompt; seeded, request `i` uses `seed + i`."""
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= self.config.max_n:
            raise InvalidRequest(f"n must be an integer in [1, {self.config.max_n}] (max_n), got {n!r}", field="n")
        base = SamplingParams.from_kwargs(params, **kwargs)
        return [self._new_request(base, {} if base.seed is None else {"seed": (base.seed + i) % 2**64},
                                  prompt=prompt, messages=messages, tools=tools, tool_choice=tool_choice)
                for i in range(n)]

    async def _stream_groups(self, groups: list[list[Request]]) -> AsyncIterator[tuple[int, Chunk]]:
        """Chunks of every request of `groups`, tagged with their place in the flattened list, as they come.
        A group's first request starts at once, the rest once it has a chunk (its prompt blocks are then in
        the prefix cache). One reader and no tasks: the requests' collectors wake this generator, so it can
        be closed from any task. The first error ends the stream and aborts the others."""
        assert self._chain is not None and self._loop is not None
        requests = [r for group in groups for r in group]
        leaders = {sum(len(g) for g in groups[:k]): len(group) for k, group in enumerate(groups)}
        wakeup = Wakeup()
        for request in requests:
            request.collector.wakeup = wakeup
        started: set[int] = set()
        finished: set[int] = set()

        async def start(index: int) -> None:
            started.add(index)
            with anyio.fail_after(_remaining(requests[index])):
                await self._chain(requests[index])

        try:
            for leader in leaders:
                await start(leader)
            while len(finished) < len(requests):
                ready = []
                for index in sorted(started - finished):
                    chunk = requests[index].collector.take()
                    if chunk is not None:
                        ready.append((index, chunk))
                for index, chunk in ready:
                    if chunk.finish_reason is not None:
                        finished.add(index)
                    yield index, chunk
                    for follower in range(index + 1, index + leaders.get(index, 1)):
                        if follower not in started:
                            await start(follower)
                if not ready:
                    with anyio.fail_after(min((t for r in requests if (t := _remaining(r)) is not None),
                                              default=None)):
                        await wakeup.wait()
        except TimeoutError:
            for request in requests:
                self._loop.abort(request, "deadline")
            raise DeadlineExceeded("a streamed choice passed its deadline") from None
        except TokenflowError:
            for request in requests:
                self._loop.abort(request, "rejected")
            raise
        except Exception as exc:  # a stage's bug: these requests fail, with a typed error
            log.exception("the request path failed for a stream of %d choices", len(requests))
            for request in requests:
                self._loop.abort(request, "failed")
            raise EngineError(f"the request path failed: {exc!r}") from exc
        finally:  # closed early (the client left) or cancelled: nothing keeps running for nobody
            for request in requests:
                self._loop.abort(request)

    async def _many(self, n: int, params: SamplingParams | None, kwargs: dict[str, Any], *, prompt: Any = None,
                    messages: Any = None, tools: Any = None, tool_choice: Any = None) -> list[Completion]:
        requests = self._n_requests(n, params, kwargs, prompt=prompt, messages=messages, tools=tools,
                                    tool_choice=tool_choice)
        results: list[Completion | BaseException | None] = [None] * n
        prefilled = anyio.Event()

        async def first() -> None:
            chunks: list[Chunk] = []
            try:
                async for chunk in self._results(requests[0]):
                    prefilled.set()
                    chunks.append(chunk)
                results[0] = self._completion(requests[0], chunks)
            except Exception as exc:  # kept, and raised as itself below (not inside an ExceptionGroup)
                results[0] = exc
            finally:
                prefilled.set()

        async def other(i: int) -> None:
            await prefilled.wait()
            try:
                results[i] = await self._collect(requests[i])
            except Exception as exc:
                results[i] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            for i in range(1, n):
                tg.start_soon(other, i)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [r for r in results if isinstance(r, Completion)]

    async def _collect(self, request: Request) -> Completion:
        return self._completion(request, [chunk async for chunk in self._results(request)])

    def _completion(self, request: Request, chunks: list[Chunk]) -> Completion:
        last = chunks[-1]
        logprobs = [lp for c in chunks for lp in (c.logprobs or [])]
        text = "".join(c.text for c in chunks)
        return Completion(
            request_id=request.request_id,
            text=text,
            token_ids=[t for c in chunks for t in c.token_ids],
            finish_reason=last.finish_reason or "abort",
            usage=last.usage or usage_of(request),
            stop_reason=last.stop_reason,
            logprobs=logprobs if request.params.logprobs is not None else None,
            prompt_token_ids=request.prompt_token_ids,
            tool_calls=self._tool_calls(request, text),
            prompt_logprobs=chunks[0].prompt_logprobs,
        )

    @staticmethod
    def _tool_calls(request: Request, text: str) -> list[ToolCall] | None:
        if request.tool_choice is None or request.tools is None:
            return None
        return parse_tool_calls(text, request.tools, request.tool_choice)[1] or None

    async def _results(self, request: Request) -> AsyncIterator[Chunk]:
        assert self._chain is not None and self._loop is not None
        loop = self._loop
        try:
            with anyio.fail_after(_remaining(request)):
                await self._chain(request)
            while True:
                with anyio.fail_after(_remaining(request)):
                    chunk = await request.collector.get()
                yield chunk
                if chunk.finish_reason is not None:
                    return
        except TimeoutError:
            loop.abort(request, "deadline")
            raise DeadlineExceeded(f"request {request.request_id} passed its deadline") from None
        except TokenflowError:  # refused on the request path (or already ended by the loop)
            loop.abort(request, "rejected")
            raise
        except Exception as exc:  # a stage's bug: this request fails alone, with a typed error
            log.exception("the request path failed for %s", request.request_id)
            loop.abort(request, "failed")
            raise EngineError(f"the request path failed: {exc!r}") from exc
        except BaseException:
            loop.abort(request)
            raise


def _are_token_ids(items: Any, vocab: int) -> bool:
    """Whether every item is a token id of the vocabulary (ints, not bools, in [0, vocab))."""
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in items)


def torch_threads() -> int:
    """The model thread's CPU thread count (`num_threads`, else torch's default): the adaptive policy's most."""
    import torch

    return torch.get_num_threads()


def context_the_pool_holds(config: EngineConfig, pool: Any, max_model_len: int,
                           model_window: int | None = None) -> int:
    """The context length the engine serves: `max_model_len`, unless the KV pool cannot hold one sequence
    that long. Then a `max_model_len` the user set is refused (`ConfigError`), and one derived from the
    model is clamped to what the pool holds, with a warning: a request that fits the context must never
    be refused for the pool's size."""
    block = pool.block_size
    needed = pool.blocks_needed(max_model_len)
    policy = config.attention_policy
    window, sinks = (policy.window, policy.sink_tokens) if policy.window is not None else (model_window, 0)
    if window is not None:  # sliding: sinks + window + one step's chunk, however long a sequence runs
        held = pool.blocks_needed(sinks) + pool.blocks_needed(window) + 1
        needed = min(needed, held + pool.blocks_needed(config.max_batch_tokens or block))
    if needed <= pool.num_blocks:
        return max_model_len
    holds = pool.num_blocks * block
    sizes = "num_kv_blocks, kv_cache_bytes or kv_cache_memory_fraction"
    if config.max_model_len is not None:
        raise ConfigError(
            f"max_model_len={config.max_model_len} needs {needed} KV blocks for one sequence, but the KV pool has "
            f"{pool.num_blocks} ({holds} tokens): lower max_model_len or enlarge the pool ({sizes})",
            field="max_model_len")
    if window is not None or holds < 2 * block:
        raise ConfigError(f"the KV pool of {pool.num_blocks} blocks cannot hold one sequence: enlarge it ({sizes})",
                          field="num_kv_blocks")
    log.warning("the KV pool holds %d tokens, fewer than the model's context of %d: serving max_model_len=%d "
                "(enlarge the pool with %s to serve more)", holds, max_model_len, holds, sizes)
    return holds


def _remaining(request: Request) -> float | None:
    if request.deadline is None:
        return None
    return max(request.deadline - anyio.current_time(), 0.0)


def _build_chain(stages: Sequence[Any], last: NextStage) -> NextStage:
    """Compose middlewares: stages[0].handle(req, next=stages[1].handle(..., next=...last))."""
    chain = last
    for stage in reversed(stages):
        chain = _link(stage, chain)
    return chain


def _link(stage: Any, call_next: NextStage) -> NextStage:
    async def run(request: Request) -> None:
        await stage.handle(request, call_next)

    return run

