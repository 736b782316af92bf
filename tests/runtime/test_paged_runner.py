"""PagedModelRunner: packed, paged forwards equal the model's own forward.

Tiny random-weight models (2 layers, hidden 64) built from configs: same code path as the
real model, milliseconds per step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tokenflow.errors import ModelLoadError
from tokenflow.kv.block_pool import BlockPool
from tokenflow.kv.kv_cache import KVCache
from tokenflow.runtime.attention import matmul as matmul_attention
from tokenflow.runtime.attention.paged import UnsupportedAttentionFeature
from tokenflow.runtime.paged_runner import PagedModelRunner, SeqChunk, check_model_supported
from tokenflow.testing import tiny_config

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    initializer_range=0.1,  # peaked logits: greedy argmax has clear margins
)
BLOCK = 4

MODELS: dict[str, Callable[[], PreTrainedModel]] = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "llama-mha": lambda: LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_key_value_heads": 4})),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)),
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(**COMMON, pad_token_id=0)),
    "granite": lambda: GraniteForCausalLM(tiny_config("granite", **COMMON)),
    "olmo2": lambda: Olmo2ForCausalLM(tiny_config("olmo2", **COMMON)),
    "gemma": lambda: AutoModelForCausalLM.from_config(tiny_config("gemma", **COMMON)),
    "gemma3": lambda: AutoModelForCausalLM.from_config(tiny_config("gemma3", **COMMON)),
}


def _random_norms(model: PreTrainedModel) -> PreTrainedModel:
    """Norm weights away from ones, so that a norm skipped or given the wrong weight changes the output."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def build(name: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    torch.manual_seed(0)
    return _random_norms(MODELS[name]()).to(dtype).eval()


def make_runner(
    model: PreTrainedModel, num_blocks: int = 96, *, native_kernels: bool = True, **options: Any
) -> tuple[PagedModelRunner, BlockPool]:
    dtype = next(model.parameters()).dtype
    cache = KVCache.for_model(model.config, num_blocks=num_blocks, block_size=BLOCK, dtype=dtype)
    return PagedModelRunner(model, cache, native_kernels=native_kernels, **options), BlockPool(num_blocks, BLOCK)


class Seq:
    """A sequence as a test scheduler sees it: its tokens, how many are cached, its blocks."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)
        self.cached = 0
        self.blocks: list[int] = []

    def chunk(self, pool: BlockPool, n: int) -> SeqChunk:
        end = min(self.cached + n, len(self.tokens))
        self.blocks += pool.allocate(pool.blocks_needed(end) - len(self.blocks))
        c = SeqChunk(self.tokens[self.cached : end], self.cached, list(self.blocks), end == len(self.tokens))
        self.cached = end
        return c


def reference_logits(ref: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return ref(torch.tensor([tokens])).logits[0].float()  # [len, vocab]


@pytest.mark.parametrize("name", list(MODELS))
def test_mixed_batch_matches_model_forward(name: str) -> None:
    model = build(name)
    ref = copy.deepcopy(model)
    mixed_batch_matches_forward(name, ref, *make_runner(model))


def mixed_batch_matches_forward(name: str, ref: PreTrainedModel, runner: PagedModelRunner, pool: BlockPool) -> None:
    """Three sequences in mixed steps (a prompt in 10-token chunks beside two decoding ones): every sampled row's
    logits equal the model's own forward over the whole sequence (fp32)."""
    g = torch.Generator().manual_seed(1)
    full = {
        k: torch.randint(0, 256, (n,), generator=g).tolist() for k, n in (("long", 37), ("a", 6), ("b", 11))
    }
    # Teacher forcing: every sequence already "knows" its future tokens, so each step's sampled row
    # can be compared with the reference forward over the whole sequence.
    seqs = {"long": Seq(full["long"][:37]), "a": Seq(full["a"][:3]), "b": Seq(full["b"][:5])}
    refs = {k: reference_logits(ref, v) for k, v in full.items()}

    # step 1: short prompts whole, first chunk of the long one (not sampled)
    plan = [("a", 8), ("long", 10), ("b", 8)]
    for step in range(20):
        chunks = [seqs[k].chunk(pool, n) for k, n in plan]
        logits = runner.execute(chunks)
        sampled = [(k, c) for (k, _), c in zip(plan, chunks) if c.sample]
        assert logits.shape == (len(sampled), 256) and logits.dtype == torch.float32
        for row, (k, c) in zip(logits, sampled):
            want = refs[k][c.start_pos + len(c.token_ids) - 1]
            torch.testing.assert_close(row, want, atol=1e-4, rtol=1e-4, msg=f"{name} step {step} seq {k}")
            if len(seqs[k].tokens) < len(full[k]):
                seqs[k].tokens.append(full[k][len(seqs[k].tokens)])  # next decode token
        plan = [(k, 10 if k == "long" else 1) for k in ("b", "long", "a") if seqs[k].cached < len(full[k])]
        if not plan:
            break
    assert seqs["long"].cached == 37 and seqs["b"].cached == 11


@pytest.mark.parametrize("native", [False, True], ids=["torch-ops", "native-decode"])
@pytest.mark.parametrize("name", ["llama", "llama-mha", "qwen3"])
def test_bf16_cpu_kernels_is_transformers_eager_arithmetic(
    name: str, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 on CPU attends with bf16 matmuls: the same numbers as transformers' eager attention.

    With the native kernels the arithmetic is the same but fp32 sums run in another order and
    exp is another implementation: logits within a few bf16 roundings of eager's, same greedy token.
    """
    monkeypatch.setattr(matmul_attention, "QUERY_TILE", 4)  # chunks of 5-10 tokens span several tiles
    model = build(name, torch.bfloat16)
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    runner, pool = make_runner(model, native_kernels=native)
    assert runner.matmul_attention and (runner.native is not None) == native
    if not native:
        assert runner.last_self_check_error == 0.0
    g = torch.Generator().manual_seed(4)
    full = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (29, 7, 16)]
    refs = [reference_logits(ref, tokens) for tokens in full]
    seqs = [Seq(full[0][:29]), Seq(full[1][:5]), Seq(full[2][:9])]
    compared = 0
    for _ in range(12):  # chunks of up to 10 at growing offsets, next to decodes of different lengths
        active = [i for i, s in enumerate(seqs) if s.cached < len(full[i])]
        if not active:
            break
        chunks = [seqs[i].chunk(pool, 10) for i in active]
        logits = runner.execute(chunks)
        for row, (i, c) in zip(logits, [(i, c) for i, c in zip(active, chunks) if c.sample]):
            expected = refs[i][c.start_pos + len(c.token_ids) - 1]
            where = f"{name} seq {i} at {c.start_pos}"
            if native:
                assert (row.float() - expected.float()).norm() <= 2e-2 * expected.float().norm(), where
                assert row.argmax() == expected.argmax(), where
            else:
                assert torch.equal(row, expected), where
            compared += 1
            if len(seqs[i].tokens) < len(full[i]):
                seqs[i].tokens.append(full[i][len(seqs[i].tokens)])
    assert compared == 12 and all(s.cached == len(t) for s, t in zip(seqs, full))  # 1 + 3 + 8 rows


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral", "phi3", "granite", "olmo2", "gemma",
                                  "gemma3"])
def test_greedy_matches_generate(name: str) -> None:
    model = build(name)
    ref = copy.deepcopy(model)
    runner, pool = make_runner(model)
    assert runner.fused is not None  # every family here runs on the fused layers
    if name in ("olmo2", "gemma", "gemma3"):  # their norms and GELU run in the Python loop only (the C loop is
        assert runner.fused.native_layers is None  # Llama's placement, norms and SiLU)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 17, 30)]
    new = 10
    expected = []
    for p in prompts:
        out = ref.generate(
            torch.tensor([p]), do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0
        )
        expected.append(out[0, len(p) :].tolist())

    seqs = [Seq(p) for p in prompts]
    generated: list[list[int]] = [[] for _ in prompts]
    while any(len(x) < new for x in generated):
        active = [i for i in range(len(seqs)) if len(generated[i]) < new]
        chunks = [seqs[i].chunk(pool, 8) for i in active]  # prefill in chunks of 8, decodes of 1
        logits = runner.execute(chunks)
        it = iter(logits.argmax(-1).tolist())
        for i, c in zip(active, chunks):
            if c.sample:
                tok = next(it)
                generated[i].append(tok)
                seqs[i].tokens.append(tok)
    assert generated == expected
    for s in seqs:
        pool.free(s.blocks)
    assert pool.num_used == 0


def test_bf16_close_to_fp32() -> None:
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        runner, pool = make_runner(build("llama", dtype))
        g = torch.Generator().manual_seed(3)
        seqs = [Seq(torch.randint(0, 256, (n,), generator=g).tolist()) for n in (5, 13, 1)]
        out = []
        for _ in range(4):  # chunks of 4, decodes of 1, every last row sampled
            chunks = [s.chunk(pool, 4) for s in seqs if s.cached < len(s.tokens)]
            out.append(
                runner.execute([SeqChunk(c.token_ids, c.start_pos, c.block_table, True) for c in chunks])
            )
            for s in seqs:
                if s.cached == len(s.tokens) and len(s.tokens) < 16:
                    s.tokens.append(len(s.tokens))  # keep decoding
        runs[dtype] = torch.cat(out)
    fp32, bf16 = runs[torch.float32], runs[torch.bfloat16]
    assert ((bf16 - fp32).norm() / fp32.norm()).item() < 3e-2
    assert (bf16.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.8


def test_no_sampled_rows_and_bad_chunks() -> None:
    runner, pool = make_runner(build("llama"))
    seq = Seq(list(range(10)))
    first = seq.chunk(pool, 4)
    assert not first.sample
    assert runner.execute([first]).shape == (0, 256)
    with pytest.raises(ValueError, match="cannot hold"):
        runner.execute([SeqChunk([1, 2, 3], 4, first.block_table[:1], True)])
    with pytest.raises(ValueError):
        runner.execute([])


def test_model_is_bound_to_the_runner() -> None:
    model = build("llama")
    make_runner(model)
    assert model.config._attn_implementation == "tokenflow_paged"
    with pytest.raises(RuntimeError, match="PagedModelRunner"):
        model(torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("which", ["mistral", "qwen2", "gemma2"])
def test_the_models_own_window_and_softcap_match_its_forward_across_chunks(which: str) -> None:
    """A window of 8 (Mistral: every layer; Qwen2: from max_window_layers on; Gemma 2: alternate layers, with
    attention logit soft-capping) over 40 tokens in chunks and decodes: the model's own forward's logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = {"mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=8)),
             "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8,
                                                           max_window_layers=1)),
             "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(**{**COMMON, "head_dim": 16}, sliding_window=8,
                                                              attn_logit_softcapping=5.0))}[which]().eval()
    ref = copy.deepcopy(model)
    runner, pool = make_runner(model)
    assert runner.fused is None  # the HF modules pass each layer's window (and soft-cap) to paged attention
    tokens = torch.randint(0, 256, (44,), generator=torch.Generator().manual_seed(1)).tolist()
    want = reference_logits(ref, tokens)
    seq = Seq(tokens[:13])
    got = [runner.execute([seq.chunk(pool, 13)])[0]]
    for start, end in ((13, 30), (30, 40)):
        seq.tokens += tokens[start:end]
        got.append(runner.execute([seq.chunk(pool, end - start)])[0])
    for t in tokens[40:]:
        seq.tokens.append(t)
        got.append(runner.execute([seq.chunk(pool, 1)])[0])
    rows = [12, 29, 39, 40, 41, 42, 43]
    torch.testing.assert_close(torch.stack(got), want[rows], atol=1e-4, rtol=1e-4)


def test_window_wider_than_max_model_len_is_dense_and_guarded() -> None:
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=16)).eval()
    cache = KVCache.for_model(model.config, num_blocks=16, block_size=BLOCK, dtype=torch.float32)
    runner = PagedModelRunner(model, cache, max_model_len=16)  # self-check passes: window masks nothing
    pool = BlockPool(16, BLOCK)
    with pytest.raises(UnsupportedAttentionFeature, match="sliding_window=16"):
        runner.execute([Seq(list(range(20))).chunk(pool, 20)])  # past the window: refused, not wrong


def test_refuses_unknown_attention_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that sends the attention an argument it cannot honour fails the self-check."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaAttention.forward

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return original(self, *args, softcap=30.0, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", forward)
    model = build("llama")
    with pytest.raises(ModelLoadError, match="softcap"):
        make_runner(model)
    assert model.config._attn_implementation == "sdpa"  # left usable by the `hf` backend


def test_refuses_models_without_attention_or_with_alibi_by_name() -> None:
    """A state-space model has no attention to page, and ALiBi's per-head distance biases are no position in Q
    and K: each is refused at load with the feature named (not an AttributeError from the KV sizing)."""
    from transformers import (
        BloomConfig,
        BloomForCausalLM,
        FalconConfig,
        FalconForCausalLM,
        MambaConfig,
        MambaForCausalLM,
    )

    with pytest.raises(ModelLoadError, match=r"'mamba' uses layers without attention"):
        check_model_supported(MambaForCausalLM(MambaConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2)))
    bloom = BloomForCausalLM(BloomConfig(vocab_size=256, hidden_size=32, n_layer=2, n_head=4))
    with pytest.raises(ModelLoadError, match=r"'bloom' uses ALiBi"):
        check_model_supported(bloom)
    falcon = FalconForCausalLM(FalconConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, alibi=True))
    with pytest.raises(ModelLoadError, match=r"'falcon' uses ALiBi"):
        check_model_supported(falcon)


def test_cache_must_match_model() -> None:
    model = build("llama")
    wrong = KVCache(
        num_layers=2,
        num_kv_heads=4,
        head_dim=16,
        num_blocks=8,
        block_size=4,
        dtype=torch.float32,
        device="cpu",
    )
    with pytest.raises(ModelLoadError, match="geometry"):
        PagedModelRunner(model, wrong)
    bf16 = KVCache.for_model(model.config, num_blocks=8, block_size=4, dtype=torch.bfloat16)
    with pytest.raises(ModelLoadError, match="must match"):
        PagedModelRunner(model, bf16)


@pytest.mark.parametrize("slack", [0, 6, 1000])
def test_decode_groups_match_model_forward(slack: int) -> None:
    """Decodes of very different context lengths, in one group or split into several."""
    model = build("llama")
    ref = copy.deepcopy(model)
    runner, pool = make_runner(model)
    runner.decode_group_slack = slack
    g = torch.Generator().manual_seed(4)
    full = [torch.randint(0, 256, (n + 3,), generator=g).tolist() for n in (2, 9, 17, 30, 31, 9)]
    seqs = [Seq(f[:-3]) for f in full]
    refs = [reference_logits(ref, f) for f in full]
    runner.execute([s.chunk(pool, 64) for s in seqs])  # prefill everything
    for step in range(3):
        for s, f in zip(seqs, full):
            s.tokens.append(f[len(s.tokens)])
        chunks = [s.chunk(pool, 1) for s in seqs]
        logits = runner.execute(chunks)
        for row, c, want_all in zip(logits, chunks, refs):
            want = want_all[c.start_pos]
            torch.testing.assert_close(row, want, atol=1e-4, rtol=1e-4, msg=f"slack {slack} step {step}")


def test_refuses_position_dependent_rope() -> None:
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = LlamaForCausalLM(LlamaConfig(**COMMON, rope_parameters=rope))
    with pytest.raises(ModelLoadError, match="dynamic"):
        make_runner(model)


def test_the_last_layer_runs_past_attention_only_for_the_sampled_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only sampled rows are read after the last layer: its MLP sees those rows (none in a step whose chunks all
    stop short of their prompt's end), and their logits are the full forward's."""
    model = build("llama")
    ref = copy.deepcopy(model)
    runner, pool = make_runner(model)
    assert runner.fused is not None
    last = runner.fused.layers[-1]
    rows: list[int] = []
    norm = last.post_norm
    monkeypatch.setattr(last, "post_norm", lambda x: rows.append(x.shape[0]) or norm(x))
    g = torch.Generator().manual_seed(5)
    long, short = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 9))
    seqs = Seq(long), Seq(short)
    logits = runner.execute([seqs[0].chunk(pool, 20)])  # the first half of a prompt: nothing to sample
    assert logits.shape == (0, 256) and rows == []
    logits = runner.execute([seqs[0].chunk(pool, 20), seqs[1].chunk(pool, 9)])
    assert rows == [2]  # of 29 rows
    want = torch.stack([reference_logits(ref, long)[-1], reference_logits(ref, short)[-1]])
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_released_weights_go_as_the_layers_are_built_and_the_self_check_still_judges(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """release_weights: each HF layer's linear weights go once the fused layers hold packed copies (the load never
    holds three copies), the self-check's reference having run the real weights first: greedy output still equals
    generate's, and a fused loop that computes wrong still fails the check."""
    from tokenflow.runtime import fused_layers
    from tokenflow.runtime.cpu.packed_linear import packed_dtypes

    if dtype not in packed_dtypes():
        pytest.skip("oneDNN packs no weights of this dtype here: the loop reads the model's own")
    model = build("qwen3", dtype)
    ref = copy.deepcopy(model)
    cache = KVCache.for_model(model.config, num_blocks=64, block_size=BLOCK, dtype=dtype)
    runner = PagedModelRunner(model, cache, release_weights=True)
    assert runner.fused is not None and runner.fused.released and runner.fused.released_bytes > 0
    assert all(p.numel() == 0 for n, p in model.named_parameters() if n.endswith("proj.weight"))
    pool = BlockPool(64, BLOCK)
    prompt = list(range(3, 20))
    seq = Seq(prompt)
    logits = runner.execute([seq.chunk(pool, 32)])
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0, -1].float()
    if dtype == torch.float32:
        assert int(logits[0].argmax()) == int(want.argmax())
    assert ((logits[0] - want).norm() / want.norm()).item() < (1e-4 if dtype == torch.float32 else 3e-2)
    pool.free(seq.blocks)

    original = fused_layers._gated_product
    monkeypatch.setattr(fused_layers, "_gated_product", lambda *a: original(*a) * 1.5)  # a wrong MLP
    cache = KVCache.for_model(ref.config, num_blocks=64, block_size=BLOCK, dtype=dtype)
    with pytest.raises(ModelLoadError, match="differ"):
        PagedModelRunner(copy.deepcopy(ref), cache, release_weights=True)


async def test_an_engine_on_a_model_without_attention_refuses_it_at_start(tmp_path: Path) -> None:
    """The whole path a user takes: `Engine(folder)` on a Mamba checkpoint ends in a ModelLoadError naming the
    feature, not an error from inside the KV sizing."""
    from transformers import MambaConfig, MambaForCausalLM

    from tokenflow import Engine
    from tokenflow.testing import _train_tokenizer

    folder = tmp_path / "mamba"
    MambaForCausalLM(MambaConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2)).save_pretrained(folder)
    _train_tokenizer(400).save_pretrained(folder)
    with pytest.raises(ModelLoadError, match="'mamba' uses layers without attention"):
        async with Engine(folder):
            pass
