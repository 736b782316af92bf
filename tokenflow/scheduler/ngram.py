"""Prompt-lookup (n-gram) speculative decoding for greedy requests.

Greedy decoding often repeats text already in its context: words of the prompt, names, its own
phrases. Each step the batcher looks for the context's last few tokens earlier in the context and
proposes the tokens that followed them there as a draft. The model then computes the next token and
the draft's positions in one forward (a short chunk whose logits are all kept), and the step keeps
the longest draft prefix that greedy decoding itself produces, plus the model's token after it. The
output is what plain greedy decoding gives, up to near ties that a differently batched forward can
flip (as with any change of batch shape).

It pays where a forward over a few rows costs little more than over one: small decode batches, where
reading the weights dominates. At larger batches the extra rows cost real compute, hence
`speculative_max_seqs`.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenflow.params import SamplingParams
from tokenflow.runtime.sampler import has_penalty

__all__ = ("MAX_NGRAM", "accepted_tokens", "can_speculate", "propose_draft")

MAX_NGRAM = 4  # longest context suffix looked up; shorter ones are tried down to a single token


def can_speculate(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether verifying a draft by argmax gives exactly this request's next tokens: greedy, and no
    logit adjustment that depends on the tokens before (penalties, a min_tokens EOS mask)."""
    return (
        params.greedy
        and params.logprobs is None
        and params.prompt_logprobs is None  # a draft chunk keeps only its sampled rows
        and not has_penalty(params)
        and num_output_tokens >= params.min_tokens
        and not params.logit_bias
    )


def propose_draft(tokens: list[int], max_draft: int) -> list[int]:
    """Up to `max_draft` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` (MAX_NGRAM tokens down to one) found earlier in `tokens`; [] when none recurs."""
    length = len(tokens)
    if max_draft <= 0 or length < 2:
        return []
    last = tokens[-1]
    # End positions of earlier occurrences of the last token, latest first.
    ends = [i for i in range(length - 2, -1, -1) if tokens[i] == last]
    for n in range(min(MAX_NGRAM, length - 1), 0, -1):
        suffix = tokens[length - n:]
        for end in ends:
            if end + 1 >= n and tokens[end + 1 - n:end + 1] == suffix:
                return tokens[end + 1:end + 1 + max_draft]
    return []


def accepted_tokens(first: int, draft: Sequence[int], next_argmax: Sequence[int]) -> list[int]:
    """The tokens a verified step emits: `first` (sampled after the last known token), then while the
    previous emitted token equals the draft's token at that place, the argmax after it.

    `next_argmax[i]` is the argmax of the logits at draft position i (the token after `draft[i]`)."""
    out = [first]
    for proposed, following in zip(draft, next_argmax):
        if out[-1] != proposed:
            break
        out.append(following)
    return out
