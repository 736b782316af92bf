"""Sampler semantics (vLLM v1 order), batch-independence of seeded rows, and logprobs."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenflow.params import SamplingParams
from tokenflow.runtime import sampler as sampler_mod
from tokenflow.runtime.sampler import Sampler, SamplerOutput, SamplingRow, make_generator

SMALL = 50
REAL = 49152
EOS = 0


def row(prompt=(), output=(), gen: torch.Generator | None = None, **kw) -> SamplingRow:
    params = SamplingParams(**kw)
    if params.seed is not None and gen is None:
        gen = make_generator(params.seed)
    return SamplingRow(params, list(prompt), list(output), gen, frozenset(params.stop_token_ids))


def draw(logits_row: torch.Tensor, n: int, seed: int = 0, vocab: int | None = None, **kw) -> Counter[int]:
    """Token frequencies over `n` independent draws (one batch of identical unseeded rows)."""
    torch.manual_seed(seed)
    sampler = Sampler(vocab or logits_row.shape[-1], [EOS])
    out = sampler.sample(logits_row.expand(n, -1).contiguous(), [row(**kw) for _ in range(n)])
    return Counter(out.token_ids)


def logits_from_probs(probs: list[float], vocab: int = SMALL) -> torch.Tensor:
    """A row whose softmax puts `probs` on tokens 1.. and a negligible rest elsewhere."""
    x = torch.full((vocab,), -30.0)
    x[1 : 1 + len(probs)] = torch.tensor(probs).log()
    return x


def assert_freqs(counts: Counter[int], expected: dict[int, float], n: int, tol: float = 0.02) -> None:
    assert set(counts) <= set(expected), f"unexpected tokens {set(counts) - set(expected)}"
    for tok, p in expected.items():
        assert abs(counts[tok] / n - p) < tol, (tok, counts[tok] / n, p)


# --- greedy / shapes -------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [SMALL, REAL])
def test_greedy_is_argmax(vocab: int) -> None:
    logits = torch.randn(16, vocab, generator=torch.Generator().manual_seed(1)) * 4
    out = Sampler(vocab, [EOS]).sample(logits, [row(temperature=0.0) for _ in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_tiny_temperature_is_greedy_and_empty_batch() -> None:
    logits = torch.randn(4, SMALL)
    out = Sampler(SMALL, [EOS]).sample(logits, [row(temperature=1e-7) for _ in range(4)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert Sampler(SMALL, [EOS]).sample(torch.empty(0, SMALL), []) == SamplerOutput([], None)
    with pytest.raises(ValueError):
        Sampler(SMALL, [EOS]).sample(torch.randn(3, SMALL), [row()])


def test_padding_columns_and_half_precision() -> None:
    base = torch.randn(8, SMALL) * 3
    wide = torch.cat([base, torch.full((8, 14), 100.0)], dim=1).bfloat16()
    sampler = Sampler(SMALL, [EOS])
    greedy = sampler.sample(wide, [row(temperature=0.0) for _ in range(8)])
    assert greedy.token_ids == wide[:, :SMALL].float().argmax(-1).tolist()
    sampled = sampler.sample(wide, [row(temperature=2.0, logprobs=1) for _ in range(8)])
    assert all(t < SMALL for t in sampled.token_ids)
    assert sampled.logprobs is not None
    ref = torch.log_softmax(wide[:, :SMALL].float(), -1)
    for i, lp in enumerate(sampled.logprobs):
        assert lp is not None and lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-5)


def test_input_logits_are_not_modified() -> None:
    logits = torch.randn(3, SMALL)
    before = logits.clone()
    rows = [
        row(prompt=[1, 2], output=[3], repetition_penalty=1.5, presence_penalty=1.0, min_tokens=5),
        row(output=[4, 4], frequency_penalty=0.5, temperature=0.7, top_p=0.5, min_p=0.1),
        row(temperature=0.0, min_tokens=2, stop_token_ids=[7]),
    ]
    Sampler(SMALL, [EOS]).sample(logits, rows)
    assert torch.equal(logits, before)


# --- truncation and temperature --------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [SMALL, REAL])
def test_top_k_1_and_tiny_top_p_are_argmax(vocab: int) -> None:
    logits = torch.randn(32, vocab, generator=torch.Generator().manual_seed(2))
    argmax = logits.argmax(-1).tolist()
    sampler = Sampler(vocab, [EOS])
    assert sampler.sample(logits, [row(temperature=1.5, top_k=1) for _ in range(32)]).token_ids == argmax
    assert sampler.sample(logits, [row(temperature=1.5, top_p=1e-6) for _ in range(32)]).token_ids == argmax


def test_top_k_keeps_k_tokens_renormalised() -> None:
    probs = [0.4, 0.3, 0.2, 0.1]
    n = 10000
    counts = draw(logits_from_probs(probs), n, top_k=3)
    assert_freqs(counts, {1: 0.4 / 0.9, 2: 0.3 / 0.9, 3: 0.2 / 0.9}, n)


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    n = 10000
    assert_freqs(draw(logits_from_probs(probs), n, top_p=0.7), {1: 0.5 / 0.8, 2: 0.3 / 0.8}, n)
    # 0.5 + 0.3 < 0.85: the third token is needed to reach p
    three = {1: 0.5 / 0.95, 2: 0.3 / 0.95, 3: 0.15 / 0.95}
    assert_freqs(draw(logits_from_probs(probs), n, top_p=0.85), three, n)


def test_top_p_applies_to_the_top_k_set() -> None:
    probs = [0.3, 0.25, 0.2, 0.15, 0.1]
    n = 10000
    # top_k=2 renormalises to 0.3/0.55 = 0.545 >= 0.5, so top_p=0.5 keeps one token only
    assert set(draw(logits_from_probs(probs), n, top_k=2, top_p=0.5)) == {1}


def test_min_p_filters_relative_to_top_token() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    n = 10000
    # threshold 0.25 * 0.5 = 0.125 drops the 0.05 token
    three = {1: 0.5 / 0.95, 2: 0.3 / 0.95, 3: 0.15 / 0.95}
    assert_freqs(draw(logits_from_probs(probs), n, min_p=0.25), three, n)
    assert set(draw(logits_from_probs(probs), n, min_p=0.7)) == {1}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies(temperature: float) -> None:
    logits = torch.full((SMALL,), -40.0)
    logits[[3, 7, 11, 20]] = torch.tensor([2.0, 1.0, 0.5, 0.0])
    n = 10000
    expected = torch.softmax(logits / temperature, -1)
    assert_freqs(draw(logits, n, temperature=temperature), {t: expected[t].item() for t in (3, 7, 11, 20)}, n)


def test_seeded_row_follows_the_distribution() -> None:
    logits = logits_from_probs([0.6, 0.3, 0.1])[None]
    sampler = Sampler(SMALL, [EOS])
    gen = make_generator(1234)
    n = 4000
    counts = Counter(sampler.sample(logits, [row(gen=gen, seed=1234)]).token_ids[0] for _ in range(n))
    assert_freqs(counts, {1: 0.6, 2: 0.3, 3: 0.1}, n, tol=0.03)


# --- penalties and min_tokens ----------------------------------------------------------------------


def greedy_token(logits: torch.Tensor, **kw) -> int:
    return Sampler(logits.shape[-1], [EOS]).sample(logits[None], [row(temperature=0.0, **kw)]).token_ids[0]


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    x = torch.full((SMALL,), -5.0)
    x[4], x[9] = 2.0, 1.8  # 2.0 / 1.2 = 1.67 < 1.8 but 2.0 / 1.1 = 1.82 > 1.8
    assert greedy_token(x, prompt=[4], repetition_penalty=1.2) == 9
    assert greedy_token(x, prompt=[4], repetition_penalty=1.1) == 4
    assert greedy_token(x, output=[4], repetition_penalty=1.2) == 9  # outputs count too
    y = torch.full((SMALL,), -5.0)
    y[4], y[9] = -1.0, -1.05  # -1.0 * 1.1 = -1.1 < -1.05 but -1.0 * 1.04 = -1.04 > -1.05
    assert greedy_token(y, prompt=[4], repetition_penalty=1.1) == 9
    assert greedy_token(y, prompt=[4], repetition_penalty=1.04) == 4


def test_presence_and_frequency_penalties_use_output_counts_only() -> None:
    x = torch.full((SMALL,), -5.0)
    x[4], x[9] = 2.0, 1.7
    assert greedy_token(x, output=[4], presence_penalty=0.35) == 9  # 1.65 < 1.7
    assert greedy_token(x, output=[4, 4, 4], presence_penalty=0.25) == 4  # once, whatever the count
    assert greedy_token(x, prompt=[4, 4], presence_penalty=2.0) == 4  # prompt tokens don't count
    x[9] = 1.75
    assert greedy_token(x, output=[4, 4, 4], frequency_penalty=0.1) == 9  # 2.0 - 0.3 = 1.7 < 1.75
    assert greedy_token(x, output=[4, 4, 4], frequency_penalty=0.05) == 4  # 1.85 > 1.75
    x[9] = -5.0
    assert greedy_token(x, output=[9, 9], frequency_penalty=-2.0) == 4  # -5 + 4 = -1 < 2
    assert greedy_token(x, output=[9, 9, 9, 9], frequency_penalty=-2.0) == 9  # -5 + 8 = 3 > 2


def reference_penalise(logits: torch.Tensor, rows: list[SamplingRow], eos: list[int]) -> torch.Tensor:
    """Per-token Python loops: the formulas as written in vLLM / the OpenAI docs."""
    out = logits.clone()
    vocab = out.shape[1]
    for i, r in enumerate(rows):
        p = r.params
        if len(r.output_token_ids) < p.min_tokens:
            for t in {*eos, *p.stop_token_ids}:
                if t < vocab:
                    out[i, t] = -math.inf
        for t in (set(r.prompt_token_ids) | set(r.output_token_ids)) & set(range(vocab)):
            v = out[i, t].item()
            out[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t, c in Counter(r.output_token_ids).items():
            if t < vocab:
                out[i, t] -= p.frequency_penalty * c + p.presence_penalty
    return out


def test_penalties_match_reference_formula() -> None:
    rng = random.Random(0)
    logits = torch.randn(12, SMALL, generator=torch.Generator().manual_seed(3)) * 3
    rows = []
    for i in range(12):
        kw = {}
        if i % 4 != 3:  # some rows without any penalty
            kw = dict(
                repetition_penalty=rng.choice([1.0, 0.8, 1.3]),
                presence_penalty=rng.choice([0.0, 0.5, -0.7]),
                frequency_penalty=rng.choice([0.0, 0.3, -1.1]),
            )
        # ids past the logits' width (tokenizer-only added tokens) are ignored
        prompt = [rng.randrange(SMALL + 5) for _ in range(rng.randrange(0, 30))]
        output = [rng.randrange(SMALL + 5) for _ in range(rng.randrange(0, 30))]
        rows.append(row(prompt, output, min_tokens=rng.choice([0, 10, 40]), stop_token_ids=[5, 6], **kw))
    got = logits.clone()
    Sampler(SMALL, [EOS, 1])._adjust(got, rows)
    torch.testing.assert_close(got, reference_penalise(logits, rows, [EOS, 1]), rtol=1e-6, atol=1e-6)


def test_penalties_in_a_regrouped_batch() -> None:
    """Sampled rows are regrouped by truncation stage; penalties must follow their rows."""
    rng = random.Random(1)
    vocab = 300
    logits = torch.randn(24, vocab, generator=torch.Generator().manual_seed(8))
    shapes = [
        dict(temperature=0.0),
        dict(top_k=1),
        dict(top_k=1, top_p=0.5),
        dict(top_k=1, min_p=0.5),
        dict(min_p=1.0),
        dict(top_p=1e-6),
        dict(top_k=100, top_p=1e-6),
    ]
    rows = []
    for i in range(24):
        output = [int(logits[i].argmax())] + [rng.randrange(vocab) for _ in range(5)]
        pen = dict(repetition_penalty=2.0) if i % 3 else dict(presence_penalty=1.5, frequency_penalty=0.5)
        rows.append(row([rng.randrange(vocab) for _ in range(5)], output, **pen, **shapes[i % len(shapes)]))
    sampler = Sampler(vocab, [EOS])
    expected = reference_penalise(logits, rows, [EOS]).argmax(-1).tolist()
    for _ in range(2):  # again, with the scratch buffers already warm
        assert sampler.sample(logits, rows).token_ids == expected
    assert sampler.sample(logits[:5], rows[:5]).token_ids == expected[:5]


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    x = torch.zeros(SMALL)
    x[EOS], x[7], x[12] = 5.0, 4.0, 3.0
    kw = dict(min_tokens=3, stop_token_ids=[7])
    assert greedy_token(x, output=[1, 2], **kw) == 12
    assert greedy_token(x, output=[1, 2, 3], **kw) == EOS
    sampler = Sampler(SMALL, [EOS])
    out = sampler.sample(x.expand(500, -1), [row(output=[1], temperature=5.0, **kw) for _ in range(500)])
    assert {EOS, 7}.isdisjoint(out.token_ids)


# --- seeded rows: independent of batch composition and order -------------------------------------


@pytest.mark.parametrize("vocab", [SMALL, REAL])
def test_seeded_rows_ignore_batch_composition_and_order(vocab: int) -> None:
    gen = torch.Generator().manual_seed(5)
    steps = 6
    targets = [
        dict(temperature=0.9, top_p=0.9, seed=7),
        dict(temperature=1.3, top_k=40, min_p=0.02, seed=-3, repetition_penalty=1.2),
        dict(temperature=1.0, seed=2**40),
    ]
    # peaked rows resolve in the candidate stages; flat ones need the full sort
    logits = [torch.randn(len(targets), vocab, generator=gen) * (4.0 if s % 2 else 1.0) for s in range(steps)]

    def run(batched: bool) -> list[list[int]]:
        sampler = Sampler(vocab, [EOS])
        gens = [make_generator(t["seed"]) for t in targets]
        outputs: list[list[int]] = [[] for _ in targets]
        rng = random.Random(11)
        for s in range(steps):
            rows = [(logits[s][j], row([1, 2], outputs[j], gen=gens[j], **t)) for j, t in enumerate(targets)]
            if batched:
                for k in range(rng.randrange(1, 9)):
                    other = dict(temperature=rng.choice([0.0, 0.7, 1.5]), top_p=rng.choice([1.0, 0.8]))
                    if k % 3 == 0:
                        other["seed"] = rng.randrange(100)
                    rows.append((torch.randn(vocab, generator=gen) * rng.choice([1, 5]), row(**other)))
                rng.shuffle(rows)
            else:
                rows = rows[:]
            tokens: dict[int, int] = {}
            chunks = [[r] for r in rows] if not batched else [rows]
            for chunk in chunks:
                out = sampler.sample(torch.stack([x for x, _ in chunk]), [r for _, r in chunk])
                for (_, r), tok in zip(chunk, out.token_ids, strict=True):
                    if r.generator in gens:
                        tokens[gens.index(r.generator)] = tok
            for j in range(len(targets)):
                outputs[j].append(tokens[j])
        return outputs

    alone = run(batched=False)
    assert run(batched=True) == alone
    assert len({tuple(o) for o in alone}) > 1


def test_make_generator_uses_the_whole_seed() -> None:
    def first(seed: int) -> float:
        return torch.rand(1, generator=make_generator(seed)).item()

    assert first(42) == first(42)
    assert first(-1) == first(2**64 - 1)  # the same 64-bit seed
    assert len({first(1), first(2**32 + 1), first(-1), first(2**64 - 2), first(-(2**63))}) == 5


def test_candidate_stages_match_full_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    """Top-k/top-p rows resolved among 64, 1024 or 8192 candidates draw exactly what the full sort draws.

    The spread of scales and parameters sends rows to every stage (29 / 9 / 15 / 11 of the 64)."""
    vocab = 16384
    gen = torch.Generator().manual_seed(9)
    scale = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 6.0]).repeat(11)[:64, None]
    logits = (torch.randn(64, vocab, generator=gen) * scale).bfloat16()  # bf16: plenty of exact ties
    combos = [
        dict(top_p=0.9),
        dict(top_k=50),
        dict(top_k=50, top_p=0.8),
        dict(top_k=700, top_p=0.95),
        dict(top_k=2000),
        dict(top_p=0.5, min_p=0.01),
        dict(top_k=5, top_p=0.99),
        dict(top_p=0.7),
        dict(top_k=9000, top_p=0.9),
    ]
    params = [dict(temperature=0.8, seed=100 + i, **combos[i % len(combos)]) for i in range(64)]

    def run() -> list[int]:
        return Sampler(vocab, [EOS]).sample(logits, [row(**p) for p in params]).token_ids

    staged = run()
    monkeypatch.setattr(sampler_mod, "_STAGES", ())
    assert run() == staged


# --- logprobs and mixed batches --------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [SMALL, REAL])
def test_logprobs_are_raw_log_softmax(vocab: int) -> None:
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(4)) * 3
    rows = [
        row(output=[1, 1], logprobs=5, temperature=0.5, repetition_penalty=1.5, frequency_penalty=1.0),
        row(logprobs=None),
        row(logprobs=0, temperature=0.0, presence_penalty=2.0, output=[int(logits[2].argmax())]),
        row(logprobs=20, top_k=3, seed=3),
    ]
    out = Sampler(vocab, [EOS]).sample(logits, rows)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.logprobs[1] is None
    for i in (0, 2, 3):
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-5)
        k = rows[i].params.logprobs or 0
        values, ids = ref[i].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert list(lp.top) == ids.tolist()
        assert list(lp.top.values()) == pytest.approx(values.tolist(), abs=1e-5)
    assert out.logprobs[2].top == {}


def test_mixed_batch_of_greedy_and_sampled_rows() -> None:
    logits = torch.randn(10, REAL, generator=torch.Generator().manual_seed(6)) * 3
    argmax = logits.argmax(-1).tolist()
    kinds = ["greedy", "sampled", "greedy", "topk1", "sampled", "greedy", "seeded", "topk1", "greedy", "minp"]
    spec = {
        "greedy": dict(temperature=0.0),
        "sampled": dict(temperature=0.8, top_p=0.9),
        "topk1": dict(top_k=1),
        "seeded": dict(seed=1, top_k=20),
        "minp": dict(min_p=1.0),
    }
    out = Sampler(REAL, [EOS]).sample(logits, [row(**spec[k]) for k in kinds])
    for i, k in enumerate(kinds):
        if k in ("greedy", "topk1", "minp"):
            assert out.token_ids[i] == argmax[i], k
        elif k == "seeded":
            assert out.token_ids[i] in logits[i].topk(20).indices.tolist()
        else:
            assert 0 <= out.token_ids[i] < REAL


# --- property: the drawn token is always one the reference filters allow ---------------------------


def allowed(x: torch.Tensor, p: SamplingParams, output: list[int], tol: float = 1e-4) -> set[int]:
    """Tokens a naive, float64 reference keeps (loosely at the p / min_p cuts, to absorb rounding)."""
    s = reference_penalise(x[None].double(), [SamplingRow(p, [], output, None)], [EOS])[0]
    if p.temperature < 1e-5:
        return {t for t in range(len(s)) if s[t] == s.max()}
    s = s / p.temperature
    finite = [t for t in range(len(s)) if s[t] > -math.inf]
    probs = torch.softmax(s, -1)
    keep = {t for t in finite if probs[t] >= p.min_p * probs.max() * (1 - tol)}
    if 0 < p.top_k < len(s):
        kth = sorted((s[t].item() for t in keep), reverse=True)[min(p.top_k, len(keep)) - 1]
        keep = {t for t in keep if s[t] >= kth}
    if p.top_p < 1.0:
        z = torch.logsumexp(s[sorted(keep)], 0)
        order = sorted(keep, key=lambda t: -s[t].item())
        mass, kept = 0.0, set()
        for t in order:
            if mass >= p.top_p + tol:
                break
            kept.add(t)
            mass += math.exp(s[t].item() - z.item())
        keep = {t for t in keep if s[t] >= min(s[t2].item() for t2 in kept)}
    return keep


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]),
    top_k=st.integers(0, 14),
    top_p=st.sampled_from([1.0, 0.95, 0.6, 0.2]),
    min_p=st.sampled_from([0.0, 0.05, 0.5]),
    repetition_penalty=st.sampled_from([1.0, 1.5]),
    presence_penalty=st.sampled_from([0.0, 1.0]),
    min_tokens=st.integers(0, 3),
)
def test_drawn_token_is_allowed(data: st.DataObject, **kw: float) -> None:
    vocab = 12
    values = data.draw(st.lists(st.integers(-8, 8), min_size=vocab, max_size=vocab))
    x = torch.tensor(values, dtype=torch.float32) / 2  # half-integers: many exact ties
    output = data.draw(st.lists(st.integers(0, vocab - 1), max_size=4))
    p = SamplingParams(**kw, seed=data.draw(st.integers(0, 2**32)))
    r = SamplingRow(p, [], output, make_generator(p.seed or 0))
    token = Sampler(vocab, [EOS]).sample(x[None], [r]).token_ids[0]
    assert token in allowed(x, p, output)


# -- total sampling: a bad row fails alone ------------------------------------------------------
BAD_ROWS = {"nan": float("nan"), "+inf": float("inf"), "all -inf": float("-inf")}


@pytest.mark.parametrize("kind", list(BAD_ROWS))
@pytest.mark.parametrize("mode", ["greedy", "sampled", "top_k", "mixed"])
def test_a_non_finite_row_fails_alone(kind: str, mode: str) -> None:
    logits = torch.randn(6, SMALL, generator=torch.Generator().manual_seed(1)) * 3
    bad = 2
    if kind == "all -inf":
        logits[bad] = float("-inf")
    else:
        logits[bad, 7] = BAD_ROWS[kind]
    kws = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.9, seed=3),
           "top_k": dict(temperature=0.9, top_k=5, seed=3)}
    rows = [row(**(kws[mode] if mode != "mixed" else list(kws.values())[i % 3]), logprobs=2) for i in range(6)]
    out = Sampler(SMALL, [EOS]).sample(logits, rows)
    assert set(out.failed) == {bad} and out.failed[bad].model_fault
    assert out.logprobs is not None and out.logprobs[bad] is None
    good = [i for i in range(6) if i != bad]  # the others drew exactly what they draw without the bad row
    fresh = [row(**(kws[mode] if mode != "mixed" else list(kws.values())[i % 3]), logprobs=2) for i in good]
    alone = Sampler(SMALL, [EOS]).sample(logits[good], fresh)
    assert [out.token_ids[i] for i in good] == alone.token_ids and not alone.failed
    assert all(0 <= out.token_ids[i] < SMALL for i in good)


def test_degenerate_parameters_fail_their_row_as_the_callers_fault() -> None:
    """SamplingParams built directly skip validation: a penalty of 1e-300 turns logits into inf."""
    logits = torch.randn(3, SMALL, generator=torch.Generator().manual_seed(2)) * 3
    rows = [row([4, 5, 6], [7], temperature=1.0, seed=1), row([4, 5, 6], [7], temperature=1.0, seed=1,
                                                                repetition_penalty=1e-300),
            row(range(SMALL), [], temperature=0.0, repetition_penalty=1e-300)]  # some logit > 0: divided by 0
    out = Sampler(SMALL, [EOS]).sample(logits, rows)
    assert set(out.failed) == {1, 2} and not any(f.model_fault for f in out.failed.values())
    assert 0 <= out.token_ids[0] < SMALL


def test_an_out_of_vocabulary_draw_is_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last guard: whatever the draw returns, an id past the vocabulary never leaves the sampler."""
    monkeypatch.setattr(sampler_mod, "inverse_cdf", lambda logits, u, scratch: torch.full_like(u, SMALL).long())
    logits = torch.randn(2, SMALL)
    out = Sampler(SMALL, [EOS]).sample(logits, [row(temperature=1.0), row(temperature=0.0)])
    assert set(out.failed) == {0}


def test_redraw_equals_a_second_sample_under_the_masks() -> None:
    """A constrained row refused its unconstrained token is drawn again from the tempered logits the first
    draw kept: the same token a second `sample` of those rows with their masks draws (same generators),
    penalties and temperatures included; a mask leaving nothing finite fails only its row."""
    from tokenflow.structured.bitmask import StepMasks

    vocab, n = 300, 6
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(5)) * 3
    params = [SamplingParams(temperature=t, repetition_penalty=r, max_tokens=4)
              for t, r in zip((1.0, 0.7, 1.5, 1.0, 0.9, 1.2), (1.0, 1.3, 1.0, 1.0, 1.0, 1.0), strict=True)]
    words = torch.zeros(3, (vocab + 31) // 32, dtype=torch.int32)
    words[0, 0] = 0b1011  # tokens 0, 1, 3
    words[1, 2:5] = -1  # tokens 64..159
    words[2, -1] = 1 << 3  # token 291, sent to -inf by the logits below: nothing finite is left
    logits[4, 291] = float("-inf")
    picked = [1, 2, 4]

    def rows() -> list[SamplingRow]:
        return [SamplingRow(p, [7, 8, 9], [3, 4], make_generator(100 + i)) for i, p in enumerate(params)]

    twice, once = Sampler(vocab, [0]), Sampler(vocab, [0])
    first_rows, again_rows = rows(), rows()
    first = twice.sample(logits, first_rows)
    expected = twice.sample(logits[picked], [first_rows[j] for j in picked], StepMasks([0, 1, 2], words, {}))
    assert once.sample(logits, again_rows).token_ids == first.token_ids
    assert all(once.redrawable(j) for j in picked)
    got = once.redraw(picked, again_rows, StepMasks([0, 1, 2], words, {}))
    assert got.token_ids[:2] == expected.token_ids[:2]
    assert got.token_ids[0] in (0, 1, 3) and 64 <= got.token_ids[1] < 160
    assert set(got.failed) == set(expected.failed) == {2}
    greedy = Sampler(vocab, [0])
    greedy.sample(logits, [SamplingRow(SamplingParams(temperature=0.0), [], [])] * n)
    assert not greedy.redrawable(0)  # greedy rows are sampled again, not redrawn


def test_redraw_rejecting_draws_from_the_distribution_restricted_to_the_accepted_set() -> None:
    """Fresh draws until one is accepted: tokens 2 and 3 (45% of the mass) come back in the ratio of their
    probabilities; rows whose accepted set is never hit within `tries` are left to the masked redraw."""
    probs = [0.3, 0.25, 0.3, 0.15]
    logits = logits_from_probs(probs).expand(2000, -1).contiguous()
    rows = [row(seed=i) for i in range(2000)]
    sampler = Sampler(SMALL, [EOS])
    first = sampler.sample(logits, rows)
    refused = [i for i, t in enumerate(first.token_ids) if t not in (3, 4)]
    found = sampler.redraw_rejecting(refused, rows, lambda _, t: t in (3, 4), tries=16)
    assert len(found) > 0.99 * len(refused)  # P(no hit in 16 tries) = 0.55 ** 16 < 1e-4
    kept = [t for i, t in enumerate(first.token_ids) if i not in found and t in (3, 4)] + list(found.values())
    assert_freqs(Counter(kept), {3: 0.3 / 0.45, 4: 0.15 / 0.45}, len(kept), tol=0.04)
    never = sampler.redraw_rejecting(refused[:5], rows, lambda _, t: False, tries=4)
    assert never == {}
