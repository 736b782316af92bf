"""KVCache: geometry, sizing and block import/export."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from tokenflow.kv.kv_cache import KVCache


def test_geometry_and_bytes() -> None:
    cfg = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3)
    assert KVCache.geometry(cfg) == (30, 3, 64)
    # SmolLM2-135M: 2 (K, V) * 30 layers * 16 slots * 3 heads * 64 dims * 4 bytes
    assert KVCache.bytes_per_block(cfg, 16, torch.float32) == 2 * 30 * 16 * 3 * 64 * 4
    assert KVCache.bytes_per_block(cfg, 16, torch.bfloat16) == 2 * 30 * 16 * 3 * 64 * 2
    qwen3 = Qwen3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32
    )
    assert KVCache.geometry(qwen3) == (2, 2, 32)  # explicit head_dim wins over hidden / heads
    mha = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=None)
    assert KVCache.geometry(mha) == (1, 4, 16)


def test_layout_and_views() -> None:
    cache = KVCache(
        num_layers=2,
        num_kv_heads=3,
        head_dim=8,
        num_blocks=5,
        block_size=4,
        dtype=torch.bfloat16,
        device="cpu",
    )
    assert cache.k[0].shape == (5, 4, 3, 8) and cache.k[0].dtype == torch.bfloat16
    assert not cache.k[1].any()  # zeroed: masked padding must read finite values
    cache.k_slots[1][4 * 2 + 3] = 1.0  # slot = block * block_size + offset
    assert cache.k[1][2, 3].eq(1).all() and cache.k[1].sum() == 24
    assert cache.nbytes == 2 * 2 * 5 * 4 * 3 * 8 * 2
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    other = KVCache.for_model(cfg, num_blocks=3, block_size=2, dtype=torch.float32)
    assert other.nbytes == 3 * KVCache.bytes_per_block(cfg, 2, torch.float32)


def test_read_write_block_round_trip() -> None:
    cache = KVCache(
        num_layers=3,
        num_kv_heads=2,
        head_dim=4,
        num_blocks=4,
        block_size=2,
        dtype=torch.float32,
        device="cpu",
    )
    for layer in range(3):
        cache.k[layer].normal_()
        cache.v[layer].normal_()
    data = cache.read_block(1)
    assert data.shape == (3, 2, 2, 2, 4)
    assert torch.equal(data[2, 1], cache.v[2][1])
    cache.write_block(3, data)
    for layer in range(3):
        assert torch.equal(cache.k[layer][3], cache.k[layer][1])
        assert torch.equal(cache.v[layer][3], cache.v[layer][1])
    with pytest.raises(ValueError):
        cache.write_block(0, data[:2])


def test_bad_geometry() -> None:
    with pytest.raises(ValueError):
        KVCache(
            num_layers=1,
            num_kv_heads=1,
            head_dim=4,
            num_blocks=0,
            block_size=2,
            dtype=torch.float32,
            device="cpu",
        )


def test_truncate_keeps_the_first_blocks_and_their_contents() -> None:
    cache = KVCache(num_layers=2, num_kv_heads=2, head_dim=4, num_blocks=6, block_size=4, dtype=torch.float32,
                    device="cpu", track_key_bounds=True)
    for block in range(6):
        cache.write_block(block, torch.full((2, 2, 4, 2, 4), float(block)))
    kept = [cache.read_block(b) for b in range(4)]
    cache.truncate(4)
    assert cache.num_blocks == 4 and cache.version == 1
    assert all(t.shape[0] == 4 for t in (*cache.k, *cache.v, *cache.k_min, *cache.k_max))
    assert cache.nbytes == 2 * 2 * 4 * 4 * 2 * 4 * 4  # K and V, 2 layers, 4 blocks of 4 x 2 x 4 floats
    assert all(torch.equal(cache.read_block(b), kept[b]) for b in range(4))
    cache.k_slots[1][15].fill_(-1.0)  # the slot views are views of the new tensors
    assert cache.k[1][3, 3].eq(-1.0).all()
    with pytest.raises(ValueError):
        cache.truncate(5)


def _int8_cache(**kw) -> KVCache:
    return KVCache(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=6, block_size=4, dtype=torch.bfloat16,
                   device="cpu", int8=True, **kw)


def test_int8_cache_writes_codes_and_scales_and_gathers_close_values() -> None:
    cache = _int8_cache()
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(5, 2, 8, generator=g) * torch.tensor([0.1, 30.0])[None, :, None]).bfloat16()  # heads differ
    v = torch.randn(5, 2, 8, generator=g).bfloat16()
    slots = torch.tensor([3, 4, 9, 10, 23])
    cache.write(1, slots, k, v)
    assert cache.k[1].dtype == torch.int8 and cache.k_scale[1].dtype == torch.float32
    got_k, got_v = cache.gather(1, torch.tensor([0, 1, 2, 5]))  # slot s = block * 4 + offset
    assert got_k.dtype == torch.bfloat16 and got_k.shape == (4, 4, 2, 8)
    rows_k = got_k.reshape(16, 2, 8)[[3, 4, 9, 10, 15]].float()
    step = k.float().abs().amax(-1, keepdim=True) / 127  # one int8 step of each token and head
    assert ((rows_k - k.float()).abs() <= step * 0.51 + 0.01 * k.float().abs()).all()  # half a step, bf16 rounding
    assert got_v.reshape(16, 2, 8)[0].eq(0).all()  # untouched slots dequantise to zeros


def test_int8_blocks_round_trip_through_the_tier_format() -> None:
    cache = _int8_cache()
    cache.write(0, torch.arange(8), torch.randn(8, 2, 8).bfloat16(), torch.randn(8, 2, 8).bfloat16())
    cache.write(1, torch.arange(8), torch.randn(8, 2, 8).bfloat16(), torch.randn(8, 2, 8).bfloat16())
    data = cache.read_block(1)
    assert data.dtype == torch.int8 and tuple(data.shape) == cache.block_shape == (2, 2, 4, 2, 12)
    assert cache.block_is_finite(data)
    other = _int8_cache()
    other.write_block(3, data)
    for layer in range(2):
        assert torch.equal(other.k[layer][3], cache.k[layer][1])
        assert torch.equal(other.v_scale[layer][3], cache.v_scale[layer][1])
    broken = data.clone()
    broken[0, 1, 2, 1, 8:] = torch.tensor([float("nan")]).view(torch.int8)  # a scale's bytes
    assert not cache.block_is_finite(broken)
    with pytest.raises(ValueError):
        other.write_block(0, data.float())


def test_int8_blocks_take_about_half_the_bytes() -> None:
    cfg = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3)
    bf16 = KVCache.bytes_per_block(cfg, 16, torch.bfloat16)
    int8 = KVCache.bytes_per_block(cfg, 16, torch.bfloat16, int8=True)
    assert int8 == 2 * 30 * 16 * 3 * (64 + 4) and bf16 / int8 >= 1.8
    cache = _int8_cache()
    assert cache.nbytes == 2 * 2 * 6 * 4 * 2 * (8 + 4)
    cache.truncate(3)
    assert cache.nbytes == 2 * 2 * 3 * 4 * 2 * (8 + 4) and cache.k_scale_slots[0].shape == (12, 2)


@pytest.mark.parametrize(("int8", "bounds"), [(False, False), (True, False), (False, True)])
def test_copy_rows_copies_the_first_rows_of_every_layer(int8: bool, bounds: bool) -> None:
    """A partial prefix hit: rows [0, n) of one block into another, K and V of every layer (int8: the scales;
    topk: the destination's key bounds become those of the copied rows, whatever it held before)."""
    cache = KVCache(num_layers=2, num_kv_heads=2, head_dim=4, num_blocks=4, block_size=4, dtype=torch.float32,
                    device="cpu", int8=int8, track_key_bounds=bounds)
    torch.manual_seed(0)
    for layer in range(2):
        k, v = torch.randn(16, 2, 4), torch.randn(16, 2, 4)
        cache.write(layer, torch.arange(16), k, v)
        if bounds:  # stale bounds of the destination's previous contents
            cache.k_min[layer][3] = -100.0
            cache.k_max[layer][3] = 100.0
    before = cache.read_block(3)
    cache.copy_rows(1, 3, 3)
    after, source = cache.read_block(3), cache.read_block(1)
    assert torch.equal(after[:, :, :3], source[:, :, :3])  # int8: codes and the 4 bytes of their scale
    assert torch.equal(after[:, :, 3:], before[:, :, 3:])  # the rest is the request's to compute
    if bounds:
        for layer in range(2):
            keys = cache.gather(layer, torch.tensor([3]))[0][0, :3]
            assert torch.equal(cache.k_min[layer][3], keys.amin(0))
            assert torch.equal(cache.k_max[layer][3], keys.amax(0))
    with pytest.raises(ValueError, match="cannot copy"):
        cache.copy_rows(1, 3, 5)
