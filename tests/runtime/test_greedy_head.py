"""The greedy head (tokenflow.runtime.cpu.greedy_head): the fp32 few-rows head's argmax from bf16 estimates."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenflow.params import SamplingParams
from tokenflow.runtime.cpu.few_rows_linear import FewRowsLinear, few_rows_linear, load_few_rows_kernels
from tokenflow.runtime.cpu.greedy_head import GreedyHead, greedy_head_for
from tokenflow.runtime.sampler import SamplingRow, plain_greedy

kernels = load_few_rows_kernels()
pytestmark = pytest.mark.skipif(kernels is None or torch.bfloat16 not in kernels.dtypes,
                                reason="the greedy head needs the few-rows kernel with AVX512-BF16")


def _head(weight: torch.Tensor, valid: int | None = None) -> tuple[FewRowsLinear, GreedyHead]:
    head = few_rows_linear(weight, None, lambda x: F.linear(x, weight))
    assert head is not None
    greedy = greedy_head_for(head, weight, weight.shape[0] if valid is None else valid)
    assert greedy is not None
    return head, greedy


def _first_argmax(logits: torch.Tensor) -> list[int]:
    """Each row's largest value, the first of ties (torch.argmax's rule on CPU, spelled out)."""
    best = logits.max(dim=-1, keepdim=True).values
    return (logits == best).int().argmax(dim=-1).tolist()


def test_real_hidden_states_give_the_fp32_heads_argmax(real_hf_model) -> None:
    model, tokenizer = real_hf_model
    weight = model.lm_head.weight.detach()
    head, greedy = _head(weight)
    texts = ["The history of the Roman empire is long and", "def fibonacci(n):\n    return",
             "Paris is the capital of", "1, 2, 3, 4, 5,", "Once upon a time there was a small"]
    rows = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids
            rows.append(model(ids, output_hidden_states=True).hidden_states[-1][0])  # after the final norm
    x = torch.cat(rows)
    assert x.shape[0] >= 40
    for m in (1, 3, 16, x.shape[0]):
        tokens = greedy.tokens(x[:m])
        assert tokens is not None  # real logits: a handful of candidates settle every row
        assert tokens == _first_argmax(head(x[:m]))


@pytest.mark.parametrize("seed", range(6))
def test_near_ties_are_settled_by_the_fp32_logits(seed: int) -> None:
    """Columns whose logits differ far below the bf16 estimates' error: only the fp32 recheck can order them."""
    g = torch.Generator().manual_seed(seed)
    n, k = 1000, 192
    weight = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(16, k, generator=g)
    direction = F.normalize(x.mean(0), dim=0)
    for j, c in enumerate((7, 300, 301, 640, 999)):  # near-copies of one strong column
        weight[c] = 4 * direction + torch.randn(k, generator=g) * 10.0 ** -(2 + j)
    head, greedy = _head(weight)
    logits = head(x)
    top2 = logits.topk(2).values
    assert ((top2[:, 0] - top2[:, 1]) < 1e-2).any()  # ties closer than the estimates can tell apart
    assert greedy.tokens(x) == _first_argmax(logits)


def test_the_bound_covers_the_rounding_of_the_weights_and_of_x() -> None:
    """Column 10's fp32 logit beats column 20's by ~1e-3 while bf16 rounding puts its estimate ~0.25 lower:
    once through the weights' rounding (x exact in bf16), once through x's (weights exact). A bound missing
    either term leaves column 10 out of the candidates."""
    k, a, b = 80, 10, 20
    below, above = 1 + 2**-8 - 2**-16, 1 + 2**-8 + 2**-16  # bf16 rounds them to 1 and to 1 + 2**-7
    weight = torch.zeros(64, k)
    weight[a, :64], weight[b, 0], weight[b, 1:64] = below, 1.0, above
    x = torch.zeros(1, k)
    x[0, :64] = 1.0
    head, greedy = _head(weight)
    logits = head(x)
    assert logits[0, a] > logits[0, b] and greedy.tokens(x) == [a]
    weight = torch.zeros(64, k)
    weight[a, :32], weight[a, 64], weight[b, 32:64] = 1.0, 2**-9, 1.0
    x = torch.zeros(1, k)
    x[0, :32], x[0, 32:64], x[0, 64] = below, above, 1.0
    head, greedy = _head(weight)
    logits = head(x)
    assert logits[0, a] > logits[0, b] and greedy.tokens(x) == [a]


def test_exact_ties_pick_the_first_column() -> None:
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 64, generator=g) * 0.1
    x = torch.randn(4, 64, generator=g)
    weight[41] = weight[250] = 3 * F.normalize(x.sum(0), dim=0)
    head, greedy = _head(weight)
    logits = head(x)
    assert torch.equal(logits[:, 41], logits[:, 250])
    assert greedy.tokens(x) == _first_argmax(logits)
    assert 41 in greedy.tokens(x)


def test_a_row_that_is_not_finite_is_minus_one_and_the_others_are_unaffected() -> None:
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(500, 128, generator=g)
    x = torch.randn(5, 128, generator=g)
    head, greedy = _head(weight)
    expected = _first_argmax(head(x))
    x[1, 17] = float("nan")
    x[3, 0] = float("inf")
    tokens = greedy.tokens(x)
    assert tokens == [expected[0], -1, expected[2], -1, expected[4]]


def test_columns_past_the_vocabulary_are_never_chosen() -> None:
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 64, generator=g)
    x = torch.randn(3, 64, generator=g)
    weight[190:] = 10 * F.normalize(x.sum(0), dim=0)  # padding columns would win
    head, greedy = _head(weight, valid=180)
    tokens = greedy.tokens(x)
    assert tokens == _first_argmax(head(x)[:, :180])
    assert all(t < 180 for t in tokens)


def test_logits_the_estimates_cannot_order_cheaply_are_left_to_the_logits() -> None:
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(1, 64, generator=g).repeat(2000, 1)  # every column ties: all are candidates
    _, greedy = _head(weight)
    assert greedy.tokens(torch.randn(2, 64, generator=g)) is None


def test_heads_it_does_not_take() -> None:
    w = torch.randn(128, 64)
    bf16 = few_rows_linear(w.bfloat16(), None, lambda x: x)
    assert greedy_head_for(bf16, w.bfloat16(), 128) is None  # a bf16 head has no cheaper estimate here
    assert greedy_head_for(lambda x: x, w, 128) is None  # not the few-rows kernel: its logits are not matched
    odd = few_rows_linear(torch.randn(128, 40), None, lambda x: x)
    assert greedy_head_for(odd, torch.randn(128, 40), 128) is None  # k not a multiple of 16
    _, greedy = _head(w)
    assert not greedy.takes(torch.randn(65, 64))  # more rows than the few-rows kernel takes: oneDNN's logits
    assert greedy.takes(torch.randn(64, 64)) and not greedy.takes(torch.randn(4, 64).double())


@pytest.mark.parametrize(("params", "outputs", "plain"), [
    (SamplingParams(temperature=0.0), [], True),
    (SamplingParams(temperature=0.0, min_tokens=2), [5, 6], True),
    (SamplingParams(temperature=0.0, min_tokens=3), [5, 6], False),  # EOS is masked this step
    (SamplingParams(temperature=0.7), [], False),
    (SamplingParams(temperature=0.0, logprobs=1), [], False),
    (SamplingParams(temperature=0.0, logit_bias={3: 1.0}), [], False),
    (SamplingParams(temperature=0.0, repetition_penalty=1.2), [], False),
    (SamplingParams(temperature=0.0, presence_penalty=0.5), [], False),
])
def test_plain_greedy_rows(params: SamplingParams, outputs: list[int], plain: bool) -> None:
    assert plain_greedy(SamplingRow(params, [1, 2], outputs)) is plain
