"""Pieces of paged attention that the CUDA path uses, checked on the CPU against torch's own SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenflow.runtime.attention.layer import masked_gqa_attention


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 2), (8, 1)])
def test_masked_gqa_attention_equals_sdpa_with_gqa(heads: int, kv_heads: int) -> None:
    g = torch.Generator().manual_seed(0)
    t, start, d = 7, 5, 16
    q = torch.randn(1, heads, t, d, generator=g)
    k = torch.randn(1, kv_heads, start + t, d, generator=g)
    v = torch.randn(1, kv_heads, start + t, d, generator=g)
    mask = torch.full((t, start + t), float("-inf")).triu_(start + 1)  # row i sees keys <= start + i
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)[0].transpose(0, 1)
    got = masked_gqa_attention(q, k, v, mask, 0.25)
    assert got.shape == (t, heads, d)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

