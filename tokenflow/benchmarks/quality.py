"""`tokenflow bench-quality`: what each numeric form costs in quality, against fp32.

* Perplexity of a held-out text (default: the GPL-3 text from /usr/share/common-licenses, which the
  int8 calibration text does not overlap), scored through `prompt_logprobs` in windows of
  `--window` tokens, each window a request of its own.
* Greedy agreement with fp32: chat prompts answered greedily (EOS ignored); for each variant, the
  mean length of the common prefix of its tokens and fp32's, and how many answers are identical.
* kv_compression at each `--compression-ratios` against dense: perplexity of a continuation decoded
  over a compressed prefix, and pass-key retrieval from long documents (`benchmarks.compression`).

Variants: fp32, bf16, bf16 with `quantization="int8"`, with `kv_cache_dtype="int8"`, and both, and the model's
GGUF files made by llama.cpp's tools (`gguf q8_0`, `gguf q4_k_m`, `gguf q4_0`: run as they are, bf16 activations);
each engine runs in this process one after the other, with the same requests. With `--llamacpp`, llama.cpp's own
`llama-perplexity` scores the bf16 GGUF and each GGUF variant's file on the same text, for the ratio to set beside
ours (its windows score their second half only, so its absolute figures differ from ours; the ratio to bf16 is
what compares). Windows are prefilled in
`max_batch_tokens` chunks (512 on CPU), so with an int8 cache every chunk after a window's first
attends to dequantised keys and values, as decodes do.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import anyio

from tokenflow.benchmarks.gguf_files import gguf_of_model
from tokenflow.kv.prefix_cache import common_prefix

__all__ = ("VARIANTS", "add_arguments", "common_prefix", "run_bench_quality")

VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8 weights": {"dtype": "bfloat16", "quantization": "int8"},
    "int8 KV": {"dtype": "bfloat16", "kv_cache_dtype": "int8"},
    "int8 weights + KV": {"dtype": "bfloat16", "quantization": "int8", "kv_cache_dtype": "int8"},
    "gguf q8_0": {"dtype": "bfloat16", "gguf": "q8_0"},
    "gguf q4_k_m": {"dtype": "bfloat16", "gguf": "q4_k_m"},
    "gguf q4_0": {"dtype": "bfloat16", "gguf": "q4_0"},
}
DEFAULT_VARIANTS = ("fp32", "bf16", "int8 weights", "int8 KV", "int8 weights + KV")

QUESTIONS = (
    "Why is the sky blue?", "Write a haiku about the sea.", "What is the capital of Japan?",
    "Explain recursion to a child.", "List three uses of copper.", "How do airplanes stay in the air?",
    "Give me a tip for learning to cook.", "What causes the seasons on Earth?", "Describe a cat in one sentence.",
    "What is 12 times 13?", "Name a famous painting and its painter.", "How does a refrigerator keep food cold?",
    "Write a Python one-liner that reverses a string.", "What is the boiling point of water in Fahrenheit?",
    "Suggest a name for a bakery.", "Why do we need sleep?",
)


async def _measure(model: str | None, settings: dict[str, Any], windows: list[list[int]], max_tokens: int
                   ) -> dict[str, Any]:
    from tokenflow import Engine

    started = time.perf_counter()
    async with Engine(model, prefix_caching=False, **settings) as engine:
        load_s = time.perf_counter() - started
        nll, count = 0.0, 0
        for ids in windows:
            done = await engine.generate(ids, max_tokens=1, temperature=0.0, prompt_logprobs=0)
            for token, entry in zip(ids[1:], (done.prompt_logprobs or [])[1:]):
                nll -= entry[token]
                count += 1
        answers = []
        for question in QUESTIONS:
            done = await engine.chat([{"role": "user", "content": question}], max_tokens=max_tokens,
                                     temperature=0.0, ignore_eos=True)
            answers.append(list(done.token_ids))
        stats = engine.stats()
    return {"perplexity": math.exp(nll / count), "scored_tokens": count, "answers": answers,
            "load_s": round(load_s, 2), "weight_bytes": stats.get("weight_bytes")}


def run_bench_quality(args: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    from tokenflow.hub import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model).path)
    ids = list(tokenizer(Path(args.text).read_text(), add_special_tokens=False)["input_ids"])[: args.tokens]
    windows = [ids[i:i + args.window] for i in range(0, len(ids) - 1, args.window)]
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variant {unknown}; known: {', '.join(VARIANTS)}")
    results: dict[str, dict[str, Any]] = {}
    for name in ["fp32", *[n for n in names if n != "fp32"]]:  # fp32 first: the reference
        settings = dict(VARIANTS[name])
        gguf_kind = settings.pop("gguf", None)
        model = str(gguf_of_model(args.model, gguf_kind)) if gguf_kind else args.model
        results[name] = anyio.run(_measure, model, settings, windows, args.max_tokens)
        if args.llamacpp and (gguf_kind or name == "bf16"):
            results[name]["llamacpp_perplexity"] = llamacpp_perplexity(
                gguf_of_model(args.model, gguf_kind or "bf16"), Path(args.text), args.window, len(windows))
    reference = results["fp32"]
    rows = []
    bf16 = results["bf16"]["perplexity"] if "bf16" in results else None
    for name in names if "fp32" in names else ["fp32", *names]:
        r = results[name]
        prefixes = [common_prefix(a, b) for a, b in zip(r["answers"], reference["answers"])]
        rows.append({
            "variant": name, "perplexity": round(r["perplexity"], 3),
            "perplexity_vs_bf16": round(r["perplexity"] / bf16, 4) if bf16 else None,
            "mean_common_prefix": round(sum(prefixes) / len(prefixes), 2),
            "identical_answers": prefixes.count(args.max_tokens), "answers": len(prefixes),
            "scored_tokens": r["scored_tokens"], "weight_bytes": r["weight_bytes"], "load_s": r["load_s"],
            "llamacpp_perplexity": r.get("llamacpp_perplexity"),
        })
    _print(rows, args)
    compression = _compression_rows(args, ids) if args.compression_ratios else []
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": rows, "compression": compression, "args": vars(args),
                                                   "started": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    return rows


def llamacpp_perplexity(gguf_file: Path, text: Path, window: int, chunks: int) -> float:
    """llama.cpp's `llama-perplexity` on `text` in `chunks` windows of `window` tokens: its final estimate."""
    import re
    import subprocess

    from tokenflow.benchmarks.gguf_files import llamacpp_binary

    cmd = [llamacpp_binary("llama-perplexity"), "-m", str(gguf_file), "-f", str(text), "-c", str(window),
           "--chunks", str(chunks), "-t", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", proc.stdout + proc.stderr)
    if proc.returncode != 0 or found is None:
        raise SystemExit(f"llama-perplexity failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
    return float(found.group(1))


def _compression_rows(args: argparse.Namespace, ids: list[int]) -> list[dict[str, Any]]:
    """kv_compression at each ratio against dense (bf16): continuation perplexity and pass-key retrieval."""
    import torch
    from transformers import AutoModelForCausalLM

    from tokenflow.benchmarks.compression import continuation_perplexity, passkey_hit_rate
    from tokenflow.hub import resolve_model

    length = args.continuation_prefix + args.continuation_tokens
    windows = [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)]
    lengths = [int(n) for n in args.retrieval_lengths.split(",") if n]
    ratios: list[float | None] = [None, *(float(r) for r in args.compression_ratios.split(",") if r)]
    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model).path, dtype=torch.bfloat16).eval()
    rows = []
    for ratio in ratios:
        row: dict[str, Any] = {"ratio": ratio or 1.0, "perplexity": round(
            continuation_perplexity(model, windows, args.continuation_prefix, ratio), 3)}
        settings: dict[str, Any] = {"dtype": "bfloat16"}
        if ratio is not None:
            settings.update(kv_compression="snapkv", kv_compression_ratio=ratio, kv_compression_min_tokens=64)
        for tokens in lengths:
            row[f"retrieval_{tokens}"] = anyio.run(passkey_hit_rate, args.model, settings, tokens,
                                                   args.retrieval_trials)
        rows.append(row)
        print(f"compression ratio {row['ratio']}: {row}", flush=True)
    dense = rows[0]
    print(f"\nkv_compression (bf16): perplexity of {args.continuation_tokens} tokens after a compressed "
          f"{args.continuation_prefix}-token prefix, {len(windows)} windows; pass-key hits out of "
          f"{args.retrieval_trials} at each document length (prompt tokens)")
    head = " | ".join(f"retrieval at {dense[f'retrieval_{t}']['prompt_tokens']} tokens" for t in lengths)
    print(f"| ratio | perplexity | vs dense | {head} |")
    print("|---|---|---|" + "---|" * len(lengths))
    for r in rows:
        cells = " | ".join(f"{r[f'retrieval_{t}']['hits']} / {r[f'retrieval_{t}']['trials']}" for t in lengths)
        print(f"| {'dense' if r['ratio'] == 1.0 else r['ratio']} | {r['perplexity']:.3f} | "
              f"{r['perplexity'] / dense['perplexity']:.4f} | {cells} |")
    return rows


def _print(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"perplexity of {Path(args.text).name} ({rows[0]['scored_tokens']} tokens, windows of {args.window}); "
          f"greedy agreement with fp32 over {rows[0]['answers']} answers of {args.max_tokens} tokens")
    print("| variant | perplexity | vs bf16 | llama-perplexity | its vs bf16 | mean common prefix with fp32 "
          "| identical answers | weight bytes |")
    print("|---|---|---|---|---|---|---|---|")
    llama_bf16 = next((r["llamacpp_perplexity"] for r in rows if r["variant"] == "bf16"), None)
    for r in rows:
        ratio = f"{r['perplexity_vs_bf16']:.4f}" if r["perplexity_vs_bf16"] is not None else ""
        weights = f"{r['weight_bytes'] / 2**20:.1f} MiB" if r["weight_bytes"] else ""
        theirs = r.get("llamacpp_perplexity")
        their_ratio = f"{theirs / llama_bf16:.4f}" if theirs and llama_bf16 else ""
        print(f"| {r['variant']} | {r['perplexity']:.3f} | {ratio} | {f'{theirs:.3f}' if theirs else ''} "
              f"| {their_ratio} | {r['mean_common_prefix']:.1f} / {args.max_tokens} "
              f"| {r['identical_answers']} / {r['answers']} | {weights} |")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name, folder or file (default: the embedded model)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--llamacpp", action="store_true",
                   help="llama.cpp's llama-perplexity on the bf16 GGUF and each GGUF variant's file, beside ours")
    p.add_argument("--text", default="/usr/share/common-licenses/GPL-3", help="the held-out text")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the text scored")
    p.add_argument("--window", type=int, default=1024, help="tokens per scored window (one request each)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per greedy answer")
    p.add_argument("--compression-ratios", default="2,4,8", help="kv_compression ratios to measure ('' for none)")
    p.add_argument("--continuation-prefix", type=int, default=1024, help="compression: tokens prefilled and compressed")
    p.add_argument("--continuation-tokens", type=int, default=256, help="compression: tokens scored after them")
    p.add_argument("--retrieval-lengths", default="1000,2500,4000", help="pass-key documents, in tokens")
    p.add_argument("--retrieval-trials", type=int, default=10, help="pass keys per document length")
    p.add_argument("--json", dest="json_out", default=None, help="write the results to this JSON file (default: none)")
