"""Run one benchmark workload on vLLM (`tokenflow bench --peers vllm` starts this in vLLM's venv).

    .peers/vllm/bin/python tokenflow/benchmarks/peer_vllm.py --model DIR --dtype bfloat16 --workload w.json

Drives `vllm.v1.engine.async_llm.AsyncLLM` in process with token-id prompts (no tokenizer on the
timed path, as for tokenflow), greedy, EOS ignored, through the same client code (`clients.py`, next
to this file) as tokenflow's own worker; prints one line `RESULT {json}`. Not imported by tokenflow:
vLLM is not installed in tokenflow's environment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from clients import run_workload

# Both cores for the engine (vLLM keeps one for its frontend by default), a 4 GiB KV cache.
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")


async def main(args: argparse.Namespace) -> dict[str, Any]:
    import vllm
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    workload = json.loads(Path(args.workload).read_text())
    started = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, enable_prefix_caching=True,
        max_model_len=args.max_model_len, seed=0,
    ))
    load_s = time.perf_counter() - started
    counter = 0

    async def stream(ids: list[int], max_tokens: int) -> AsyncIterator[list[int]]:
        nonlocal counter
        counter += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        async for out in engine.generate({"prompt_token_ids": ids}, params, request_id=f"r{counter}"):
            yield list(out.outputs[0].token_ids)

    try:
        async for _ in stream(workload["warmup"], 4):
            pass
        await engine.reset_prefix_cache()  # the timed pass starts with nothing cached
        result = await run_workload(stream, workload)
    finally:
        engine.shutdown()
    import resource

    rss = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return {**result, "engine": "vllm", "version": vllm.__version__, "load_s": round(load_s, 2),
            "peak_rss_mb": round(rss / 1024, 1)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--workload", required=True)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    result = asyncio.run(main(parser.parse_args()))
    print("RESULT " + json.dumps(result), flush=True)
