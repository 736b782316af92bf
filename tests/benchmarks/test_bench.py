"""`tokenflow bench` end to end on the tiny model, and the shared benchmark clients."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenflow.benchmarks.clients import closed_loop, conversations
from tokenflow.engine import Engine


@pytest.mark.slow  # engine subprocesses: ~1 min
def test_bench_runs_every_engine_and_writes_json(tiny_model, tmp_path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "tokenflow", "bench", "--model", str(tiny_model), "--requests", "4",
           "--max-tokens", "6", "--min-prompt", "8", "--max-prompt", "40", "--concurrency", "1,2",
           "--engines", "paged,paged-ngram,hf,naive", "--scenarios", "standard,shared-prefix,restart",
           "--conversations", "2", "--turns", "2", "--system-tokens", "60", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vs_naive" in proc.stdout and "req/s vs vllm" in proc.stdout
    data = json.loads(out.read_text())
    assert data["meta"]["host_cpu"] and data["meta"]["cores"] >= 1
    results = data["results"]
    standard = [r for r in results if r["scenario"] == "standard"]
    seen = {(r["engine"], r["concurrency"]) for r in standard}
    assert seen == {(e, c) for e in ("paged", "paged-ngram", "hf", "naive") for c in (1, 2)}
    for r in standard:
        assert r["requests"] == 4 and r["out_tok_per_s"] > 0, r
        assert r["output_tokens"] == 4 * 6, r  # EOS ignored: 6 tokens each
    ngram = [r for r in standard if r["engine"] == "paged-ngram"]
    assert all("num_draft_tokens" in r["engine_stats"] for r in ngram)
    shared = [r for r in results if r["scenario"] == "shared-prefix"]
    assert len(shared) == 1 and shared[0]["requests"] == 4 and shared[0]["output_tokens"] == 4 * 6
    assert shared[0]["engine_stats"]["prefix_cache_hit_tokens"] > 0  # later turns reuse the history
    restart = {r["phase"]: r for r in results if r["scenario"] == "restart"}
    assert set(restart) == {"fill", "warm restart"}
    assert restart["warm restart"]["engine_stats"]["disk_blocks_loaded"] > 0  # the disk tier served it


async def test_clients_measure_every_request_and_reuse_the_history(tiny_model) -> None:
    prompts_seen: list[list[int]] = []
    async with Engine(tiny_model, max_num_seqs=4) as engine:

        async def stream(ids: list[int], max_tokens: int):
            prompts_seen.append(list(ids))
            async for chunk in engine.stream(ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                yield chunk.token_ids

        loop = await closed_loop(stream, [[5, 6, 7]] * 5, max_tokens=3, concurrency=2)
        assert loop["requests"] == 5 and loop["output_tokens"] == 15
        assert 0 < loop["ttft_p50_s"] <= loop["latency_p50_s"] and loop["req_per_s"] > 0
        prompts_seen.clear()
        talk = await conversations(stream, [1, 2, 3], [[[10, 11], [12]], [[20], [21, 22]]], [99], max_tokens=2)
    assert talk["requests"] == 4 and talk["output_tokens"] == 8
    firsts = [p for p in prompts_seen if len(p) <= 5]
    seconds = [p for p in prompts_seen if len(p) > 5]
    assert sorted(firsts) == [[1, 2, 3, 10, 11], [1, 2, 3, 20]]
    for second in seconds:  # the whole first turn, its two reply tokens, the terminator, the next turn
        first = next(f for f in firsts if second[: len(f)] == f)
        assert second[len(first) + 2] == 99 and second[len(first) + 3:] in ([12], [21, 22])


@pytest.mark.slow  # several engines in turn: ~1 min
def test_bench_quality_measures_every_variant_and_compression(tiny_model, tmp_path) -> None:
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 97} and sentence {i} of the held-out text." for i in range(600)))
    out = tmp_path / "quality.json"
    cmd = [sys.executable, "-m", "tokenflow", "bench-quality", "--model", str(tiny_model), "--text", str(text),
           "--tokens", "640", "--window", "256", "--max-tokens", "8", "--variants", "fp32,bf16,int8 KV",
           "--compression-ratios", "2,4", "--continuation-prefix", "256", "--continuation-tokens", "64",
           "--retrieval-lengths", "300", "--retrieval-trials", "2", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"fp32", "bf16", "int8 KV"}
    assert rows["fp32"]["mean_common_prefix"] == 8 and rows["fp32"]["identical_answers"] == 16
    assert all(r["perplexity"] > 1 and r["scored_tokens"] == 637 for r in rows.values())  # 255 + 255 + 127
    ratios = [r["ratio"] for r in data["compression"]]
    assert ratios == [1.0, 2.0, 4.0]
    for r in data["compression"]:
        assert r["perplexity"] > 1 and r["retrieval_300"]["trials"] == 2
        assert r["retrieval_300"]["compressed"] == (0 if r["ratio"] == 1.0 else 2)


def test_step_parts_account_for_each_step(tiny_model) -> None:
    """`bench-step --parts`: every case and linears kernel, parts that are times within their step."""
    import torch

    from tokenflow.benchmarks.step_parts import step_parts
    from tokenflow.runtime.cpu.few_rows_linear import load_few_rows_kernels

    rows = step_parts(str(tiny_model), torch.float32, repeats=2)
    cases = ["decode, batch 1", "decode, batch 16", "prefill 512 from 0", "prefill 512 after 300"]
    few_rows = load_few_rows_kernels()
    c_loop = ["C loop"] if few_rows is not None and torch.float32 in few_rows.dtypes else []  # needs AVX512
    if c_loop and torch.bfloat16 in few_rows.dtypes:  # and the greedy head's estimates AVX512-BF16
        c_loop.append("C+greedy")
    kernels = {c: ["post-ops", "oneDNN"] if c.startswith("prefill") else ["few-rows", "oneDNN", *c_loop]
               for c in cases}  # the engine's linears first; decodes also as the one-call C loop
    assert [(r["case"], r["linears_kernel"]) for r in rows] == [(c, k) for c in cases for k in kernels[c]]
    for r in rows:
        if r["linears_kernel"].startswith("C"):  # one call: only the step and the head after it are timed
            assert r["step_ms"] > r["head_ms"] > 0 and r["linears_ms"] is None and r["rest_ms"] is None, r
            continue
        parts = [r[f"{p}_ms"] for p in ("linears", "head", "attention", "norms")]
        assert all(p > 0 for p in parts), r
        assert sum(parts) <= r["step_ms"], r  # what remains is the rest, never negative beyond timer noise
        assert r["rest_ms"] >= 0, r
    assert all(0 < r["floor_ms"] < r["step_ms"] and r["read_gb_per_s"] > 0 for r in rows)  # floors: lower bounds


def test_a_steps_floor_is_its_bytes_or_its_arithmetic(tiny_model) -> None:
    """The roofline of `bench-step --parts`: a decode step reads every layer weight, the head and its cached K/V
    once; a prefill chunk is bound by its arithmetic where the matmul rate is the scarcer."""
    import torch
    from transformers import AutoModelForCausalLM

    from tokenflow.benchmarks.step_parts import step_floor

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    config = model.config
    weights = sum(p.numel() for p in model.model.layers.parameters()) + model.lm_head.weight.numel()
    head_dim = config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # bytes per cached token
    slow_memory = {"read_bytes_per_s": 1e6, "flops_per_s": 1e15}
    assert step_floor(model, 1, 101, 100, slow_memory) == pytest.approx(1e3 * (4 * weights + 100 * kv) / 1e6)
    slow_arithmetic = {"read_bytes_per_s": 1e15, "flops_per_s": 1e6}
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * head_dim * 5000
    want = 1e3 * (2 * 512 * weights + attention) / 1e6
    assert step_floor(model, 512, 5000, 0, slow_arithmetic) == pytest.approx(want)
