"""Keys of shared tiers: the model fingerprint covers every weight byte, and the serving fingerprint
(response cache keys) everything else that changes an answer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenflow.config import EngineConfig
from tokenflow.kv.block_hash import model_key
from tokenflow.stages.response_tier import serving_key


@pytest.fixture(scope="module")
def model(tiny_model: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def test_model_key_covers_every_weight_byte(model) -> None:
    before = model_key(model, 16)
    assert model_key(model, 16) == before  # stable
    param = next(p for p in model.parameters() if p.numel() > 1000)
    with torch.no_grad():
        old = param.view(-1)[-1].item()
        param.view(-1)[-1] = old + 1e-3  # far past any sample of the first values
        changed = model_key(model, 16)
        param.view(-1)[-1] = old
    assert changed != before
    assert model_key(model, 16) == before
    assert model_key(model, 32) != before and model_key(model, 16, "sliding:64:4") != before


def test_serving_key_covers_tokenizer_template_context_and_eos(model, tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    mk = model_key(model, 16)
    base = serving_key(mk, tokenizer, 2048, {2}, EngineConfig())
    assert serving_key(mk, tokenizer, 2048, [2], EngineConfig()) == base
    assert serving_key(b"other model", tokenizer, 2048, {2}, EngineConfig()) != base
    assert serving_key(mk, tokenizer, 1024, {2}, EngineConfig()) != base
    assert serving_key(mk, tokenizer, 2048, {2, 7}, EngineConfig()) != base
    assert serving_key(mk, tokenizer, 2048, {2}, EngineConfig(default_max_tokens=16)) != base
    tokenizer.chat_template = tokenizer.chat_template + " "
    assert serving_key(mk, tokenizer, 2048, {2}, EngineConfig()) != base
    other = AutoTokenizer.from_pretrained(tiny_model)
    other.add_tokens(["<|tool|>"])  # one more vocabulary entry
    assert serving_key(mk, other, 2048, {2}, EngineConfig()) != base
