"""The CUDA checks of scripts/gpu_check.sh, printed as one table (run only on a machine with a GPU).

1. oracle: greedy bf16 tokens of the embedded model through tokenflow on CUDA against transformers' bf16
   eager forward on CUDA, judged by vLLM's logprob rule (where the tokens first differ, each must be in the
   other's top 5; nothing after it is compared);
2. out of memory: the process may use only a little more device memory than the engine holds after start
   (`torch.cuda.set_per_process_memory_fraction`), then 16 long prompts arrive at once; every caller must
   get its completion or an EngineError of its own, and the engine must live on;
3. the throughput bench on CUDA (`tokenflow bench`, run by the shell script after this).
"""

from __future__ import annotations

import sys

import anyio
import torch


async def oracle(model: str, rows: list[tuple[str, str]]) -> None:
    from transformers import AutoModelForCausalLM

    from tokenflow import Engine

    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "The three primary colours are",
               "In 1969, astronauts", "A haiku about autumn:", "SELECT name FROM", "The largest planet is"]
    async with Engine(model, device="cuda", dtype="bfloat16") as engine:
        ours = [await engine.generate(p, max_tokens=32, temperature=0.0, logprobs=5, ignore_eos=True) for p in prompts]
        path = engine.loaded.model.name_or_path
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").cuda().eval()
    agree = 0
    for done in ours:
        ids = list(done.prompt_token_ids or [])
        for step, lp in enumerate(done.logprobs or []):
            with torch.no_grad():
                logits = hf(torch.tensor([ids], device="cuda")).logits[0, -1].float()
            top = logits.log_softmax(-1).topk(5).indices.tolist()
            if top[0] != lp.token_id:  # vLLM's rule: each in the other's top 5, then stop comparing
                if lp.token_id not in top or top[0] not in lp.top:
                    raise SystemExit(f"oracle: {done.request_id} step {step}: {lp.token_id} vs {top[0]} out of top 5")
                break
            ids.append(lp.token_id)
            agree += 1
    rows.append(("oracle (bf16, vLLM's top-5 rule)", f"ok: {agree} tokens identical before any divergence"))


async def out_of_memory(model: str, rows: list[tuple[str, str]]) -> None:
    from tokenflow import Engine
    from tokenflow.errors import EngineError

    async with Engine(model, device="cuda", dtype="bfloat16", max_num_seqs=16, max_batch_tokens=8192) as engine:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_allocated() + 256 * 2**20) / total))
        outcomes: list[str] = []

        async def one(i: int) -> None:
            try:
                await engine.generate([100 + (i * 13 + j) % 20000 for j in range(1500)], max_tokens=16,
                                      ignore_eos=True)
                outcomes.append("ok")
            except EngineError:
                outcomes.append("EngineError")

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(one, i)
        stats = engine.stats()
        torch.cuda.set_per_process_memory_fraction(1.0)
    if len(outcomes) != 16 or stats["dead"] or stats["kv_blocks_used"]:
        raise SystemExit(f"out of memory: outcomes {outcomes}, stats {stats}")
    rows.append(("out of memory (256 MiB of headroom, 16 x 1,500 tokens)",
                 f"{outcomes.count('ok')} ok, {outcomes.count('EngineError')} failed alone; "
                 f"{stats['num_oom_recoveries']} recoveries, {stats['num_preemptions']} preemptions"))


async def main(model: str) -> None:
    rows = [("GPU", torch.cuda.get_device_name(0))]
    await oracle(model, rows)
    await out_of_memory(model, rows)
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m")
