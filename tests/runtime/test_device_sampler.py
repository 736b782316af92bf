"""DeviceSampler: the tokens the host `Sampler` draws, drawn with device operations only.

The oracle is the host sampler itself: both draw each row's uniform from the row's own generator, so
with generators seeded alike they must pick the same token for every row, step after step, penalties and
biases included (those the device keeps per request and advances itself; the host recomputes them). Running
the sampler on the `meta` device proves it reads nothing back from the device (any `.item()`,
`.tolist()` or branch on a value raises there), which is what lets a CUDA graph hold it."""

from __future__ import annotations

import math
from collections.abc import Sequence

import anyio
import pytest
import torch

from tokenflow import Engine
from tokenflow.params import SamplingParams
from tokenflow.runtime.backends import paged
from tokenflow.runtime.device_sampler import DeviceSampler, draw_of, variant_of
from tokenflow.runtime.sampler import Sampler, SamplingRow, make_generator

VOCAB = 300

RANDOM = [dict(temperature=0.7), dict(temperature=1.0), dict(temperature=1.6, min_p=0.05), dict(temperature=0.3)]
TRUNCATED = [
    dict(temperature=1.0, top_k=5), dict(temperature=0.8, top_k=1), dict(temperature=1.0, top_p=0.9),
    dict(temperature=1.2, top_k=20, top_p=0.3), dict(temperature=0.9, min_p=0.1, top_p=0.8),
    dict(temperature=1.0, top_k=VOCAB + 100), dict(temperature=2.0, top_k=50, top_p=0.95, min_p=0.02),
]
GREEDY = [dict(temperature=0.0), dict(temperature=1e-6)]
ADJUSTED = [
    dict(temperature=0.0, repetition_penalty=1.5), dict(temperature=1.0, frequency_penalty=0.8),
    dict(temperature=0.9, presence_penalty=1.2, top_p=0.9), dict(temperature=1.0, logit_bias={7: 5.0, 299: -3.0}),
    dict(temperature=0.0, min_tokens=12, stop_token_ids=[11, 12]), dict(temperature=1.1, top_k=10,
                                                                       repetition_penalty=0.7, frequency_penalty=-0.5),
    dict(temperature=0.0, logit_bias={3: 100.0}, presence_penalty=2.0, frequency_penalty=2.0),
]


def _rows(kinds: Sequence[dict], seed: int, outputs: Sequence[list[int]] | None = None) -> list[SamplingRow]:
    """A row per kind, each seeded: the same call twice gives two rows with identical generators. `outputs`:
    each row's output list (shared by the host's and the device's rows of one test)."""
    outputs = outputs or [[3] for _ in kinds]
    return [SamplingRow(SamplingParams(**kind, seed=seed + j), [1, 2, 11, 40], outputs[j], make_generator(seed + j),
                        frozenset(kind.get("stop_token_ids", ())))
            for j, kind in enumerate(kinds)]


def _logits(rows: int, step: int) -> torch.Tensor:
    """Logits in steps of 0.25, so rows hold ties (at the argmax and at a top-k cut), some at -inf."""
    g = torch.Generator().manual_seed(1000 + step)
    x = (torch.randn(rows, VOCAB, generator=g) * 3).mul(4).round().div(4)
    x[:, torch.randint(0, VOCAB, (40,), generator=g)] = float("-inf")
    return x


@pytest.mark.parametrize(("kinds", "variant"), [
    (GREEDY * 3, "greedy"),
    (RANDOM + GREEDY, "random"),
    (TRUNCATED + RANDOM + GREEDY, "truncated"),
    (ADJUSTED + GREEDY, "truncated"),
    ([dict(temperature=0.0, logprobs=0), dict(temperature=0.9, logprobs=5), dict(temperature=1.0)], "random"),
    ([dict(temperature=1.0, top_p=0.8, logprobs=2, repetition_penalty=1.4), *GREEDY], "truncated"),
])
def test_tokens_equal_the_host_samplers_step_after_step(kinds: list[dict], variant: str) -> None:
    """Each row's output grows by its token; every 7th step only the host samples (as when a neighbour asks
    for logprobs), so the device's per-request penalty state is stale after it and must be filled again."""
    outputs = [[3] for _ in kinds]
    host_rows, device_rows = _rows(kinds, 7, outputs), _rows(kinds, 7, outputs)
    num_adjusted = sum(bool(k.keys() & {"repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias",
                                        "min_tokens"}) for k in kinds)
    adjusted = num_adjusted > 0
    assert variant_of(device_rows, VOCAB) == variant
    host = Sampler(VOCAB, eos_token_ids=[0, 1])
    device = DeviceSampler(len(kinds) + 3, VOCAB, torch.device("cpu"), eos_token_ids=[0, 1])
    compared = 0
    for step in range(40):
        logits = _logits(len(kinds), step)
        logits[:, [0, 1, 11, 12]] += 4.0  # EOS and stop ids likely, so the min_tokens mask matters
        expected = host.sample(logits, host_rows)
        assert not expected.failed
        if step % 7 == 6:
            for row in device_rows:  # the host's draw: consume the device rows' generators alike
                if row.params.temperature >= 1e-5:
                    torch.rand(1, generator=row.generator)
        else:
            device.stage(device_rows)
            padded = torch.cat([logits, torch.zeros(len(kinds), 5)], 1)  # logits past the vocabulary are padding
            got = device.sample(padded, variant, adjusted)
            if adjusted:
                device.record(got)
                device.recorded()
            assert got.tolist() == expected.token_ids, f"step {step}"
            compared += len(got)
            width = draw_of(device_rows, VOCAB).logprobs
            if width >= 0:
                chosen, top_v, top_i = (t.tolist() for t in device.logprobs(padded, got, width))
                entries = device.token_logprobs(device_rows, got.tolist(), chosen, top_v, top_i)
                assert expected.logprobs is not None and len(entries) == len(expected.logprobs)
                for mine, theirs in zip(entries, expected.logprobs):
                    assert (mine is None) == (theirs is None)
                    if mine is not None and theirs is not None:
                        assert mine.token_id == theirs.token_id and list(mine.top) == list(theirs.top)
                        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-5)
                        assert list(mine.top.values()) == pytest.approx(list(theirs.top.values()), abs=1e-5)
        for out, token in zip(outputs, expected.token_ids):
            out.append(token)
    assert compared == 35 * len(kinds)
    if adjusted:
        assert device.logit_state is not None
        fills = device.logit_state.num_fills
        assert num_adjusted * 5 <= fills <= num_adjusted * 6  # the first step, then after each host-only step


def test_a_seeded_row_draws_the_same_token_alone_and_among_others() -> None:
    """Alone it takes the "random" variant, among top-k neighbours the "truncated" one (a sort of every
    row): its token depends on its own logits and generator only."""
    device = DeviceSampler(8, VOCAB, torch.device("cpu"))
    for step in range(30):
        logits = _logits(8, step)
        alone = _rows([dict(temperature=0.9)], 11)
        device.stage(alone)
        mine = device.sample(logits[:1], variant_of(alone, VOCAB)).tolist()
        crowd = _rows([dict(temperature=0.9)], 11) + _rows([dict(temperature=1.0, top_k=3)] * 7, 50 + step)
        assert variant_of(crowd, VOCAB) == "truncated"
        device.stage(crowd)
        assert device.sample(logits, "truncated").tolist()[0] == mine[0]


def test_rows_whose_logits_are_not_finite_come_back_as_minus_one() -> None:
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.0, top_p=0.5), dict(temperature=0.0)]
    logits = _logits(4, 0)
    logits[0, 5] = float("nan")
    logits[1] = float("-inf")
    logits[2, 9] = float("inf")
    device = DeviceSampler(4, VOCAB, torch.device("cpu"))
    device.stage(_rows(kinds, 3))
    tokens = device.sample(logits, "truncated").tolist()
    host = Sampler(VOCAB, eos_token_ids=[0]).sample(logits, _rows(kinds, 3))
    assert tokens[:3] == [-1, -1, -1] and sorted(host.failed) == [0, 1, 2]
    assert tokens[3] == host.token_ids[3] >= 0  # the finite neighbour is unaffected


@pytest.mark.parametrize("adjusted", [False, True])
@pytest.mark.parametrize("variant", ["greedy", "random", "truncated"])
def test_sampling_reads_nothing_back_from_the_device(variant: str, adjusted: bool) -> None:
    """On `meta` tensors every value read (`.item()`, `.tolist()`, `if tensor`) raises: the sampler runs
    there, so a CUDA graph can record it and no step waits for the device before the next is queued."""
    device = DeviceSampler(16, VOCAB, torch.device("meta"), eos_token_ids=[0])
    device.stage(_rows((ADJUSTED if adjusted else []) + TRUNCATED + RANDOM, 1)[:16])
    tokens = device.sample(torch.empty(16, VOCAB + 4, device="meta"), variant, adjusted)  # type: ignore[arg-type]
    if adjusted:
        device.record(tokens)
    assert tokens.shape == (16,) and tokens.dtype == torch.long and tokens.device.type == "meta"
    with pytest.raises(Exception):  # noqa: B017 - the check above means something only if reads raise here
        tokens.tolist()


def test_drawn_frequencies_follow_top_k_then_top_p() -> None:
    """4,000 unseeded draws of one row: top_k=6 keeps 6 tokens, top_p=0.8 of their renormalised mass keeps
    the first 3 (0.4 + 0.25 + 0.2 reaches it): each is drawn at its renormalised probability."""
    probs = [0.4, 0.25, 0.2, 0.1, 0.03, 0.015, 0.005]
    logits = torch.full((VOCAB,), -30.0)
    logits[[10, 20, 30, 40, 50, 60, 70]] = torch.tensor(probs).log()
    rows = [SamplingRow(SamplingParams(temperature=1.0, top_k=6, top_p=0.8), [], [])] * 4000
    device = DeviceSampler(len(rows), VOCAB, torch.device("cpu"))
    torch.manual_seed(0)
    device.stage(rows)
    tokens = device.sample(logits.expand(len(rows), -1), "truncated")
    counts = torch.bincount(tokens, minlength=VOCAB)
    assert set(torch.nonzero(counts).flatten().tolist()) == {10, 20, 30}
    kept = probs[0] + probs[1] + probs[2]
    for token, p in ((10, probs[0] / kept), (20, probs[1] / kept), (30, probs[2] / kept)):
        sd = math.sqrt(len(rows) * p * (1 - p))
        assert abs(counts[token].item() - len(rows) * p) < 4 * sd, (token, counts[token].item(), len(rows) * p)




async def test_a_seeded_request_gets_the_same_tokens_whichever_sampler_draws_its_steps(
    tiny_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps at fixed shapes (as CUDA graphs replay them; eager here) draw on the device; while the
    JSON-constrained request is in the batch its steps go to the host sampler instead, so the other
    requests' streams (penalties, biases and logprobs included) cross from one sampler to the other
    mid-request. Every output equals the run where the host sampler draws every step."""
    monkeypatch.setattr(paged, "decode_graph_mode", lambda config, device: "eager")
    requests = [dict(temperature=0.8, top_p=0.9, seed=1, repetition_penalty=1.3),
                dict(temperature=1.0, seed=2, frequency_penalty=0.7, presence_penalty=0.4),
                dict(temperature=1.2, top_k=8, min_p=0.05, seed=3, logit_bias={100: 3.0}),
                dict(temperature=0.0, repetition_penalty=1.8, min_tokens=20),
                dict(temperature=0.9, seed=4, logprobs=3),
                dict(temperature=0.0, max_tokens=6, json_object=True)]

    async def run_together() -> tuple[list, dict]:
        async with Engine(tiny_model, num_kv_blocks=128, max_num_seqs=8) as engine:
            results: list = [None] * len(requests)

            async def one(i: int) -> None:
                params = {"max_tokens": 24, "ignore_eos": True, **requests[i]}
                results[i] = await engine.generate(f"prompt number {i}", **params)

            async with anyio.create_task_group() as tg:
                for i in range(len(requests)):
                    tg.start_soon(one, i)
            return results, engine.stats()

    on_device, stats = await run_together()
    monkeypatch.setattr(paged, "device_rows", lambda plan: None)
    on_host, host_stats = await run_together()
    assert [c.token_ids for c in on_device] == [c.token_ids for c in on_host]
    assert [len(c.token_ids) for c in on_device[:5]] == [24] * 5 and 1 <= len(on_device[5].token_ids) <= 6
    mine, theirs = on_device[4].logprobs, on_host[4].logprobs
    assert mine is not None and theirs is not None and len(mine) == len(theirs) == 24
    for a, b in zip(mine, theirs):
        assert a.token_id == b.token_id and list(a.top) == list(b.top) and len(a.top) == 3
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert stats["device_sampled_steps"] >= 15 and host_stats["device_sampled_steps"] == 0
    assert stats["fixed_shape_decode_steps"] >= 20


def test_a_failed_step_leaves_no_phantom_token_in_the_penalty_state() -> None:
    """The step's graph counted its drawn token, then the step failed, so the request never took the token:
    its slot is filled again from the host's view before the next draw, which equals the host sampler's."""
    outputs = [[3]]
    kinds = [dict(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0)]
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 8] = 5.0, 4.5  # token 7 wins unless a phantom count of it takes 4 off
    device = DeviceSampler(2, VOCAB, torch.device("cpu"))
    device.stage(_rows(kinds, 5, outputs))
    device.record(device.sample(logits, "greedy", adjusted=True))
    device.forget_staged()
    device.stage(_rows(kinds, 5, outputs))
    expected = Sampler(VOCAB, eos_token_ids=[0]).sample(logits, _rows(kinds, 5, outputs)).token_ids
    assert device.sample(logits, "greedy", adjusted=True).tolist() == expected == [7]
