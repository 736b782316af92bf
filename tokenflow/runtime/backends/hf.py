"""The `hf` backend: plain `transformers` `generate` on a bucketed, padded batch.

It works for any causal LM and is the baseline the `paged` backend is
compared with. The batch runs to completion (the longest request decides
its length). The model worker's sampler (the one every backend's tokens come
from) runs inside a `LogitsProcessor`: it picks each row's token with that
row's parameters and seeded generator, then leaves only that token finite, so
greedy `generate` takes it. A per-row
stopping criterion ends rows that finished or were aborted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from tokenflow.config import EngineConfig
from tokenflow.protocols import EngineContext
from tokenflow.request import Request
from tokenflow.runtime.sampler import RowFailure, Sampler, row_of

__all__ = ("HFBackend", "create")

# on_tokens(list of (request, token_id, logprob), list of (request, why it drew no token)) -> None;
# called from the worker thread.
TokenSink = Callable[[list[tuple[Request, int, Any]], list[tuple[Request, RowFailure]]], None]


class _SampleWithTokenflow:
    """LogitsProcessor: sample every live row with tokenflow's sampler, report, force the choice."""

    def __init__(self, sampler: Sampler, requests: Sequence[Request], on_tokens: TokenSink) -> None:
        self.sampler = sampler
        self.requests = requests
        self.on_tokens = on_tokens

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        live = [i for i, r in enumerate(self.requests) if not r.finished]
        forced = torch.full_like(scores, float("-inf"))
        if not live:
            forced[:, 0] = 0.0
            return forced
        rows = [row_of(self.requests[i]) for i in live]
        out = self.sampler.sample(scores[live], rows)
        report, failed = [], []
        for j, i in enumerate(live):
            if j in out.failed:  # its request fails alone (on_tokens marks it finished); the row idles
                forced[i, 0] = 0.0
                failed.append((self.requests[i], out.failed[j]))
                continue
            forced[i, out.token_ids[j]] = 0.0
            logprob = out.logprobs[j] if out.logprobs is not None else None
            report.append((self.requests[i], out.token_ids[j], logprob))
        dead = [i for i, r in enumerate(self.requests) if r.finished]
        forced[dead, 0] = 0.0
        self.on_tokens(report, failed)
        return forced


class _StopFinishedRows:
    """StoppingCriteria: a row is done once tokenflow marked its request finished."""

    def __init__(self, requests: Sequence[Request]) -> None:
        self.requests = requests

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return torch.tensor([r.finished for r in self.requests], dtype=torch.bool, device=input_ids.device)


class HFBackend:
    static = True

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model: Any = None
        self.pad_id = 0
        self.num_batches = 0
        self.num_padded_tokens = 0
        self.num_prompt_tokens = 0

    def load(self, ctx: EngineContext, model: Any) -> None:
        self.model = model
        tok = ctx.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(ctx.eos_token_ids), 0)
        self.pad_id = int(pad)
        self.max_model_len = ctx.max_model_len

    def run_batch(self, requests: Sequence[Request], sampler: Sampler, on_tokens: TokenSink) -> None:
        """Blocking: generate for `requests` until every row finished, each token drawn by `sampler`."""
        device = self.model.device
        longest = max(r.num_tokens for r in requests)
        ids = torch.full((len(requests), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), longest), dtype=torch.long)
        for i, r in enumerate(requests):  # left padding
            tokens = r.all_token_ids
            ids[i, longest - len(tokens):] = torch.tensor(tokens)
            mask[i, longest - len(tokens):] = 1
        budget = max(min(r.max_tokens - len(r.output_token_ids), self.max_model_len - longest)
                     for r in requests)
        self.num_batches += 1
        self.num_prompt_tokens += sum(r.num_tokens for r in requests)
        self.num_padded_tokens += ids.numel()
        gen_config = GenerationConfig(
            max_new_tokens=max(budget, 1), do_sample=False, pad_token_id=self.pad_id, eos_token_id=None
        )
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                generation_config=gen_config,
                logits_processor=LogitsProcessorList([_SampleWithTokenflow(sampler, requests, on_tokens)]),
                stopping_criteria=StoppingCriteriaList([_StopFinishedRows(requests)]),
            )

    def stats(self) -> dict[str, Any]:
        padded = self.num_padded_tokens
        return {
            "hf_batches": self.num_batches,
            "hf_padding_ratio": round(1 - self.num_prompt_tokens / padded, 3) if padded else 0.0,
        }


def create(config: EngineConfig) -> HFBackend:
    return HFBackend(config)
