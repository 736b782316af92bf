"""Speculative drafts of constrained greedy requests, verified under the grammar.

A drafted chunk's logits give the raw argmax after each draft token; the scheduler accepts draft tokens
while they equal the token emitted before them. Under a grammar the token to emit is the masked argmax,
which is the raw argmax whenever the grammar allows it. So the accepted chain is validated against the
matcher (without consuming), and only at the first refused position is a mask filled and the argmax
taken again; the chain may then go on (the new token can equal the draft's), so this repeats until the
whole chain is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tokenflow.scheduler.ngram import accepted_tokens
from tokenflow.structured.bitmask import apply_bitmask

if TYPE_CHECKING:
    from llguidance import LLMatcher

__all__ = ("masked_draft_argmax", "valid_draft")


def valid_draft(matcher: LLMatcher, draft: list[int]) -> list[int]:
    """The longest prefix of `draft` the grammar allows from its current state (no forward spent on the rest)."""
    return draft[: matcher.validate_tokens(draft)] if draft else draft


def masked_draft_argmax(matcher: LLMatcher, first: int, draft: Sequence[int], next_argmax: list[int],
                        draft_logits: torch.Tensor, vocab_size: int) -> tuple[list[int], int]:
    """`next_argmax` (the raw argmax after each draft token) with every position the accepted chain reaches
    and the grammar refuses replaced by the masked argmax there; and how many were replaced. `first` is
    the token sampled (under the grammar) after the last known token."""
    argmax = list(next_argmax)
    repaired = 0
    words = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    while True:
        chain = accepted_tokens(first, draft, argmax)
        valid = matcher.validate_tokens(chain)
        if valid >= len(chain) or valid == 0:  # all allowed (or `first` itself refused: its row fails elsewhere)
            return argmax, repaired
        # chain[valid] = argmax[valid - 1], predicted at draft position valid - 1, is refused
        consumed = matcher.try_consume_tokens(chain[:valid])
        try:
            words.zero_()
            matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
        finally:
            matcher.rollback(consumed)
        row = draft_logits[valid - 1 : valid, :vocab_size].float()
        apply_bitmask(row, [0], words)
        argmax[valid - 1] = int(row.argmax(-1))
        repaired += 1
