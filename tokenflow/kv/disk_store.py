"""The disk tier's storage: KV blocks and cached responses in a diskcache folder.

Nothing read back is trusted. A block entry is raw tensor bytes behind a
small JSON header (key, parent key, token ids, dtype, shape, checksum of the
payload), never a pickle: diskcache stores `bytes` values and `str` keys
as they are. A read checks the magic, the header, that key, parent and
tokens are the ones asked for, that dtype and shape fit the pool, the length
and the checksum; anything off is a miss, logged, and the entry is deleted.

An I/O error (read-only folder, disk full, folder deleted, a locked
database) trips a breaker: the store reports itself unavailable for
`retry_s`, then reopens the folder (recreating it if it was deleted) on
the next use. The engine keeps serving from the pool meanwhile.

Methods are called from worker threads (diskcache is thread-safe), except
`has_block`, which only reads an in-memory set of keys written or found on
disk (a hint: diskcache's own size limit may have culled an entry since).
"""

from __future__ import annotations

import contextlib
import io
import logging
import sqlite3
import struct
import threading
import time
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import diskcache
import msgspec
import torch

from tokenflow.kv.block_hash import BlockKey

__all__ = ("CorruptEntry", "DiskStore", "decode_block", "encode_block", "read_block")

log = logging.getLogger("tokenflow")

MAGIC = b"TFKV\x01"
_LEN = struct.Struct("<I")
_BLOCK_PREFIX = "kv:"
_RESPONSE_PREFIX = "resp:"
_IO_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)


class CorruptEntry(ValueError):
    """A stored entry failed a check; it is never used."""


class _Header(msgspec.Struct, frozen=True):
    key: str
    parent: str
    tokens: list[int]
    dtype: str
    shape: list[int]
    checksum: str


def _checksum(payload: Any) -> str:
    """CRC-32: catches disk corruption and truncation at ~4 GB/s (blake2b managed ~0.8 GB/s here);
    the key, parent and tokens in the header guard against a block filed under the wrong name."""
    return f"crc32:{zlib.crc32(payload):08x}"


def encode_block(key: BlockKey, data: torch.Tensor) -> bytes:
    """One block's K/V (`[layers, 2, block_size, kv_heads, head_dim]`, on the CPU) as an entry."""
    data = data.detach().to("cpu").contiguous()
    payload = data.view(torch.uint8).numpy().tobytes()
    header = msgspec.json.encode(_Header(
        key=key.hash.hex(), parent=key.parent.hex(), tokens=list(key.tokens),
        dtype=str(data.dtype).removeprefix("torch."), shape=list(data.shape), checksum=_checksum(payload),
    ))
    return b"".join((MAGIC, _LEN.pack(len(header)), header, payload))


def decode_block(entry: bytes, key: BlockKey, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor in `entry`, after every check; raises `CorruptEntry` naming the first that failed."""
    if not isinstance(entry, bytes):
        raise CorruptEntry("bad magic")
    return read_block(io.BytesIO(entry), key, dtype, shape)


def read_block(stream: BinaryIO, key: BlockKey, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """`decode_block` from a file: the payload is read straight into the returned tensor (one copy)."""
    prefix = stream.read(len(MAGIC) + _LEN.size)
    if not prefix.startswith(MAGIC):
        raise CorruptEntry("bad magic")
    if len(prefix) < len(MAGIC) + _LEN.size:
        raise CorruptEntry("truncated header")
    (header_len,) = _LEN.unpack_from(prefix, len(MAGIC))
    try:
        header = msgspec.json.decode(stream.read(header_len), type=_Header)
    except msgspec.DecodeError as exc:
        raise CorruptEntry(f"bad header: {exc}") from None
    if header.key != key.hash.hex() or header.parent != key.parent.hex() or tuple(header.tokens) != key.tokens:
        raise CorruptEntry("key, parent or tokens differ from the ones asked for")
    if header.dtype != str(dtype).removeprefix("torch.") or tuple(header.shape) != tuple(shape):
        raise CorruptEntry(f"dtype/shape {header.dtype}{header.shape} do not fit the pool ({dtype}{list(shape)})")
    out = torch.empty(shape, dtype=dtype)
    payload = memoryview(out.view(torch.uint8).numpy()).cast("B")
    got = stream.readinto(payload)
    if got != len(payload) or stream.read(1):
        raise CorruptEntry(f"payload is {got if got != len(payload) else 'over'} {len(payload)} bytes (truncated?)")
    if _checksum(payload) != header.checksum:
        raise CorruptEntry("checksum mismatch")
    return out


class _NoPickleDisk(diskcache.Disk):
    """diskcache's serializer, minus pickle: keys are `str`, values `bytes`. A pickled key or value
    found in the folder (written by something else) reads as garbage and is never unpickled."""

    def put(self, key: Any) -> Any:
        if not isinstance(key, str):
            raise TypeError("disk tier keys are str")
        return super().put(key)

    def get(self, key: Any, raw: bool) -> Any:
        return super().get(key, raw) if raw else "\x00pickled-key"

    def store(self, value: Any, read: bool, key: Any = diskcache.core.UNKNOWN) -> Any:
        if not isinstance(value, bytes):
            raise TypeError("disk tier values are bytes")
        return super().store(value, read, key=key)

    def fetch(self, mode: int, filename: Any, value: Any, read: bool) -> Any:
        if mode == diskcache.core.MODE_PICKLE:
            return b""  # fails every check downstream: a corrupt entry
        return super().fetch(mode, filename, value, read)


class DiskStore:
    """A diskcache folder holding KV blocks (`kv:<hash>`) and responses (`resp:<hash>`)."""

    def __init__(self, directory: str | Path, size_limit: int, retry_s: float = 30.0) -> None:
        self.directory = Path(directory).expanduser()
        self.size_limit = size_limit
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self._cache: diskcache.Cache | None = None
        self._off_until = 0.0
        self._known: set[str] = set()
        self.num_io_errors = 0
        self.num_corrupt = 0
        self.last_error = ""
        self._open()

    # -- the breaker ---------------------------------------------------------------
    def _open(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # Every value in its own file (`disk_min_file_size=0`): the database stays small and a block
            # is one plain file. LRU order, so hot prefixes outlive one-off ones under the size limit.
            cache = diskcache.Cache(
                str(self.directory), size_limit=self.size_limit, eviction_policy="least-recently-used",
                disk_min_file_size=0, cull_limit=16, disk=_NoPickleDisk,
            )
            known = {k[len(_BLOCK_PREFIX):] for k in cache.iterkeys() if isinstance(k, str)
                     and k.startswith(_BLOCK_PREFIX)}
        except _IO_ERRORS as exc:
            self._trip(exc)
            return
        self._cache, self._known = cache, known

    def _trip(self, exc: BaseException) -> None:
        self.num_io_errors += 1
        self.last_error = repr(exc)
        self._off_until = time.monotonic() + self.retry_s
        log.warning("disk tier %s is off for %.0f s after an I/O error: %r", self.directory, self.retry_s, exc)
        cache, self._cache = self._cache, None
        if cache is not None:
            with contextlib.suppress(Exception):  # closing a broken cache may fail too; it is dropped anyway
                cache.close()

    @property
    def available(self) -> bool:
        return self._cache is not None or time.monotonic() >= self._off_until

    def _handle(self) -> diskcache.Cache | None:
        """The open cache, reopening it once the breaker's wait is over; None while off."""
        if self._cache is None and time.monotonic() >= self._off_until:
            with self._lock:
                if self._cache is None:
                    self._open()
        return self._cache

    def _io(self, fn: Any, *args: Any) -> Any:
        """Run one diskcache call; an I/O error trips the breaker and reads as None."""
        cache = self._handle()
        if cache is None:
            return None
        try:
            if not (self.directory / "cache.db").exists():
                # Deleted under us: SQLite would keep writing to the unlinked file and lose everything.
                raise FileNotFoundError(f"{self.directory}/cache.db vanished")
            return fn(cache, *args)
        except _IO_ERRORS as exc:
            self._trip(exc)
            return None

    # -- blocks ----------------------------------------------------------------------
    def has_block(self, key: BlockKey) -> bool:
        return key.hash.hex() in self._known and self.available

    def put_block(self, key: BlockKey, data: torch.Tensor) -> bool:
        entry = encode_block(key, data)
        ok = self._io(_set, _BLOCK_PREFIX + key.hash.hex(), entry)
        if ok:
            self._known.add(key.hash.hex())
        return bool(ok)

    def get_block(self, key: BlockKey, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        name = _BLOCK_PREFIX + key.hash.hex()
        handle = self._io(_open, name)
        if handle is None:
            self._known.discard(key.hash.hex())
            return None
        try:
            with handle if hasattr(handle, "readinto") else io.BytesIO(handle) as stream:
                return read_block(stream, key, dtype, shape)
        except CorruptEntry as exc:
            self.num_corrupt += 1
            log.warning("disk tier: dropping corrupt KV entry %s: %s", name, exc)
            self._known.discard(key.hash.hex())
            self._io(_delete, name)
            return None
        except OSError as exc:
            self._trip(exc)
            return None

    # -- responses --------------------------------------------------------------------
    def put_response(self, key: str, value: bytes) -> bool:
        return bool(self._io(_set, _RESPONSE_PREFIX + key, value))

    def get_response(self, key: str) -> bytes | None:
        value = self._io(_get, _RESPONSE_PREFIX + key)
        return value if isinstance(value, bytes) else None

    def delete_response(self, key: str) -> None:
        self._io(_delete, _RESPONSE_PREFIX + key)

    # -- housekeeping -------------------------------------------------------------------
    def volume(self) -> int:
        """Bytes on disk (diskcache's own accounting); 0 while off."""
        cache = self._cache
        if cache is None:
            return 0
        try:
            return int(cache.volume())
        except _IO_ERRORS:
            return 0

    def close(self) -> None:
        cache, self._cache = self._cache, None
        if cache is not None:
            try:
                cache.close()
            except _IO_ERRORS as exc:
                log.warning("disk tier: closing %s failed: %r", self.directory, exc)

    def stats(self) -> dict[str, Any]:
        return {
            "disk_blocks": len(self._known),
            "disk_bytes": self.volume(),
            "disk_available": self.available,
            "disk_io_errors": self.num_io_errors,
            "disk_corrupt_entries": self.num_corrupt,
        }


def _set(cache: diskcache.Cache, key: str, value: bytes) -> bool:
    return bool(cache.set(key, value))


def _get(cache: diskcache.Cache, key: str) -> Any:
    return cache.get(key, default=None)


def _open(cache: diskcache.Cache, key: str) -> Any:
    """An open file of the entry (or its bytes, for an entry stored inside the database)."""
    return cache.get(key, default=None, read=True)


def _delete(cache: diskcache.Cache, key: str) -> bool:
    return bool(cache.delete(key))
