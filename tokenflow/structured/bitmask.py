"""Token masks of a step's constrained rows: filled on a worker thread while the model step runs, applied
to the logits before sampling.

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

__all__ = ("MaskFiller", "StepMasks", "apply_bitmask")


class StepMasks:
    """The masks of one step: `words[j]` is row `rows[j]`'s; `errors` maps a row to why its matcher
    cannot go on (it accepted a token it should not have)."""

    __slots__ = ("errors", "rows", "words")

    def __init__(self, rows: list[int], words: torch.Tensor, errors: dict[int, str]) -> None:
        self.rows = rows
        self.words = words
        self.errors = errors


def _fill(matchers: Sequence[tuple[int, LLMatcher]], vocab_size: int) -> StepMasks:
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
        return self._pool.submit(_fill, list(matchers), self.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def apply_bitmask(logits: torch.Tensor, rows: list[int], words: torch.Tensor) -> None:
    """Set the disallowed tokens of `logits[rows]` to -inf, in place (`logits` is `[n, vocab]` fp32 on CPU).
    numpy's unpackbits and masked copy: a third of the time of torch's bit shifts and masked_fill."""
    vocab = logits.shape[1]
    allowed = np.unpackbits(words.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab].view(bool)
    if allowed.shape[1] < vocab:  # columns past the mask's vocabulary are never allowed
        allowed = np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])), constant_values=False)
    if rows == list(range(logits.shape[0])):
        np.copyto(logits.numpy(), -np.inf, where=~allowed)
        return
    index = torch.tensor(rows)
    sub = logits[index].numpy()
    np.copyto(sub, -np.inf, where=~allowed)
    logits[index] = torch.from_numpy(sub)
