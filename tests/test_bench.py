"""`tokenflow bench` end to end on the tiny model: every engine runs, the table and JSON come out."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow  # four engine subprocesses: ~45 s
def test_bench_runs_every_engine_and_writes_json(tiny_model, tmp_path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "tokenflow", "bench", "--model", str(tiny_model), "--requests", "4",
           "--max-tokens", "6", "--min-prompt", "8", "--max-prompt", "40", "--concurrency", "1,2",
           "--engines", "paged,paged-ngram,hf,naive", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vs_naive" in proc.stdout
    results = json.loads(out.read_text())
    seen = {(r["engine"], r["concurrency"]) for r in results}
    assert seen == {(e, c) for e in ("paged", "paged-ngram", "hf", "naive") for c in (1, 2)}
    for r in results:
        assert r["requests"] == 4 and r["out_tok_per_s"] > 0, r
        assert r["output_tokens"] == 4 * 6, r  # EOS ignored: 6 tokens each
    ngram = [r for r in results if r["engine"] == "paged-ngram"]
    assert all("num_draft_tokens" in r["engine_stats"] for r in ngram)
