"""Attention over the paged KV cache: the dense function, its matmul form, and the sliding and top-k policies."""
