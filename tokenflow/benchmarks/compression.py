"""kv_compression's quality measurements, for `tokenflow bench-quality`.

* Continuation perplexity: a window's first `prefix` tokens are prefilled (and compressed at a ratio,
  as the engine does after a prompt), then each of the next `scored` tokens is fed as a decode step and
  scored. Prompt perplexity (`prompt_logprobs`) cannot show compression: every prompt token is scored
  during the prefill, before the prompt is compressed.
* Retrieval: a pass key planted at evenly spread depths of a long filler document, asked at the end
  (the answer's first digit comes from the prefill's own logits, the rest after compression); the hit
  rate at each document length, dense and compressed, through the engine.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

__all__ = ("continuation_perplexity", "passkey_hit_rate")

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
WINDOW, SINKS = 32, 4  # as kv_compression_window and sink_tokens default


def continuation_perplexity(model: Any, windows: list[list[int]], prefix: int, ratio: float | None) -> float:
    """exp(mean NLL) of each window's tokens after `prefix`, decoded over its (compressed) prefix."""
    from tokenflow.kv.kv_cache import KVCache
    from tokenflow.runtime.paged_runner import PagedModelRunner, SeqChunk

    param = next(model.parameters())
    longest = max(len(w) for w in windows)
    bs = 16
    kv = KVCache.for_model(model.config, num_blocks=2 * (-(-longest // bs)) + 2, block_size=bs, dtype=param.dtype)
    runner = PagedModelRunner(model, kv, self_check=False)
    nll, count = 0.0, 0
    for ids in windows:
        table = list(range(-(-len(ids) // bs)))
        for start in range(0, prefix, 512):
            runner.execute([SeqChunk(ids[start:min(start + 512, prefix)], start, table, False)])
        kept = prefix
        if ratio is not None:
            kept = max(math.ceil(prefix / ratio), SINKS + WINDOW + 1)
            compact = list(range(len(table), len(table) + -(-(kept + len(ids) - prefix) // bs)))
            runner.compress(SeqChunk(ids[prefix - WINDOW:prefix], prefix - WINDOW, table, False), compact, kept, SINKS)
            table = compact
        offset = prefix - kept
        for pos in range(prefix, len(ids) - 1):
            logits = runner.execute([SeqChunk([ids[pos]], pos - offset, table, True, 1, offset)])
            nll -= torch.log_softmax(logits[0], -1)[ids[pos + 1]].item()
            count += 1
    return math.exp(nll / count)


def _passkey_prompt(tokenizer: Any, rng: random.Random, tokens: int, depth: float) -> tuple[list[int], int]:
    key = rng.randint(10000, 99999)
    repeats = max(1, tokens // 24)  # ~24 tokens a filler sentence group
    parts = [FILLER] * repeats
    parts.insert(int(depth * repeats), f"The pass key is {key}. Remember it. {key} is the pass key. ")
    text = "There is important info hidden inside a lot of irrelevant text. Find it and memorize it.\n" + "".join(parts)
    chat = [{"role": "user", "content": text + "\nWhat is the pass key?"}]
    prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + "The pass key is"
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"]), key


async def passkey_hit_rate(model: str | None, settings: dict[str, Any], tokens: int, trials: int) -> dict[str, Any]:
    """Hits of `trials` pass keys at depths (i + 0.5) / trials in ~`tokens`-token documents."""
    from tokenflow import Engine

    rng = random.Random(tokens)
    hits = 0
    async with Engine(model, prefix_caching=False, **settings) as engine:
        tokenizer = engine.loaded.tokenizer
        length = 0
        for i in range(trials):
            ids, key = _passkey_prompt(tokenizer, rng, tokens, (i + 0.5) / trials)
            length = len(ids)
            done = await engine.generate(ids, max_tokens=8, temperature=0.0)
            hits += str(key) in done.text
        compressed = engine.stats().get("kv_compressed_requests", 0)
    return {"hits": hits, "trials": trials, "prompt_tokens": length, "compressed": compressed}
