"""The CUDA form of `quantization="int8"` (torchao's weight-only int8 in the fused layers), run on CPU:
the engine's prompt logprobs equal transformers' with the same int8 weights dequantised, and differ from
the float model's by the quantisation error. (On CUDA it runs from `quantize_runner`; scripts/gpu_check.py's
`int8` check measures it there.)"""

from __future__ import annotations

import torch

from tokenflow import Engine
from tokenflow.runtime.quantize import quantize_weight_only

PROMPT = [5 + (7 * j) % 300 for j in range(40)]


def _dequantized(linear) -> torch.Tensor:
    weight = linear.weight
    assert weight.qdata.dtype == torch.int8
    return weight.qdata.float() * weight.scale.float().reshape(-1, 1)


async def test_weight_only_int8_layers_run_their_int8_weights(tiny_model) -> None:
    from transformers import AutoModelForCausalLM

    # unpacked weights, as on CUDA: the fused layers read the model's own (a packed CPU engine releases them)
    async with Engine(tiny_model, dtype="float32", prefix_caching=False, debug_leaks=True,
                      pack_cpu_weights=False) as engine:
        done = await engine.generate(PROMPT, max_tokens=1, temperature=0.0, prompt_logprobs=0)
        float_logprobs = [entry[t] for t, entry in zip(PROMPT[1:], done.prompt_logprobs[1:])]
        fused = engine._loop.backend.runner.fused
        float_bytes = sum(w.numel() * 4 for w, _ in fused.linear_weights().values())
        int8_bytes = quantize_weight_only(fused)
        done = await engine.generate(PROMPT, max_tokens=8, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
        ours = [entry[t] for t, entry in zip(PROMPT[1:], done.prompt_logprobs[1:])]
        layers = fused.linears()
        assert len(done.token_ids) == 8 and engine.stats()["kv_blocks_used"] == 0
    assert float_bytes / 4 < int8_bytes < float_bytes / 3.5  # int8 values and one fp32 scale per channel

    # transformers with the int8 weights dequantised (the head untied: the engine's embedding stays float)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = _dequantized(layers[f"layers.{i}.qkv"]).split(
                [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features])
            gate, up = _dequantized(layers[f"layers.{i}.gate_up"]).chunk(2)
            for module, weight in ((attn.q_proj, q), (attn.k_proj, k), (attn.v_proj, v), (mlp.gate_proj, gate),
                                   (mlp.up_proj, up), (attn.o_proj, _dequantized(layers[f"layers.{i}.o"])),
                                   (mlp.down_proj, _dequantized(layers[f"layers.{i}.down"]))):
                assert (weight - module.weight).abs().max() <= module.weight.abs().amax() / 200  # ~1/255 of the range
                module.weight = torch.nn.Parameter(weight)
        hf.lm_head.weight = torch.nn.Parameter(_dequantized(layers["lm_head"]))
        reference = hf(torch.tensor([PROMPT])).logits[0].log_softmax(-1)
    expected = [float(reference[p, t]) for p, t in enumerate(PROMPT[1:])]
    assert max(abs(a - b) for a, b in zip(ours, expected)) < 2e-4
    drift = sum(abs(a - b) for a, b in zip(ours, float_logprobs)) / len(ours)
    assert 1e-4 < drift < 0.1, drift  # the quantisation error: present, and small
