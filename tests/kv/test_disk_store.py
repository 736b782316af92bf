"""DiskStore: the disk tier's folder. Round trips are exact, nothing read back is trusted
(every bad entry is a counted, deleted miss, no pickle is ever loaded, and only a holder of the
secret can write an entry that checks), and I/O errors trip a breaker that reopens the folder
after `retry_s`."""

from __future__ import annotations

import errno
import hashlib
import pickle
import shutil
import threading
import time
from pathlib import Path

import diskcache
import pytest
import torch

from tokenflow.kv.block_hash import BlockKey, block_keys
from tokenflow.kv.tiers.disk_store import (
    CorruptEntry,
    DiskStore,
    decode_block,
    decode_frame,
    encode_block,
    encode_frame,
    folder_secret,
    mac_key,
)

SHAPE = (1, 2, 4, 1, 2)  # [layers, K/V, block_size, kv_heads, head_dim]
LIMIT = 2**30
RETRY_S = 0.25
KEYS = block_keys(list(range(1, 17)), 4, b"\x07" * 16)  # 4 chained keys
SECRET = mac_key("test-secret")


def block(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN, -0.0 != 0.0), dtype and shape included."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def entry_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.val"))


def name(key: BlockKey) -> str:
    return "kv:" + key.hash.hex()


# -- encode / decode ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_encode_decode_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    data = block(0, dtype)
    flat = data.view(-1)
    flat[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0], dtype=dtype)
    entry = encode_block(KEYS[0], data, secret=SECRET)
    assert entry.startswith(b"TFKV\x02")
    out = decode_block(entry, KEYS[0], dtype, SHAPE, secret=SECRET)
    assert same_bits(out, data)
    out.zero_()  # the result owns its memory: writing to it leaves the entry intact
    assert same_bits(decode_block(entry, KEYS[0], dtype, SHAPE, secret=SECRET), data)


def test_decode_names_the_failed_check() -> None:
    data = block(1)
    entry = encode_block(KEYS[1], data, secret=SECRET)
    cases = {
        "bad magic": b"XXXX" + entry[4:],
        "truncated header": entry[:7],
        "bad header": entry[:9] + b"\xff" + entry[10:],
        "key, parent or tokens": entry,  # decoded under another key below
        "truncated": entry[:-1],
        "MAC mismatch": entry[:-1] + bytes([entry[-1] ^ 0x01]),
    }
    for expected, bad in cases.items():
        key = KEYS[2] if expected.startswith("key") else KEYS[1]
        with pytest.raises(CorruptEntry, match=expected):
            decode_block(bad, key, torch.float32, SHAPE, secret=SECRET)
    with pytest.raises(CorruptEntry, match="bad magic"):
        decode_block(bytearray(entry), KEYS[1], torch.float32, SHAPE, secret=SECRET)  # only real bytes
    with pytest.raises(CorruptEntry, match="do not fit"):
        decode_block(entry, KEYS[1], torch.float16, SHAPE, secret=SECRET)
    with pytest.raises(CorruptEntry, match="do not fit"):
        decode_block(entry, KEYS[1], torch.float32, (1, 2, 2, 1, 4), secret=SECRET)


def _unkeyed_forgery(entry: bytes) -> bytes:
    """What a writer without the secret can do: alter the payload, then fix up an integrity field it
    can compute (an unkeyed BLAKE2b in the MAC's place, the way a CRC could be recomputed)."""
    header_end = 9 + int.from_bytes(entry[5:9], "little")
    raw = bytearray(entry)
    raw[-3] ^= 0xFF
    payload = bytes(raw[header_end + 32:])
    fake = hashlib.blake2b(bytes(raw[:header_end]) + payload, digest_size=32, person=b"tokenflow-entry").digest()
    return bytes(raw[:header_end]) + fake + payload


def test_entries_check_only_under_their_secret() -> None:
    data = block(2)
    entry = encode_block(KEYS[0], data, secret=SECRET)
    with pytest.raises(CorruptEntry, match="MAC mismatch"):
        decode_block(entry, KEYS[0], torch.float32, SHAPE, secret=mac_key("another deployment"))
    with pytest.raises(CorruptEntry, match="MAC mismatch"):
        decode_block(_unkeyed_forgery(entry), KEYS[0], torch.float32, SHAPE, secret=SECRET)
    frame = encode_frame("resp:k", b"payload", secret=SECRET)
    assert decode_frame(frame, "resp:k", secret=SECRET) == b"payload"
    for bad_secret, name, raw in [
        (mac_key("another deployment"), "resp:k", frame),
        (SECRET, "resp:other", frame),
        (SECRET, "resp:k", frame[:-1] + b"P"),
    ]:
        with pytest.raises(CorruptEntry):
            decode_frame(raw, name, secret=bad_secret)
    with pytest.raises(ValueError, match="empty"):
        mac_key("")


# -- the store --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    store = DiskStore(tmp_path, LIMIT)
    data = [block(i, dtype) for i in range(3)]
    for key, d in zip(KEYS, data):
        assert store.put_block(key, d) is True
    assert len(entry_files(tmp_path)) == 3  # one file per value
    for key, d in zip(KEYS, data):
        assert same_bits(store.get_block(key, dtype, SHAPE), d)
    assert store.get_block(KEYS[3], dtype, SHAPE) is None  # never written: a plain miss
    stats = store.stats()
    assert (stats["disk_blocks"], stats["disk_corrupt_entries"], stats["disk_io_errors"]) == (3, 0, 0)
    assert stats["disk_available"] is True and stats["disk_bytes"] > 0
    store.close()


def decodes_as(path: Path, key: BlockKey, secret: bytes) -> bool:
    """Whether the file holds a valid entry for `key`."""
    try:
        decode_block(path.read_bytes(), key, torch.float32, SHAPE, secret=secret)
    except CorruptEntry:
        return False
    return True


def _flip_payload(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))


def _flip_magic(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[0] ^= 0xFF
    path.write_bytes(bytes(raw))


def _truncate_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _truncate_one(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [_flip_payload, _flip_magic, _truncate_half, _truncate_one, _empty])
def test_damaged_file_is_a_counted_deleted_miss(tmp_path: Path, damage) -> None:
    store = DiskStore(tmp_path, LIMIT)
    assert store.put_block(KEYS[0], block(0))
    assert store.put_block(KEYS[1], block(1))
    before = set(entry_files(tmp_path))
    assert len(before) == 2
    # Find KEYS[0]'s file: the one that is not KEYS[1]'s.
    assert store.get_block(KEYS[1], torch.float32, SHAPE) is not None
    target = next(p for p in before if decodes_as(p, KEYS[0], store._key))
    damage(target)
    assert store.get_block(KEYS[0], torch.float32, SHAPE) is None
    assert store.num_corrupt == 1
    assert not target.exists()  # the entry is deleted, its file too
    assert store._cache is not None and name(KEYS[0]) not in store._cache
    assert store.has_block(KEYS[0]) is False
    assert store.get_block(KEYS[0], torch.float32, SHAPE) is None
    assert store.num_corrupt == 1  # the second look is an ordinary miss
    assert same_bits(store.get_block(KEYS[1], torch.float32, SHAPE), block(1))  # the neighbour is untouched
    assert store.num_io_errors == 0
    store.close()


def _other_hash(key: BlockKey) -> BlockKey:
    return KEYS[3]


def _other_parent(key: BlockKey) -> BlockKey:
    return BlockKey(key.hash, b"\x01" * 16, key.tokens)


def _other_tokens(key: BlockKey) -> BlockKey:
    return BlockKey(key.hash, key.parent, (*key.tokens[:-1], key.tokens[-1] + 1))


@pytest.mark.parametrize("forge", [_other_hash, _other_parent, _other_tokens])
def test_entry_of_another_key_is_a_miss(tmp_path: Path, forge) -> None:
    """A well-formed entry stored under KEYS[0]'s name whose header names another key, parent or tokens."""
    store = DiskStore(tmp_path, LIMIT)
    forged = forge(KEYS[0])
    assert forged != KEYS[0]
    assert store._cache is not None
    store._cache.set(name(KEYS[0]), encode_block(forged, block(0), secret=store._key))
    assert len(entry_files(tmp_path)) == 1
    assert store.get_block(KEYS[0], torch.float32, SHAPE) is None
    assert store.num_corrupt == 1
    assert name(KEYS[0]) not in store._cache
    assert entry_files(tmp_path) == []
    store.close()


@pytest.mark.parametrize(("dtype", "shape"), [(torch.bfloat16, SHAPE), (torch.float32, (1, 2, 2, 1, 4))])
def test_wrong_dtype_or_shape_asked_is_a_miss(tmp_path: Path, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    store = DiskStore(tmp_path, LIMIT)
    assert store.put_block(KEYS[0], block(0))
    assert store.get_block(KEYS[0], dtype, shape) is None
    assert store.num_corrupt == 1
    assert entry_files(tmp_path) == []
    assert store.has_block(KEYS[0]) is False
    store.close()


# The pickle trap: unpickling an instance of `Trap` calls `_spring`.
SPRUNG: list[str] = []


def _spring(tag: str) -> str:
    SPRUNG.append(tag)
    return tag


class Trap:
    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __reduce__(self):
        return (_spring, (self.tag,))


def test_planted_pickles_are_never_loaded(tmp_path: Path) -> None:
    """A pickled value under a `kv:` name and a pickled key, planted with a plain diskcache.Cache:
    the store reads the value as a corrupt miss and skips the key, never unpickling either."""
    SPRUNG.clear()
    assert pickle.loads(pickle.dumps(Trap("armed"))) == "armed" and SPRUNG == ["armed"]  # the trap works
    SPRUNG.clear()
    DiskStore(tmp_path, LIMIT).close()  # the folder as the engine leaves it
    with diskcache.Cache(str(tmp_path)) as plain:
        plain.set(name(KEYS[0]), Trap("value"))
        plain.set(Trap("key"), b"payload")
    store = DiskStore(tmp_path, LIMIT)
    assert SPRUNG == []  # opening lists the keys: the pickled one was not loaded
    assert store.has_block(KEYS[0]) is True  # a str key: discovered (a hint only)
    assert store.get_block(KEYS[0], torch.float32, SHAPE) is None
    assert SPRUNG == []
    assert store.num_corrupt == 1
    assert store.has_block(KEYS[0]) is False
    assert store.stats()["disk_blocks"] == 0
    store.close()
    # Control: a reader that does unpickle springs the trap on the planted key.
    with diskcache.Cache(str(tmp_path)) as plain:
        keys = list(plain.iterkeys())
    assert keys == ["key"] and SPRUNG == ["key"]


def test_io_error_trips_the_breaker_then_reopens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DiskStore(tmp_path, LIMIT, retry_s=RETRY_S)
    assert store.put_block(KEYS[0], block(0))

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    assert store._cache is not None
    monkeypatch.setattr(store._cache, "set", disk_full)
    assert store.put_block(KEYS[1], block(1)) is False
    assert store.available is False
    assert store.num_io_errors == 1
    assert "ENOSPC" in store.last_error or "No space" in store.last_error
    # While off: every call is a cheap miss, no retry storm, known keys are not advertised.
    assert store.put_block(KEYS[2], block(2)) is False
    assert store.get_block(KEYS[0], torch.float32, SHAPE) is None
    assert store.has_block(KEYS[0]) is False
    assert store.put_response("r", b"x") is False and store.get_response("r") is None
    stats = store.stats()
    assert (stats["disk_available"], stats["disk_bytes"], stats["disk_io_errors"]) == (False, 0, 1)
    time.sleep(RETRY_S + 0.05)
    assert store.available is True
    assert store.put_block(KEYS[1], block(1)) is True  # reopened: a fresh handle without the fault
    assert store.num_io_errors == 1
    assert same_bits(store.get_block(KEYS[0], torch.float32, SHAPE), block(0))  # written before the fault
    assert same_bits(store.get_block(KEYS[1], torch.float32, SHAPE), block(1))
    assert store.get_block(KEYS[2], torch.float32, SHAPE) is None  # refused while off: never written
    store.close()


def test_open_failure_trips_the_breaker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = diskcache.Cache

    def refuse(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise OSError(errno.EACCES, "Permission denied")
        return real(*args, **kwargs)

    monkeypatch.setattr(diskcache, "Cache", refuse)
    store = DiskStore(tmp_path, LIMIT, retry_s=RETRY_S)
    assert (store.available, store.num_io_errors) == (False, 1)
    assert store.put_block(KEYS[0], block(0)) is False
    assert len(calls) == 1  # no reopen attempt before retry_s
    time.sleep(RETRY_S + 0.05)
    assert store.put_block(KEYS[0], block(0)) is True
    assert len(calls) == 2 and store.num_io_errors == 1
    store.close()


def test_folder_deleted_mid_use_never_raises(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    store = DiskStore(folder, LIMIT, retry_s=RETRY_S)
    assert store.put_block(KEYS[0], block(0))
    shutil.rmtree(folder)
    assert store.put_block(KEYS[1], block(1)) in (True, False)
    assert store.get_block(KEYS[0], torch.float32, SHAPE) is None  # its file is gone
    assert store.has_block(KEYS[0]) is False
    store.get_block(KEYS[1], torch.float32, SHAPE)
    assert store.put_response("r", b"x") in (True, False)
    store.get_response("r")
    time.sleep(RETRY_S + 0.05)
    assert store.put_block(KEYS[2], block(2)) is True
    assert same_bits(store.get_block(KEYS[2], torch.float32, SHAPE), block(2))
    assert folder.is_dir()
    store.close()


def test_folder_deleted_mid_use_recovers_in_the_recreated_folder(tmp_path: Path) -> None:
    """After the folder is deleted and `retry_s` has passed, new entries land in a real database in the
    recreated folder: a later DiskStore (the next engine run) finds them."""
    folder = tmp_path / "cache"
    store = DiskStore(folder, LIMIT, retry_s=RETRY_S)
    assert store.put_block(KEYS[0], block(0))
    shutil.rmtree(folder)
    assert store.put_block(KEYS[1], block(1)) is False  # noticed: the tier turns off
    assert store.num_io_errors == 1 and not store.available
    store.get_block(KEYS[0], torch.float32, SHAPE)
    time.sleep(RETRY_S + 0.05)
    assert store.put_block(KEYS[2], block(2)) is True
    store.close()
    assert (folder / "cache.db").is_file()
    again = DiskStore(folder, LIMIT)
    assert again.has_block(KEYS[2]) is True
    assert same_bits(again.get_block(KEYS[2], torch.float32, SHAPE), block(2))
    again.close()


def test_response_round_trip(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, LIMIT)
    payload = bytes(range(256)) * 3
    assert store.put_response("abc", payload) is True
    assert store.get_response("abc") == payload
    assert store.get_response("missing") is None
    # A response stored under a block's hex is not a block.
    assert store.put_response(KEYS[0].hex, b"not a block") is True
    assert store.has_block(KEYS[0]) is False
    assert store.get_block(KEYS[0], torch.float32, SHAPE) is None and store.num_corrupt == 0
    with pytest.raises(TypeError):
        store.put_response("text", "not bytes")  # type: ignore[arg-type]
    store.close()
    store = DiskStore(tmp_path, LIMIT)
    assert store.get_response("abc") == payload  # persists
    assert store.has_block(KEYS[0]) is False
    store.delete_response("abc")
    assert store.get_response("abc") is None
    assert store.get_response(KEYS[0].hex) == b"not a block"
    store.close()


def test_has_block_tracks_writes_and_survives_reopening(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, LIMIT)
    assert [store.has_block(k) for k in KEYS] == [False] * 4
    assert store.put_block(KEYS[0], block(0)) and store.put_block(KEYS[2], block(2))
    assert [store.has_block(k) for k in KEYS] == [True, False, True, False]
    store.close()
    reopened = DiskStore(tmp_path, LIMIT)
    assert [reopened.has_block(k) for k in KEYS] == [True, False, True, False]
    assert reopened.stats()["disk_blocks"] == 2
    assert same_bits(reopened.get_block(KEYS[2], torch.float32, SHAPE), block(2))
    # An entry deleted behind the store's back: has_block is only a hint, the read corrects it.
    assert reopened._cache is not None and reopened._cache.delete(name(KEYS[0]))
    assert reopened.has_block(KEYS[0]) is True
    assert reopened.get_block(KEYS[0], torch.float32, SHAPE) is None
    assert reopened.has_block(KEYS[0]) is False
    assert reopened.num_corrupt == 0
    reopened.close()


# -- secrets ------------------------------------------------------------------------------
def test_folder_secret_is_created_once_private_and_agreed_on(tmp_path: Path) -> None:
    results: list[bytes] = []
    barrier = threading.Barrier(8)

    def open_one() -> None:
        barrier.wait()
        results.append(folder_secret(tmp_path))

    threads = [threading.Thread(target=open_one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results[0]) == 64  # every engine starting at once agrees
    assert (tmp_path / "secret").stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret"]  # no temporary file left behind
    assert folder_secret(tmp_path) == results[0]
    assert DiskStore(tmp_path, LIMIT)._key == mac_key(results[0])


def test_entries_of_another_secret_are_counted_deleted_misses(tmp_path: Path) -> None:
    """Another deployment's folder (or one planted by someone without the secret) serves nothing."""
    theirs = DiskStore(tmp_path, LIMIT, secret="theirs")
    assert theirs.put_block(KEYS[0], block(0)) and theirs.put_response("r", b"their answer")
    theirs.close()
    ours = DiskStore(tmp_path, LIMIT)  # the folder's own random secret
    assert ours.has_block(KEYS[0])  # a hint only
    assert ours.get_block(KEYS[0], torch.float32, SHAPE) is None
    assert ours.get_response("r") is None
    assert ours.num_corrupt == 2 and entry_files(tmp_path) == []
    assert ours.put_block(KEYS[0], block(0))
    ours.close()
    again = DiskStore(tmp_path, LIMIT)  # the same folder secret next time: a hit
    assert same_bits(again.get_block(KEYS[0], torch.float32, SHAPE), block(0))
    again.close()


def test_damaged_secret_file_turns_the_tier_off(tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(b"not hex")
    store = DiskStore(tmp_path, LIMIT)
    assert store.available is False and "secret" in store.last_error


# -- culling, expiry ------------------------------------------------------------------------
def test_index_forgets_blocks_culled_by_the_size_limit(tmp_path: Path) -> None:
    shape = (2, 2, 16, 2, 64)  # 32 KiB a block
    keys = block_keys(list(range(16 * 80)), 16, b"\x05" * 16)
    store = DiskStore(tmp_path, 40 * (33 << 10))  # room for about 40 blocks (diskcache culls 16 at a time)
    for key in keys:
        assert store.put_block(key, torch.ones(shape))
        on_disk = {k[3:] for k in store._cache.iterkeys() if k.startswith("kv:")}
        assert {k.hex for k in keys if store.has_block(k)} == on_disk  # in step after every write
        assert store.stats()["disk_blocks"] == len(on_disk)
    assert 0 < len(on_disk) < 60
    store.close()


def test_responses_expire(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, LIMIT)
    assert store.put_response("short", b"x", expire_s=0.2) and store.put_response("long", b"y", expire_s=60)
    assert store.get_response("short") == b"x"
    time.sleep(0.3)
    assert store.get_response("short") is None and store.get_response("long") == b"y"
    assert store.num_corrupt == 0
    store.close()
