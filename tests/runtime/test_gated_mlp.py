"""`inplace_gated_mlps` gives bit-identical logits and leaves other MLPs alone."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenflow.runtime.cpu.packed_linear import pack_linears
from tokenflow.runtime.gated_mlp import inplace_gated_mlps, is_gated_silu_mlp
from tokenflow.testing import tiny_config


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_mlp_logits_are_bit_identical(arch: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    config = tiny_config(arch, hidden_size=256, intermediate_size=512, num_attention_heads=4)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    ids = torch.randint(3, 500, (2, 37))
    with torch.inference_mode():
        # The first forward of a process can split its GEMMs differently (seen ~1 run in 7 when
        # this test ran first): warm up so that only the MLP change is compared.
        model(ids)
        want = model(ids).logits
        assert inplace_gated_mlps(model) == config.num_hidden_layers
        got = model(ids).logits
    assert torch.equal(got, want)


def test_inplace_mlp_runs_over_packed_linears() -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32).eval()
    ids = torch.randint(3, 500, (1, 19))
    with torch.inference_mode():
        want = model(ids).logits
        pack_linears(model)
        packed = model(ids).logits
        inplace_gated_mlps(model)
        got = model(ids).logits
    assert torch.equal(got, packed)  # packing itself may move the last bits; the in-place MLP does not
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_other_mlps_are_not_gated_silu() -> None:
    class GeluMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = torch.nn.Linear(8, 16, bias=False)
            self.up_proj = torch.nn.Linear(8, 16, bias=False)
            self.down_proj = torch.nn.Linear(16, 8, bias=False)
            self.act_fn = torch.nn.GELU()

    gelu = GeluMLP()
    assert not is_gated_silu_mlp(gelu)
    gelu.act_fn = torch.nn.SiLU()
    assert is_gated_silu_mlp(gelu)
    gelu.up_proj = torch.nn.Linear(8, 16, bias=True)  # with a bias it is another shape
    assert not is_gated_silu_mlp(gelu)
