"""Token masks of a step's constrained rows: filled on a worker thread while the model step runs, applied
to the logits before sampling, or filled only for the rows whose unconstrained sample the grammar refuses.

A mask is llguidance's packed form: 32 tokens per int32 word, bit `t % 32` of word `t // 32` set when
token `t` is allowed. The fill runs in llguidance's Rust code without the GIL, so it overlaps the
forward pass instead of adding to the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from tokenflow.params import SamplingParams

__all__ = ("MaskFiller", "StepMasks", "apply_bitmask", "fill_masks", "masked_first")


class StepMasks:
    """The masks of one step: `words[j]` is row `rows[j]`'s; `errors` maps a row to why its matcher
    cannot go on (it accepted a token it should not have)."""

    __slots__ = ("errors", "rows", "words")

    def __init__(self, rows: list[int], words: torch.Tensor, errors: dict[int, str]) -> None:
        self.rows = rows
        self.words = words
        self.errors = errors


def masked_first(params: SamplingParams) -> bool:
    """Whether a constrained row needs its mask before sampling. Otherwise it is sampled unconstrained and
    masked only if the grammar refuses the token: a draw from p kept when in the allowed set A, else a draw
    from p masked to A, is exactly a draw from p masked to A (and greedy's argmax, when allowed, is the
    masked argmax). Not so for logprobs (reported from the masked distribution) or for top-k, top-p and
    min-p, which would cut p before the mask instead of after it."""
    return params.logprobs is not None or params.top_p < 1.0 or params.top_k > 0 or params.min_p > 0.0


def fill_masks(matchers: Sequence[tuple[int, LLMatcher]], vocab_size: int) -> StepMasks:
    """The masks of `(row, matcher)` pairs, on this thread."""
    words = torch.zeros(len(matchers), (vocab_size + 31) // 32, dtype=torch.int32)
    errors: dict[int, str] = {}
    for j, (row, matcher) in enumerate(matchers):
        if matcher.is_error():
            errors[row] = matcher.get_error()
            continue
        target = words[j]
        matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
    return StepMasks([row for row, _ in matchers], words, errors)


class MaskFiller:
    """One worker thread that fills a step's masks; the step loop starts it before the forward pass and
    collects it after."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenflow-masks")

    def start(self, matchers: Sequence[tuple[int, LLMatcher]]) -> Future[StepMasks] | None:
        """Begin filling the masks of `(row, matcher)` pairs; None when the step has none."""
        if not matchers:
            return None
        return self._pool.submit(fill_masks, list(matchers), self.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_NEG_INF_BITS = np.array(-np.inf, dtype=np.float32).view(np.int32)


def apply_bitmask(logits: torch.Tensor, rows: list[int], words: torch.Tensor) -> None:
    """Set the disallowed tokens of `logits[rows]` to -inf, in place (`logits` is `[n, vocab]` fp32 on CPU).
    Branchless on the float bits (keep the allowed ones, OR in -inf's for the rest): a masked copy branches
    per element and costs ten times as much on a mask whose allowed tokens are scattered."""
    vocab = logits.shape[1]
    allowed = np.unpackbits(words.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    if allowed.shape[1] < vocab:  # columns past the mask's vocabulary are never allowed
        allowed = np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])), constant_values=0)
    keep = allowed.astype(np.int32)
    np.negative(keep, out=keep)  # all ones where allowed, zeros elsewhere
    whole = rows == list(range(logits.shape[0]))
    index = None if whole else torch.tensor(rows)
    sub = logits.numpy() if whole else logits[index].numpy()
    bits = sub.view(np.int32)
    bits &= keep
    np.invert(keep, out=keep)
    keep &= _NEG_INF_BITS
    bits |= keep
    if index is not None:
        logits[index] = torch.from_numpy(sub)
