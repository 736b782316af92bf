"""`tokenflow bench-attention`: what the attention policies cost and save.

* Perplexity of a long real English text (default: the GPL-3 text from
  /usr/share/common-licenses, ~8k tokens) under dense, sliding (W = 512 and
  1,024 with 4 sink tokens) and top-k (budgets 256, 512, 1,024 tokens)
  attention, through the paged runner: every position scored while the text
  is fed in 512-token chunks, as the engine prefills (top-k acts on decodes
  only, so it is dense there), and the last 512 tokens scored one decode
  step each after prefilling the rest.
* Decode step time against context length (1k, 2k, 4k, 8k tokens) for each
  policy, one sequence and a batch of 8 (the KV contents do not change the
  time, so contexts are filled with blocks as they are, not prefilled).
* KV blocks in use against generated length, dense and sliding, from an
  engine generating past 8,192 tokens on a tiny random-weight model with the
  default model's 8,192 trained positions (block counts do not depend on
  weights; a real model would take an hour on this CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch

__all__ = ("add_arguments", "perplexity", "run_bench_attention")

POLICIES: tuple[tuple[str, dict[str, int]], ...] = (
    ("dense", {}),
    ("sliding W=512", {"window": 512}),
    ("sliding W=1024", {"window": 1024}),
    ("topk 256", {"topk_budget": 256}),
    ("topk 512", {"topk_budget": 512}),
    ("topk 1024", {"topk_budget": 1024}),
)


def _runner(model: Any, policy: dict[str, int], num_blocks: int, sinks: int = 4) -> Any:
    from tokenflow.kv.kv_cache import KVCache
    from tokenflow.runtime.paged_runner import PagedModelRunner

    param = next(model.parameters())
    layers, kv_heads, head_dim = KVCache.geometry(model.config)
    kv = KVCache(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, num_blocks=num_blocks, block_size=16,
                 dtype=param.dtype, device=param.device, track_key_bounds="topk_budget" in policy)
    return PagedModelRunner(model, kv, sinks=sinks, self_check=False, **policy)


def perplexity(runner: Any, token_ids: list[int], chunk: int = 512) -> float:
    """exp(mean negative log-likelihood) of `token_ids`, every position scored, fed `chunk` tokens a step."""
    from tokenflow.runtime.paged_runner import SeqChunk

    bs = runner.block_size
    table = list(range(-(-len(token_ids) // bs)))
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, chunk):
        piece = token_ids[start:start + chunk]
        step = runner.prepare([SeqChunk(piece, start, table, True)], runner.kv_cache)
        step.logits_to_keep = torch.arange(len(piece))
        logits = runner._forward(step)  # [len(piece), vocab]
        targets = torch.tensor(token_ids[start + 1:start + 1 + len(piece)])
        logits = logits[: len(targets)]
        nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        count += len(targets)
    return math.exp(nll / count)


def decode_perplexity(runner: Any, token_ids: list[int], scored: int = 512, chunk: int = 512) -> float:
    """Perplexity of the last `scored` tokens, each predicted by a decode step (where top-k acts), after
    prefilling the rest in `chunk`-token steps."""
    from tokenflow.runtime.paged_runner import SeqChunk

    table = list(range(-(-len(token_ids) // runner.block_size)))
    split = len(token_ids) - scored
    for start in range(0, split, chunk):
        runner.execute([SeqChunk(token_ids[start:min(start + chunk, split)], start, table, True)])
    nll = 0.0
    for pos in range(split - 1, len(token_ids) - 1):  # the prefill's last token is recomputed as a decode
        logits = runner.execute([SeqChunk([token_ids[pos]], pos, table, True)])
        nll -= torch.log_softmax(logits[0], -1)[token_ids[pos + 1]].item()
    return math.exp(nll / scored)


def decode_step_ms(runner: Any, context: int, batch: int, repeats: int = 5) -> float:
    """Median time of one decode step of `batch` sequences at `context` tokens each."""
    from tokenflow.runtime.paged_runner import SeqChunk

    blocks = -(-(context + 1) // runner.block_size)
    chunks = [SeqChunk([100 + i], context, list(range(i * blocks, (i + 1) * blocks)), True) for i in range(batch)]
    runner.execute(chunks)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        runner.execute(chunks)
        times.append((time.perf_counter() - started) * 1e3)
    return round(statistics.median(times), 1)


async def kv_blocks_by_length(lengths: list[int]) -> list[dict[str, Any]]:
    from tokenflow.engine import Engine
    from tokenflow.testing import build_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model = build_tiny_model(Path(folder) / "tiny-8k", max_position_embeddings=8192)
        for name, window in (("dense", None), ("sliding W=1024", 1024)):
            # dense stops at the context (clamped), sliding runs past it
            settings: dict[str, Any] = {"num_kv_blocks": 1024, "max_model_len": 16384 if window else 8192,
                                        "clamp_max_tokens": True}
            if window:
                settings.update(attention="sliding", window=window, sink_tokens=4)
            row: dict[str, Any] = {"policy": name}
            async with Engine(str(model), **settings) as engine:
                generated = 0
                async for chunk in engine.stream([5] * 16, max_tokens=max(lengths) + 1, temperature=0.0,
                                                 ignore_eos=True):
                    generated += len(chunk.token_ids)
                    if generated in lengths and not chunk.finish_reason:  # a finished request holds nothing
                        row[str(generated)] = engine.stats()["kv_blocks_used"]
                    if chunk.finish_reason:
                        row["finish"] = f"{chunk.finish_reason} at {generated}"
            rows.append(row)
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="model name, folder or file")
    p.add_argument("--text", default="/usr/share/common-licenses/GPL-3", help="a long English text file")
    p.add_argument("--max-text-tokens", type=int, default=8192, help="tokens of the text read at most")
    p.add_argument("--json", dest="json_out", default=None, help="write the results to this JSON file (default: none)")
    p.add_argument("--plot", default=None, help="draw the results into this PNG (needs the plot extra; default: none)")


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenflow.hub import resolve_model

    path = resolve_model(args.model).path
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(Path(args.text).read_text(), add_special_tokens=False)["input_ids"][: args.max_text_tokens]
    results: dict[str, Any] = {"text": args.text, "text_tokens": len(ids), "perplexity": [], "decode_ms": []}
    for name, policy in POLICIES:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        runner = _runner(model, policy, num_blocks=8 * (8192 // 16 + 2))
        row: dict[str, Any] = {"policy": name}
        if "topk_budget" not in policy:  # prefill-scored: top-k only acts on decodes, so it equals dense there
            row["prefill_scored"] = round(perplexity(runner, ids), 3)
        row["decode_scored_last_512"] = round(decode_perplexity(runner, ids), 3)
        results["perplexity"].append(row)
        for batch in (1, 8):
            step = {"policy": name, "batch": batch}
            for context in (1024, 2048, 4096, 8000):
                step[str(context)] = decode_step_ms(runner, context, batch)
            results["decode_ms"].append(step)
    results["kv_blocks"] = anyio.run(kv_blocks_by_length, [512, 1024, 2048, 4096, 8192, 9000])
    return results


def _print(rows: list[dict[str, Any]]) -> None:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(cols, *cells)]
    for line in [cols, *cells]:
        print("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip())


def run_bench_attention(args: argparse.Namespace) -> dict[str, Any]:
    results = _run(args)
    print(f"perplexity of {results['text']} ({results['text_tokens']} tokens): every position scored while fed "
          "512 tokens a step, and the last 512 tokens scored one decode step each")
    _print(results["perplexity"])
    print("\ndecode step ms by context length (tokens)")
    _print(results["decode_ms"])
    print("\nKV blocks in use by generated length (tiny model, 8,192 trained positions)")
    _print(results["kv_blocks"])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    if args.plot:
        from tokenflow.benchmarks.plots import plot_attention

        plot_attention(results, args.plot)
    return results
