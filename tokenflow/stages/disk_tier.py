"""The `disk_tier` stage: KV blocks and whole responses on disk (diskcache).

KV blocks. At start the stage attaches to the token pool as its lower tier:
- a cached block the pool evicts is copied out (one small copy, on the event
  loop, before the block is reused) and written by a writer thread; `stop()`
  (called by `Engine.aclose`) writes every other cached block too, so a new
  engine on the same `cache_dir` starts warm;
- when a request's prefix continues on disk past what the pool holds, a reader
  thread loads those blocks (a *load job*: consecutive blocks, stopping at
  the first miss); the finished job restores them into the pool, pinned for
  the request, on the event loop. The `prefetcher` stage starts jobs when a
  request is queued; otherwise the batcher starts one when it first tries to
  admit the request, which then waits while others run.

Responses (opt-in: `response_cache=True` or per request `cache_response`).
On the request path, a deterministic request whose completion is stored (in
memory, else on disk) is answered from it, replayed chunk by chunk, and never
reaches the model; otherwise its chunks are recorded and stored when it
completes.

All storage checks and the I/O breaker live in `kv/disk_store.py`; without a
`cache_dir` the stage keeps responses in memory only and has no KV tier.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
import torch

from tokenflow.config import EngineConfig
from tokenflow.kv.block_hash import BlockKey
from tokenflow.kv.disk_store import DiskStore
from tokenflow.kv.response_cache import ResponseCache, StoredResponse, response_key
from tokenflow.protocols import EngineContext, NextStage
from tokenflow.request import Request, RequestStatus

__all__ = ("DiskTier", "create")

log = logging.getLogger("tokenflow")

RECORD = "response_record"  # request.extras: the chunks emitted so far, for the response cache
_KEY = "response_key"
_LOADED = "disk_tier_loaded"  # request.extras: its load job has been installed; never load twice
MAX_PENDING_WRITES = 256  # blocks copied out and not yet on disk; more evictions are not written


@dataclass(eq=False)
class _LoadJob:
    request: Request
    future: Future[list[tuple[BlockKey, torch.Tensor]]]
    prefetch: bool
    late: bool = False
    keys: list[BlockKey] = field(default_factory=list)


class DiskTier:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.store: DiskStore | None = None
        self.responses = ResponseCache(config.response_cache_size, config.response_cache_ttl_s)
        self.model_key = b""
        self.pool: Any = None
        self.observers: list[Any] = []
        self._writer: ThreadPoolExecutor | None = None
        self._readers: ThreadPoolExecutor | None = None
        self._jobs: dict[Request, _LoadJob] = {}
        self._lock = threading.Lock()
        self._pending_writes = 0
        self.blocks_written = 0
        self.writes_dropped = 0
        self.blocks_loaded = 0
        self.load_jobs = 0
        self.prefetch_jobs = 0
        self.prefetch_in_time = 0
        self.prefetch_late = 0

    async def start(self, ctx: EngineContext) -> None:
        self.model_key = ctx.model_key
        self.observers = ctx.observers
        ctx.observers.append(self)
        if not self.config.cache_dir:
            return
        self.store = await anyio.to_thread.run_sync(
            DiskStore, self.config.cache_dir, self.config.disk_cache_bytes, self.config.disk_retry_s
        )
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tokenflow-disk-write")
        pool = ctx.shared.get("block_pool")
        if getattr(pool, "prefix_caching", False) and getattr(pool, "kv", None) is not None:
            self.pool = pool
            pool.evict_listeners.append(self._on_evict)
            pool.lower_tier = self
            self._readers = ThreadPoolExecutor(
                self.config.prefetch_concurrency, thread_name_prefix="tokenflow-disk-read"
            )
            kv = pool.kv
            self._dtype = kv.dtype
            self._shape = (kv.num_layers, 2, kv.block_size, kv.num_kv_heads, kv.head_dim)

    async def stop(self) -> None:
        """Write every cached block not yet on disk, wait for the writer, close the folder."""
        self.poll()
        if self.pool is not None and self.store is not None:
            await anyio.to_thread.run_sync(self._flush_pool)
        for executor in (self._readers, self._writer):
            if executor is not None:
                await anyio.to_thread.run_sync(executor.shutdown, True)
        if self.store is not None:
            await anyio.to_thread.run_sync(self.store.close)

    # -- the request path: the response cache -------------------------------------------
    async def handle(self, request: Request, call_next: NextStage) -> None:
        params = request.params
        wanted = params.cache_response if params.cache_response is not None else self.config.response_cache
        key = response_key(self.model_key, request) if wanted else None
        if key is not None:
            stored = self.responses.get_memory(key)
            if stored is None and self.store is not None and self.store.available:
                raw = await anyio.to_thread.run_sync(self.store.get_response, key)
                stored = self.responses.decode_disk(key, raw)
                if stored is None and raw is not None:
                    await anyio.to_thread.run_sync(self.store.delete_response, key)
            if stored is not None:
                self._replay(request, stored)
                return
            self.responses.misses += 1
            request.extras[RECORD] = []
            request.extras[_KEY] = key
        await call_next(request)

    def _replay(self, request: Request, stored: StoredResponse) -> None:
        request.prompt_token_ids = stored.prompt_token_ids
        request.output_token_ids = [t for c in stored.chunks for t in c.token_ids]
        request.finish_reason = stored.chunks[-1].finish_reason
        request.status = RequestStatus.FINISHED
        request.collector.preload(stored.chunks)
        for observer in self.observers:
            observer.on_request_end(request, "cached")

    def on_step(self, duration_s: float, ok: bool) -> None:
        pass

    def on_request_end(self, request: Request, outcome: str) -> None:
        key = request.extras.get(_KEY)
        if key is None or outcome != "completed" or request.finish_reason not in ("stop", "length"):
            return
        raw = self.responses.encode(key, request, request.extras[RECORD])
        if self._writer is not None and self.store is not None:
            self._writer.submit(self.store.put_response, key, raw)

    # -- the KV tier ----------------------------------------------------------------------
    def _on_evict(self, block: int, key: BlockKey) -> None:
        """The pool is about to reuse `block`: copy it out and write it behind."""
        store = self.store
        if store is None or not store.available or store.has_block(key):
            return
        with self._lock:
            if self._pending_writes >= MAX_PENDING_WRITES:
                self.writes_dropped += 1
                return
            self._pending_writes += 1
        data = self.pool.kv.read_block(block).to("cpu")
        assert self._writer is not None
        self._writer.submit(self._write, key, data)

    def _write(self, key: BlockKey, data: torch.Tensor) -> None:
        try:
            ok = self.store is not None and self.store.put_block(key, data)
        finally:
            with self._lock:
                self._pending_writes -= 1
                self.blocks_written += int(bool(ok))

    def _flush_pool(self) -> None:
        """Worker thread, after the step loop stopped: persist what the pool still caches."""
        store = self.store
        for block, key in self.pool.hashed_blocks():
            if not store.available:
                return
            if not store.has_block(key) and store.put_block(key, self.pool.kv.read_block(block).to("cpu")):
                self.blocks_written += 1

    def prefetch(self, request: Request) -> None:
        """Start loading the request's on-disk prefix now (the `prefetcher` stage calls this)."""
        if self._readers is None or request in self._jobs or request.extras.get(_LOADED):
            return
        keys = self._missing_prefix(request)
        if keys and self.store is not None and self.store.has_block(keys[0]):
            self._start(request, keys, prefetch=True)

    def _missing_prefix(self, request: Request) -> list[BlockKey]:
        keys = self.pool.prefix_keys(request)
        return keys[len(self.pool.resident_prefix(keys)):]

    def begin_load(self, request: Request, keys: list[BlockKey]) -> bool:
        """The pool asks for `keys` (past its resident prefix). True: wait, they are loading."""
        job = self._jobs.get(request)
        if job is not None:
            if not job.future.done():
                if job.prefetch and not job.late:
                    job.late = True
                    self.prefetch_late += 1
                return True
            self._install(job)
            return False
        if request.extras.get(_LOADED) or self.store is None or not keys or not self.store.has_block(keys[0]):
            return False
        self._start(request, keys, prefetch=False)
        return True

    def _start(self, request: Request, keys: list[BlockKey], prefetch: bool) -> None:
        assert self._readers is not None
        future = self._readers.submit(self._load, list(keys))
        self._jobs[request] = _LoadJob(request, future, prefetch, keys=list(keys))
        if prefetch:
            self.prefetch_jobs += 1
        else:
            self.load_jobs += 1

    def _load(self, keys: list[BlockKey]) -> list[tuple[BlockKey, torch.Tensor]]:
        """Reader thread: consecutive blocks from disk, stopping at the first miss."""
        loaded = []
        for key in keys:
            if self.store is None or not self.store.has_block(key):
                break
            data = self.store.get_block(key, self._dtype, self._shape)
            if data is None:
                break
            loaded.append((key, data))
        return loaded

    def poll(self) -> None:
        """Install every finished load job (event loop; the pool calls it before matching prefixes)."""
        for job in [j for j in self._jobs.values() if j.future.done()]:
            self._install(job)

    def _install(self, job: _LoadJob) -> None:
        request = job.request
        del self._jobs[request]
        request.extras[_LOADED] = True
        if job.prefetch and not job.late:
            self.prefetch_in_time += 1
        try:
            loaded = job.future.result()
        except Exception:
            log.exception("disk tier: a load job failed; the prefix is recomputed")
            return
        owner = None if request.status is RequestStatus.FINISHED else request
        for key, data in loaded:
            if not self.pool.restore(key, data, owner):
                break
            self.blocks_loaded += 1

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {
            "disk_blocks_written": self.blocks_written,
            "disk_writes_dropped": self.writes_dropped,
            "disk_blocks_loaded": self.blocks_loaded,
            "disk_load_jobs": self.load_jobs,
            "prefetch_jobs": self.prefetch_jobs,
            "prefetch_in_time": self.prefetch_in_time,
            "prefetch_late": self.prefetch_late,
            **self.responses.stats(),
        }
        if self.store is not None:
            stats.update(self.store.stats())
        return stats


def create(config: EngineConfig) -> DiskTier:
    return DiskTier(config)
