"""The disk tier's storage: KV blocks and cached responses in a diskcache folder.

Nothing read back is trusted. A block entry is raw tensor bytes behind a
small JSON header (key, parent key, token ids, dtype, shape) and a MAC, never
a pickle: diskcache stores `bytes` values and `str` keys as they are. The MAC
is keyed BLAKE2b over magic, header and payload, keyed by a deployment secret
(`cache_secret`, else a random one kept in the folder's `secret` file), so
whoever can write the folder or a shared Redis but lacks the secret cannot
plant an entry that checks (a CRC they could recompute). A read checks the
magic, the header, that key, parent and tokens are the ones asked for, that
dtype and shape fit the pool, the length and the MAC; anything off is a miss,
logged, and the entry is deleted. A response is a frame (`encode_frame`):
magic, JSON header (name, length), MAC, payload; on disk it expires after
`expire_s`.

An I/O error (read-only folder, disk full, folder deleted, a locked
database) trips a breaker: the store reports itself unavailable for
`retry_s`, then reopens the folder (recreating it if it was deleted) on
the next use. The engine keeps serving from the pool meanwhile.

Methods are called from worker threads (diskcache is thread-safe), except
`has_block`, which only reads an in-memory set of keys written or found on
disk. diskcache's size limit culls entries behind that set's back: a write
that culled something resyncs the set from the folder's keys (at most about
once per `len(set) / RESYNC_KEYS_PER_WRITE` writes), and a miss discards.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import logging
import os
import secrets
import sqlite3
import struct
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

import diskcache
import msgspec
import torch

from tokenflow.kv.block_hash import BlockKey

__all__ = (
    "CorruptEntry", "DiskStore", "decode_block", "decode_frame", "encode_block", "encode_frame", "folder_secret",
    "mac_key", "read_block",
)

log = logging.getLogger("tokenflow")

MAGIC = b"TFKV\x02"
FRAME_MAGIC = b"TFRS\x02"
_LEN = struct.Struct("<I")
_MAC = 32  # bytes of keyed BLAKE2b after the header
_MAX_HEADER = 1 << 20  # a longer header length is damage, not a block
SECRET_FILE = "secret"
RESYNC_KEYS_PER_WRITE = 64  # keys listed per write, amortised, when culling forces a resync of `_known`
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


class _FrameHeader(msgspec.Struct, frozen=True):
    key: str
    length: int


def mac_key(secret: str | bytes) -> bytes:
    """The BLAKE2b key of a deployment secret (any length; an empty one would be no key at all)."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not raw:
        raise ValueError("the cache secret is empty")
    return hashlib.blake2b(raw, digest_size=32, person=b"tokenflow-secret").digest()


def _mac(secret: bytes, *parts: Any) -> bytes:
    """Keyed BLAKE2b: only a holder of the secret can make an entry that checks."""
    h = hashlib.blake2b(key=secret, digest_size=_MAC, person=b"tokenflow-entry")
    for part in parts:
        h.update(part)
    return h.digest()


def encode_block(key: BlockKey, data: torch.Tensor, *, secret: bytes) -> bytes:
    """One block's K/V (`[layers, 2, block_size, kv_heads, head_dim]`, on the CPU) as an entry."""
    data = data.detach().to("cpu").contiguous()
    payload = data.view(torch.uint8).numpy()
    header = msgspec.json.encode(_Header(
        key=key.hash.hex(), parent=key.parent.hex(), tokens=list(key.tokens),
        dtype=str(data.dtype).removeprefix("torch."), shape=list(data.shape),
    ))
    prefix = MAGIC + _LEN.pack(len(header))
    return b"".join((prefix, header, _mac(secret, prefix, header, payload), payload))


def decode_block(
    entry: bytes, key: BlockKey, dtype: torch.dtype, shape: tuple[int, ...], *, secret: bytes
) -> torch.Tensor:
    """The tensor in `entry`, after every check; raises `CorruptEntry` naming the first that failed."""
    if not isinstance(entry, bytes):
        raise CorruptEntry("bad magic")
    return read_block(io.BytesIO(entry), key, dtype, shape, secret=secret)


def read_block(
    stream: BinaryIO, key: BlockKey, dtype: torch.dtype, shape: tuple[int, ...], *, secret: bytes
) -> torch.Tensor:
    """`decode_block` from a file: the payload is read straight into the returned tensor (one copy)."""
    prefix = stream.read(len(MAGIC) + _LEN.size)
    if not prefix.startswith(MAGIC):
        raise CorruptEntry("bad magic")
    if len(prefix) < len(MAGIC) + _LEN.size:
        raise CorruptEntry("truncated header")
    (header_len,) = _LEN.unpack_from(prefix, len(MAGIC))
    if header_len > _MAX_HEADER:
        raise CorruptEntry(f"bad header: {header_len} bytes long")
    raw_header = stream.read(header_len)
    try:
        header = msgspec.json.decode(raw_header, type=_Header)
    except msgspec.DecodeError as exc:
        raise CorruptEntry(f"bad header: {exc}") from None
    if header.key != key.hash.hex() or header.parent != key.parent.hex() or tuple(header.tokens) != key.tokens:
        raise CorruptEntry("key, parent or tokens differ from the ones asked for")
    if header.dtype != str(dtype).removeprefix("torch.") or tuple(header.shape) != tuple(shape):
        raise CorruptEntry(f"dtype/shape {header.dtype}{header.shape} do not fit the pool ({dtype}{list(shape)})")
    tag = stream.read(_MAC)
    out = torch.empty(shape, dtype=dtype)
    payload = memoryview(out.view(torch.uint8).numpy()).cast("B")
    got = stream.readinto(payload) if len(tag) == _MAC else 0
    if got != len(payload) or stream.read(1):
        raise CorruptEntry(f"payload is {got if got != len(payload) else 'over'} {len(payload)} bytes (truncated?)")
    if not hmac.compare_digest(tag, _mac(secret, prefix, raw_header, payload)):
        raise CorruptEntry("MAC mismatch (written under another secret, or altered)")
    return out


def encode_frame(name: str, payload: bytes, *, secret: bytes) -> bytes:
    """A checked envelope for `payload` stored under `name` (a cached response)."""
    header = msgspec.json.encode(_FrameHeader(name, len(payload)))
    prefix = FRAME_MAGIC + _LEN.pack(len(header))
    return b"".join((prefix, header, _mac(secret, prefix, header, payload), payload))


def decode_frame(raw: bytes, name: str, *, secret: bytes) -> bytes:
    """The payload of a frame stored under `name`; raises `CorruptEntry` on any mismatch."""
    start = len(FRAME_MAGIC) + _LEN.size
    if not isinstance(raw, bytes) or not raw.startswith(FRAME_MAGIC) or len(raw) < start:
        raise CorruptEntry("bad magic")
    (header_len,) = _LEN.unpack_from(raw, len(FRAME_MAGIC))
    raw_header = raw[start:start + header_len]
    try:
        header = msgspec.json.decode(raw_header, type=_FrameHeader)
    except msgspec.DecodeError as exc:
        raise CorruptEntry(f"bad header: {exc}") from None
    tag, payload = raw[start + header_len:start + header_len + _MAC], raw[start + header_len + _MAC:]
    if header.key != name:
        raise CorruptEntry("stored under another name")
    if header.length != len(payload) or len(tag) != _MAC:
        raise CorruptEntry("length mismatch (truncated?)")
    if not hmac.compare_digest(tag, _mac(secret, raw[:start], raw_header, payload)):
        raise CorruptEntry("MAC mismatch (written under another secret, or altered)")
    return payload


def folder_secret(directory: Path) -> bytes:
    """The folder's random secret, created once (mode 0600): engines starting at once agree on it.

    It is written under a temporary name and hard-linked into place, so the file never exists half
    written and the first link wins (O_EXCL semantics)."""
    path = directory / SECRET_FILE
    if not path.exists():
        tmp = directory / f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_hex(32).encode())
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(FileExistsError):  # another engine won: use its secret
                os.link(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    text = path.read_bytes().strip()
    try:
        if len(bytes.fromhex(text.decode("ascii"))) < 16:
            raise ValueError("too short")
    except ValueError:
        raise OSError(f"{path} is not a tokenflow cache secret; delete it to make a new one") from None
    return text


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
    """A diskcache folder holding KV blocks (`kv:<hash>`) and responses (`resp:<hash>`).

    `secret` keys the MACs; None: the folder's own random secret (`folder_secret`)."""

    def __init__(
        self, directory: str | Path, size_limit: int, retry_s: float = 30.0, *, secret: str | bytes | None = None
    ) -> None:
        self.directory = Path(directory).expanduser()
        self.size_limit = size_limit
        self.retry_s = retry_s
        self._secret = secret
        self._key = b""  # the MAC key, set by _open
        self._lock = threading.Lock()
        self._cache: diskcache.Cache | None = None
        self._off_until = 0.0
        self._closed = False  # never reopened after close (a late reader thread may still call in)
        self._known: set[str] = set()
        self._known_lock = threading.Lock()
        self._stale = False  # diskcache culled entries since `_known` was listed
        self._writes_since_sync = 0
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
            key = mac_key(self._secret if self._secret is not None else folder_secret(self.directory))
            cache = diskcache.Cache(
                str(self.directory), size_limit=self.size_limit, eviction_policy="least-recently-used",
                disk_min_file_size=0, cull_limit=16, disk=_NoPickleDisk,
            )
            known = _block_names(cache)
        except _IO_ERRORS as exc:
            self._trip(exc)
            return
        self._key, self._cache, self._known, self._stale = key, cache, known, False

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
        return self._cache is not None or (not self._closed and time.monotonic() >= self._off_until)

    def _handle(self) -> diskcache.Cache | None:
        """The open cache, reopening it once the breaker's wait is over; None while off."""
        if self._cache is None and not self._closed and time.monotonic() >= self._off_until:
            with self._lock:
                if self._cache is None and not self._closed:
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
        if self._handle() is None:  # (re)opened first: that may set the secret
            return False
        entry = encode_block(key, data, secret=self._key)
        culled = self._io(_set, _BLOCK_PREFIX + key.hash.hex(), entry, None)
        if culled is None:
            return False
        with self._known_lock:
            self._known.add(key.hash.hex())
        self._after_write(culled)
        return True

    def get_block(self, key: BlockKey, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        name = _BLOCK_PREFIX + key.hash.hex()
        handle = self._io(_open, name)
        if handle is None:
            self._known.discard(key.hash.hex())
            return None
        try:
            with handle if hasattr(handle, "readinto") else io.BytesIO(handle) as stream:
                return read_block(stream, key, dtype, shape, secret=self._key)
        except CorruptEntry as exc:
            self.num_corrupt += 1
            log.warning("disk tier: dropping corrupt KV entry %s: %s", name, exc)
            self._known.discard(key.hash.hex())
            self._io(_delete, name)
            return None
        except OSError as exc:
            self._trip(exc)
            return None

    def delete_block(self, key: BlockKey) -> None:
        """Forget a block found unusable after it decoded (e.g. non-finite values)."""
        self._known.discard(key.hash.hex())
        self._io(_delete, _BLOCK_PREFIX + key.hash.hex())

    def _after_write(self, culled: int) -> None:
        """Keep `_known` in step with diskcache's culling, listing keys at an amortised bounded cost."""
        self._writes_since_sync += 1
        self._stale = self._stale or culled > 0
        if self._stale and self._writes_since_sync * RESYNC_KEYS_PER_WRITE >= len(self._known):
            self.resync()

    def resync(self) -> None:
        """List the folder's block keys again when a cull may have made `has_block` stale."""
        if not self._stale:
            return
        with self._known_lock:
            known = self._io(_block_names)
            if known is not None:
                self._known, self._stale, self._writes_since_sync = known, False, 0

    # -- responses --------------------------------------------------------------------
    def put_response(self, key: str, value: bytes, expire_s: float | None = None) -> bool:
        """Store a response (framed with its MAC); it reads as missing after `expire_s`."""
        name = _RESPONSE_PREFIX + key
        if self._handle() is None:
            return False
        culled = self._io(_set, name, encode_frame(name, value, secret=self._key), expire_s)
        if culled is None:
            return False
        self._after_write(culled)
        return True

    def get_response(self, key: str) -> bytes | None:
        """The stored payload, or None (a bad entry is counted and deleted)."""
        name = _RESPONSE_PREFIX + key
        value = self._io(_get, name)
        if value is None:
            return None
        try:
            return decode_frame(value, name, secret=self._key)
        except CorruptEntry as exc:
            self.num_corrupt += 1
            log.warning("disk tier: dropping corrupt response entry %s: %s", name, exc)
            self._io(_delete, name)
            return None

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
        self._closed = True
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


def _set(cache: diskcache.Cache, key: str, value: bytes, expire_s: float | None) -> int:
    """Set `key`; returns how many other entries diskcache culled to stay under its size limit."""
    before, existed = len(cache), key in cache
    cache.set(key, value, expire=expire_s)
    return before + (not existed) - len(cache)


def _block_names(cache: diskcache.Cache) -> set[str]:
    return {k[len(_BLOCK_PREFIX):] for k in cache.iterkeys() if isinstance(k, str) and k.startswith(_BLOCK_PREFIX)}


def _get(cache: diskcache.Cache, key: str) -> Any:
    return cache.get(key, default=None)


def _open(cache: diskcache.Cache, key: str) -> Any:
    """An open file of the entry (or its bytes, for an entry stored inside the database)."""
    return cache.get(key, default=None, read=True)


def _delete(cache: diskcache.Cache, key: str) -> bool:
    return bool(cache.delete(key))
