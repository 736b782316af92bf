"""LoRA adapters (PEFT folders built with `peft` here): a batch mixing two adapters of different ranks and
targets with the base model gives each row what transformers + PEFT give, in fp32; adapters load and unload
while the engine serves; no adapter is served another's KV or cached response; over HTTP by `model` name."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.servers import Server
from tokenflow import Engine
from tokenflow.errors import InvalidRequest
from tokenflow.testing import build_tiny_model

# adapter A: rank 4 on the attention projections; B: rank 8 on Q, V and the MLP (rsLoRA scaling)
ADAPTERS = {"a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
            "b": dict(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
                      use_rslora=True)}


def _adapter(base: Path, folder: Path, seed: int, **options) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(init_lora_weights=False, **options))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)  # decisive: each adapter changes the greedy tokens
    peft.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def lora_model(request, tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = build_tiny_model(root / "base", arch=request.param)
    return base, {name: _adapter(base, root / name, seed, **options)
                  for seed, (name, options) in enumerate(ADAPTERS.items(), start=1)}


def _peft_greedy(base: Path, adapter: Path | None, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        out = model.eval().generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


async def test_a_mixed_batch_equals_transformers_with_peft_row_by_row(lora_model) -> None:
    base, adapters = lora_model
    prompts = {"a": list(range(5, 45)), "b": list(range(60, 75)), None: list(range(100, 190))}
    want = {name: _peft_greedy(base, adapters.get(name), prompt, 16) for name, prompt in prompts.items()}
    assert len({tuple(w) for w in want.values()}) == 3
    async with Engine(base, max_batch_tokens=32, lora_adapters={k: str(v) for k, v in adapters.items()}) as engine:
        got: dict[str | None, list[int]] = {}

        async def one(name: str | None, delay: float) -> None:
            await anyio.sleep(delay)
            got[name] = (await engine.generate(prompts[name], max_tokens=16, temperature=0.0, lora=name)).token_ids

        async with anyio.create_task_group() as tg:  # every step after the first holds rows of all three
            for i, name in enumerate(prompts):
                tg.start_soon(one, name, 0.002 * i)
        assert got == want
        # the same prompt under each adapter and none: the prefix cache keeps them apart
        same = prompts["a"]  # run with "a" above: its blocks are cached under "a" only
        for name, reuses in [("b", False), (None, False), ("a", True)]:
            hits = engine.stats()["prefix_cache_hit_tokens"]
            done = await engine.generate(same, max_tokens=16, temperature=0.0, lora=name)
            assert done.token_ids == _peft_greedy(base, adapters.get(name), same, 16), name
            assert (engine.stats()["prefix_cache_hit_tokens"] > hits) == reuses, name


async def test_adapters_load_and_unload_while_serving(lora_model) -> None:
    base, adapters = lora_model
    prompt = list(range(5, 45))
    async with Engine(base, enable_lora=True, response_cache=True) as engine:
        with pytest.raises(InvalidRequest) as unknown:
            await engine.generate(prompt, max_tokens=4, lora="a")
        assert unknown.value.field == "lora"
        alone = (await engine.generate(list(range(200, 230)), max_tokens=300, temperature=0.0, ignore_eos=True,
                                       cache_response=False)).token_ids
        tokens: list[int] = []

        async def long_base() -> None:
            async for chunk in engine.stream(list(range(200, 230)), max_tokens=300, temperature=0.0,
                                             ignore_eos=True, cache_response=False):
                tokens.extend(chunk.token_ids)

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_base)
            await engine.load_lora("a", adapters["a"])
            await engine.load_lora("b", adapters["b"])
            for name in ("a", "b"):
                done = await engine.generate(prompt, max_tokens=8, temperature=0.0, lora=name)
                assert done.token_ids == _peft_greedy(base, adapters[name], prompt, 8)
            engine.unload_lora("a")
            with pytest.raises(InvalidRequest):
                await engine.generate(prompt, max_tokens=4, lora="a")
            # reloaded under the same name with B's weights: neither its cached response nor its KV is A's
            await engine.load_lora("a", adapters["b"])
            again = await engine.generate(prompt, max_tokens=8, temperature=0.0, lora="a")
            assert again.token_ids == _peft_greedy(base, adapters["b"], prompt, 8)
        assert tokens == alone  # the base stream beside the loads never changed


async def test_adapters_that_do_not_fit_are_refused_by_name(lora_model, tmp_path: Path) -> None:
    base, adapters = lora_model
    async with Engine(base) as engine:
        with pytest.raises(InvalidRequest, match="enable_lora"):
            await engine.load_lora("a", adapters["a"])
    dora = tmp_path / "dora"
    dora.mkdir()
    for f in adapters["a"].iterdir():
        (dora / f.name).write_bytes(f.read_bytes())
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    other = build_tiny_model(tmp_path / "wider", arch="llama", hidden_size=96, intermediate_size=160)
    async with Engine(base, enable_lora=True) as engine:
        with pytest.raises(InvalidRequest, match="DoRA"):
            await engine.load_lora("d", dora)
        with pytest.raises(InvalidRequest, match="PEFT folder"):
            await engine.load_lora("x", tmp_path)
        with pytest.raises(InvalidRequest, match="layer is"):
            await engine.load_lora("w", _adapter(other, tmp_path / "w", 5, **ADAPTERS["a"]))
        assert (await engine.generate("hello", max_tokens=3, temperature=0.0)).token_ids  # still serving


def test_adapters_over_http_by_model_name(lora_model) -> None:
    base, adapters = lora_model
    with Server(base, lora_adapters={k: str(v) for k, v in adapters.items()}) as server:
        client = server.openai_client()
        models = client.models.list().data
        assert [m.id for m in models][1:] == ["a", "b"] and models[0].id not in ("a", "b")
        tokenizer = AutoTokenizer.from_pretrained(base)
        messages = [{"role": "user", "content": "hello there"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        for name in ("a", "b"):
            done = client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0,
                                                  extra_body={"ignore_eos": True, "skip_special_tokens": False})
            assert done.model == name
            want = _peft_greedy(base, adapters[name], list(ids), 8)
            assert done.choices[0].message.content == tokenizer.decode(want)
            text = client.completions.create(model=name, prompt=list(range(5, 45)), max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True, "skip_special_tokens": False})
            assert text.choices[0].text == tokenizer.decode(_peft_greedy(base, adapters[name], list(range(5, 45)), 8))
