"""Charts of the benchmarks' results (matplotlib, the `plot` extra): `--plot out.png` on `tokenflow bench`,
`bench-prefix` and `bench-attention`, or `tokenflow bench-plot results.json out.png` from a saved run."""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from tokenflow.extras import require

__all__ = ("add_arguments", "plot_attention", "plot_prefix", "plot_throughput", "run_bench_plot")


def _pyplot() -> Any:
    matplotlib = require("matplotlib", "plot", "--plot")
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(results: list[dict[str, Any]], out: str | Path, title: str = "") -> list[str]:
    """Requests/s and TTFT p50 by engine for each dtype and concurrency (medians over rounds), with
    tokenflow's ratio to the first other engine marked on its bars; returns those marks."""
    plt = _pyplot()
    groups: dict[tuple[str, int], dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        if r.get("scenario", "standard") == "standard":
            groups[(r.get("run_dtype", r["dtype"]), r["concurrency"])][r["engine"]].append(r)
    keys = sorted(groups, key=lambda k: (k[0], -k[1]))
    engines = list(dict.fromkeys(e for k in keys for e in groups[k]))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(len(engines), 1)
    marks: list[str] = []
    for ax, metric, label in ((axes[0], "req_per_s", "requests / s"), (axes[1], "ttft_p50_s", "TTFT p50 (s)")):
        for j, engine in enumerate(engines):
            values = [statistics.median(r[metric] for r in groups[k][engine]) if groups[k][engine] else 0.0
                      for k in keys]
            bars = ax.bar([i + j * width for i in range(len(keys))], values, width, label=engine)
            if engine.startswith("paged") and j > 0:
                base = [statistics.median(r[metric] for r in groups[k][engines[0]]) if groups[k][engines[0]]
                        else 0.0 for k in keys]
                for bar, ours, theirs in zip(bars, values, base, strict=True):
                    if theirs:
                        marks.append(f"{ours / theirs:.2f}x")
                        ax.annotate(marks[-1], (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                    ha="center", va="bottom", fontsize=8)
        ax.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(keys))],
                      [f"{d}\nc={c}" for d, c in keys])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(title or "tokenflow bench (ratios: tokenflow / " + (engines[0] if engines else "-") + ")")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return marks


def plot_prefix(results: dict[str, Any], out: str | Path) -> None:
    """`bench-prefix`: time to first token by where the prefix came from."""
    plt = _pyplot()
    rows = results["ttft"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.barh([r["case"] for r in rows], [r["ttft_ms"] for r in rows], color="#4a78c2")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['ttft_ms']} ms", (r["ttft_ms"], i), va="center", fontsize=8, xytext=(3, 0),
                    textcoords="offset points")
    ax.invert_yaxis()
    ax.set_xlabel("time to first token (ms)")
    ax.set_title("bench-prefix: TTFT by prefix tier")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_attention(results: dict[str, Any], out: str | Path) -> None:
    """`bench-attention`: decode step time by context length, per policy, at each batch size."""
    plt = _pyplot()
    batches = sorted({r["batch"] for r in results["decode_ms"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 3.6), squeeze=False)
    for ax, batch in zip(axes[0], batches, strict=True):
        for r in (r for r in results["decode_ms"] if r["batch"] == batch):
            contexts = sorted(int(k) for k in r if k.isdigit())
            ax.plot(contexts, [r[str(c)] for c in contexts], marker="o", label=r["policy"])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode step (ms)")
        ax.set_title(f"batch {batch}")
        ax.legend(fontsize=8)
    fig.suptitle("bench-attention: step time by context")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", help="JSON written by --json of bench, bench-prefix or bench-attention")
    p.add_argument("out", help="the PNG to write")


def run_bench_plot(args: argparse.Namespace) -> None:
    data = json.loads(Path(args.results).read_text())
    if isinstance(data, dict) and "results" in data:  # `tokenflow bench`
        meta = data.get("meta", {})
        title = f"tokenflow bench, {meta.get('host_cpu', '?')} x{meta.get('cores', '?')}, {meta.get('started', '')}"
        plot_throughput(data["results"], args.out, title)
    elif isinstance(data, dict) and "ttft" in data:
        plot_prefix(data, args.out)
    elif isinstance(data, dict) and "decode_ms" in data:
        plot_attention(data, args.out)
    else:
        raise SystemExit(f"{args.results}: not the JSON of a tokenflow benchmark")
    print(f"wrote {args.out}")
