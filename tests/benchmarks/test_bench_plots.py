"""The benchmarks' charts: each JSON shape becomes a PNG, and `tokenflow bench`'s ratios are tokenflow's
median over the other engine's, per dtype and concurrency."""

from __future__ import annotations

import argparse
import json

import pytest

from tokenflow.benchmarks.plots import plot_throughput, run_bench_plot


def _png(path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def _row(engine, dtype, c, req, ttft, round_=0):
    return {"engine": engine, "dtype": dtype, "concurrency": c, "req_per_s": req, "ttft_p50_s": ttft,
            "scenario": "standard", "round": round_}


def test_throughput_plot_marks_the_ratios(tmp_path) -> None:
    results = [_row("vllm", "bfloat16", 16, 2.0, 2.0), _row("paged", "bfloat16", 16, 2.6, 1.0),
               _row("paged", "bfloat16", 16, 3.0, 1.2, 1), _row("paged", "bfloat16", 16, 2.2, 0.8, 2),
               _row("vllm", "bfloat16", 1, 0.5, 0.2), _row("paged", "bfloat16", 1, 0.75, 0.1)]
    out = tmp_path / "bench.png"
    marks = plot_throughput(results, out)
    # c=16 first: req/s 2.6 (median of 2.6, 3.0, 2.2) / 2.0, c=1 0.75 / 0.5; then TTFT 1.0 / 2.0 and 0.1 / 0.2
    assert marks == ["1.30x", "1.50x", "0.50x", "0.50x"]
    assert _png(out)


def test_bench_plot_reads_each_benchmarks_json(tmp_path) -> None:
    saved = {
        "bench.json": {"meta": {"host_cpu": "test", "cores": 2, "started": "now"},
                       "results": [_row("vllm", "float32", 16, 1.0, 1.0), _row("paged", "float32", 16, 1.1, 0.5)]},
        "prefix.json": {"hit_rate": [],
                        "ttft": [{"case": "cold", "ttft_ms": 300.0}, {"case": "pool", "ttft_ms": 20.0}]},
        "attention.json": {"decode_ms": [{"policy": "dense", "batch": 1, "1024": 10.0, "2048": 12.0},
                                         {"policy": "sliding", "batch": 1, "1024": 9.0, "2048": 9.5}]},
    }
    for name, data in saved.items():
        (tmp_path / name).write_text(json.dumps(data))
        out = tmp_path / (name + ".png")
        run_bench_plot(argparse.Namespace(results=str(tmp_path / name), out=str(out)))
        assert _png(out), name
    (tmp_path / "other.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not the JSON of a tokenflow benchmark"):
        run_bench_plot(argparse.Namespace(results=str(tmp_path / "other.json"), out=str(tmp_path / "x.png")))
