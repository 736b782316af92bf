"""`BlockTier`: the base of a KV tier below the token pool (disk, or a plugin's remote store).

A tier attaches to the pool at start (`attach`): it joins `pool.lower_tiers`
(asked in that order, so tiers nearest the engine come first) and its
`on_evict` / `on_commit` hooks join the pool's listeners when it defines
them. Loading works in *load jobs*: when a request's prefix continues past
what the pool holds, a reader thread fetches the next blocks (consecutive,
stopping at the first miss) and the finished job restores them into the
pool on the event loop, pinned for the request until it is admitted or
ends. The `prefetcher` stage starts jobs when a request is queued
(`prefetch`); otherwise the pool starts one when the batcher first tries to
admit the request (`begin_load`), which then waits while others run. A
block is fetched by one job at a time: a request whose next missing block a
running job already fetches waits for that job and then asks again for what
is still missing (requests arriving together on one shared prefix read it
once, not once each).

Loaded values are not trusted: the reader thread drops a block holding a NaN
or an infinity (and the blocks after it; counted, `discard_block` told) before
the pool sees it. A job still running `load_timeout_s` after it started is
abandoned when the pool next polls: its request recomputes the prefix, and
while an abandoned job's thread is still busy the tier starts no other job
(a hung store never piles up threads), and stop does not wait for it.

Writing goes the other way, behind the step loop: `write_behind(block, key)`
copies a block out on the event loop (before the pool can reuse it) and
hands it to the tier's writer thread, dropping it (counted) when
`max_pending_writes` copies already wait.

A subclass says how to fetch and store: `might_have(key)` (event loop;
cheap; False skips the tier), `fetch_blocks(keys)` (reader thread),
`write_block(key, data)` (writer thread) and optionally `discard_block(key)`.
Everything else, including the load counters in `stats()` (prefixed with
`name`), is shared.
"""

from __future__ import annotations

import abc
import itertools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import torch

from tokenflow.kv.block_hash import BlockKey
from tokenflow.protocols import TieredPool
from tokenflow.request import Request, RequestSlot, RequestStatus
from tokenflow.runtime.cpu.openmp_team import release_openmp_team

__all__ = ("BlockTier",)

log = logging.getLogger("tokenflow")

Loaded = list[tuple[BlockKey, torch.Tensor]]


@dataclass(eq=False)
class _LoadJob:
    request: Request
    future: Future[Loaded]
    prefetch: bool
    started: float  # time.monotonic()
    keys: list[BlockKey]
    late: bool = False


class BlockTier(abc.ABC):
    name = "tier"  # prefixes the stats keys and thread names
    max_pending_writes = 256  # blocks copied out and not yet written; more are dropped
    load_timeout_s = 5.0  # a load job running longer is abandoned (subclasses set it from the config)

    def __init__(self) -> None:
        self.pool: Any = None
        self.dtype: torch.dtype | None = None
        self.block_shape: tuple[int, ...] = ()
        self._readers: ThreadPoolExecutor | None = None
        self.writer: ThreadPoolExecutor | None = None  # block writes, and any other write the tier puts behind
        self._jobs: dict[Request, _LoadJob] = {}
        self._fetching: dict[bytes, _LoadJob] = {}  # block hash -> the running job that fetches it
        self._loaded = RequestSlot[bool]("tier load done")  # its job was installed or given up: never load twice
        self._abandoned: list[Future[Loaded]] = []  # timed-out jobs whose threads may still be busy
        self._write_lock = threading.Lock()
        self._pending_writes = 0
        self.blocks_written = 0
        self.writes_dropped = 0
        self.blocks_loaded = 0
        self.blocks_fetched = 0  # read by load jobs; more than blocks_loaded when the pool had no room
        self.load_jobs = 0
        self.prefetch_jobs = 0
        self.prefetch_in_time = 0
        self.prefetch_late = 0
        self.load_timeouts = 0
        self.nonfinite_blocks = 0


    def attach(self, pool: Any, readers: int) -> bool:
        """Join `pool` as its next lower tier; False (and nothing done) when it has no prefix cache."""
        if not isinstance(pool, TieredPool) or not pool.prefix_caching or pool.kv is None:
            return False
        self.pool = pool
        kv = pool.kv
        self.dtype = kv.block_dtype  # int8 with kv_cache_dtype="int8" (scales in each row's last 4 bytes)
        self.block_shape = kv.block_shape
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix=f"tokenflow-{self.name}-read")
        pool.lower_tiers.append(self)
        if hasattr(self, "on_evict"):
            pool.evict_listeners.append(self.on_evict)
        if hasattr(self, "on_commit"):
            pool.commit_listeners.append(self.on_commit)
        return True

    def start_writer(self) -> None:
        self.writer = ThreadPoolExecutor(1, thread_name_prefix=f"tokenflow-{self.name}-write")

    def close_threads(self, write_timeout_s: float | None = None) -> None:
        """Worker thread, at stop: wait for load jobs (up to `load_timeout_s`; never for abandoned ones)
        and for pending writes, those not started within `write_timeout_s` (None: no limit) being dropped."""
        if self._readers is not None:
            _, late = wait_futures([job.future for job in self._jobs.values()], timeout=self.load_timeout_s)
            self._readers.shutdown(wait=not late and not self._hung(), cancel_futures=True)
        if self.writer is None:
            return
        if write_timeout_s is not None:
            try:
                self.writer.submit(int).result(timeout=max(write_timeout_s, 0.05))  # queued after every write
            except FutureTimeout:
                log.warning("%s: stop timed out with writes pending; they are dropped", self.name)
                self.writer.shutdown(wait=False, cancel_futures=True)
        self.writer.shutdown(wait=True)  # at most the one write in progress, after a timeout

    # -- what a subclass provides --------------------------------------------------------
    def might_have(self, key: BlockKey) -> bool:
        """Event loop: whether loading from `key` on is worth a job (a hint; may be wrong)."""
        return True

    @abc.abstractmethod
    def fetch_blocks(self, keys: list[BlockKey]) -> Loaded:
        """Reader thread: the blocks of `keys` in order, stopping at the first one missing or bad."""

    @abc.abstractmethod
    def write_block(self, key: BlockKey, data: torch.Tensor) -> bool:
        """Writer thread: store one block's K/V; True when it was written."""

    def discard_block(self, key: BlockKey) -> None:  # noqa: B027 (an optional hook)
        """Reader thread: a block fetched under `key` is unusable (non-finite); delete it if you can."""

    # -- writing behind --------------------------------------------------------------------
    def write_behind(self, block: int, key: BlockKey) -> bool:
        """Copy `block` out now and `write_block` it on the writer thread; False when dropped."""
        with self._write_lock:
            if self._pending_writes >= self.max_pending_writes:
                self.writes_dropped += 1
                return False
            self._pending_writes += 1
        assert self.writer is not None
        self.writer.submit(self._write, key, self.pool.kv.read_block(block).to("cpu"))
        return True

    def _write(self, key: BlockKey, data: torch.Tensor) -> None:
        written = False
        try:
            written = self.write_block(key, data)
        finally:
            with self._write_lock:
                self._pending_writes -= 1
                self.blocks_written += int(written)

    # -- load jobs -------------------------------------------------------------------------
    def missing_prefix(self, request: Request) -> list[BlockKey]:
        keys = self.pool.prefix_keys(request)
        return keys[len(self.pool.resident_prefix(keys)):]

    def prefetch(self, request: Request) -> bool:
        """Start loading the request's prefix now; True when a job started (or runs already)."""
        if self.pool is None or self._loaded.get(request):
            return False
        if request in self._jobs:
            return True
        if self._hung():
            return False
        keys = self.missing_prefix(request)
        if not keys or keys[0].hash in self._fetching or not self.might_have(keys[0]):
            return False  # (a running job fetches its next block: it asks again when admitted)
        self._start(request, keys, prefetch=True)
        return True

    def begin_load(self, request: Request, keys: list[BlockKey]) -> bool:
        """The pool asks for `keys` (past its resident prefix). True: wait, they are loading."""
        self._abandon_overdue()
        job = self._jobs.get(request)
        if job is not None:
            if not job.future.done():
                if job.prefetch and not job.late:
                    job.late = True
                    self.prefetch_late += 1
                return True
            self._install(job)
            return False
        if self._loaded.get(request) or not keys or self._hung():
            return False
        if keys[0].hash in self._fetching:
            return True  # another request's job fetches it: wait for that, then ask again
        if not self.might_have(keys[0]):
            return False
        self._start(request, keys, prefetch=False)
        return True

    def _start(self, request: Request, keys: list[BlockKey], prefetch: bool) -> None:
        assert self._readers is not None
        keys = list(itertools.takewhile(lambda key: key.hash not in self._fetching, keys))
        future = self._readers.submit(self._fetch_checked, keys)
        job = self._jobs[request] = _LoadJob(request, future, prefetch, time.monotonic(), keys)
        for key in keys:
            self._fetching[key.hash] = job
        if prefetch:
            self.prefetch_jobs += 1
        else:
            self.load_jobs += 1

    def _fetch_checked(self, keys: list[BlockKey]) -> Loaded:
        """Reader thread: `fetch_blocks`, cut before the first block with a NaN or an infinity."""
        try:
            return self._fetch_finite(keys)
        finally:
            # The torch ops of a load gave this thread an OpenMP team; left alive, its helpers make the
            # model thread's every parallel region sleep and wake (decode ran 2x slower after a load).
            release_openmp_team()

    def _fetch_finite(self, keys: list[BlockKey]) -> Loaded:
        loaded = self.fetch_blocks(keys)
        with self._write_lock:
            self.blocks_fetched += len(loaded)
        for i, (key, data) in enumerate(loaded):
            if not self.pool.kv.block_is_finite(data):
                log.warning("%s: block %s holds non-finite values; dropped", self.name, key.hex)
                with self._write_lock:
                    self.nonfinite_blocks += 1
                self.discard_block(key)
                return loaded[:i]
        return loaded

    def _hung(self) -> bool:
        """Whether the thread of an abandoned load job is still busy (then no job starts)."""
        self._abandoned = [f for f in self._abandoned if not f.done()]
        return bool(self._abandoned)

    def _abandon_overdue(self) -> None:
        """Give up on load jobs running past `load_timeout_s`: their requests recompute."""
        now = time.monotonic()
        for job in [j for j in self._jobs.values() if not j.future.done() and now - j.started >= self.load_timeout_s]:
            self._end(job)
            self._loaded.set(job.request, True)  # never tried again for this request
            self._abandoned.append(job.future)
            self.load_timeouts += 1
            log.warning("%s: a load job ran past %.1f s; abandoned, the prefix is recomputed",
                        self.name, self.load_timeout_s)

    def poll(self) -> None:
        """Install every finished load job and abandon overdue ones (event loop; the pool calls it
        before matching prefixes)."""
        self._abandon_overdue()
        for job in [j for j in self._jobs.values() if j.future.done()]:
            self._install(job)

    def _end(self, job: _LoadJob) -> None:
        del self._jobs[job.request]
        for key in job.keys:  # each its own: `_start` gives no job a block another job fetches
            del self._fetching[key.hash]

    def _install(self, job: _LoadJob) -> None:
        request = job.request
        self._end(job)
        self._loaded.set(request, True)
        if job.prefetch and not job.late:
            self.prefetch_in_time += 1
        try:
            loaded = job.future.result()
        except Exception:
            log.exception("%s: a load job failed; the prefix is recomputed", self.name)
            return
        owner = None if request.status is RequestStatus.FINISHED else request
        for key, data in loaded:
            if not self.pool.restore(key, data, owner):
                break
            self.blocks_loaded += 1

    def stats(self) -> dict[str, Any]:
        return {
            f"{self.name}_blocks_loaded": self.blocks_loaded,
            f"{self.name}_blocks_fetched": self.blocks_fetched,
            f"{self.name}_load_jobs": self.load_jobs,
            f"{self.name}_prefetch_jobs": self.prefetch_jobs,
            f"{self.name}_prefetch_in_time": self.prefetch_in_time,
            f"{self.name}_prefetch_late": self.prefetch_late,
            f"{self.name}_load_timeouts": self.load_timeouts,
            f"{self.name}_nonfinite_blocks": self.nonfinite_blocks,
        }
