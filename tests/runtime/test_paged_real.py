"""The paged runner on the real embedded model (SmolLM2-135M-Instruct): slow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenflow.kv.block_pool import BlockPool
from tokenflow.kv.kv_cache import KVCache
from tokenflow.runtime.paged_runner import PagedModelRunner, SeqChunk

pytestmark = pytest.mark.slow

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue, and then list three colours of the rainbow.",
)


def test_fp32_greedy_matches_generate(real_model: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model)
    ref = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32).eval()
    prompts = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if not isinstance(ids, list) else ids))
    new = 16
    expected = []
    for p in prompts:
        x = torch.tensor([p])
        # An explicit mask: SmolLM2's pad id is <|im_end|>, which chat prompts contain; without
        # it generate would mask those tokens and shift positions.
        out = ref.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new, eos_token_id=None
        )
        expected.append(out[0, len(p) :].tolist())

    cache = KVCache.for_model(model.config, num_blocks=32, block_size=16, dtype=torch.float32)
    runner = PagedModelRunner(model, cache)
    pool = BlockPool(32, 16)
    tokens = [list(p) for p in prompts]
    cached = [0] * len(prompts)
    blocks: list[list[int]] = [[] for _ in prompts]
    generated: list[list[int]] = [[] for _ in prompts]
    while any(len(g) < new for g in generated):
        active = [i for i in range(len(prompts)) if len(generated[i]) < new]
        chunks = []
        for i in active:  # prefill in chunks of 13 tokens next to the others' decodes
            end = min(cached[i] + 13, len(tokens[i]))
            blocks[i] += pool.allocate(pool.blocks_needed(end) - len(blocks[i]))
            done = end == len(tokens[i])
            chunks.append(SeqChunk(tokens[i][cached[i] : end], cached[i], list(blocks[i]), done))
            cached[i] = end
        picks = iter(runner.execute(chunks).argmax(-1).tolist())
        for i, c in zip(active, chunks):
            if c.sample:
                t = next(picks)
                generated[i].append(t)
                tokens[i].append(t)
    assert generated == expected
    assert tok.decode(generated[0]).startswith("The capital of France is Paris.")
