"""Sampling on the model's device at fixed shapes, so a decode step's tokens need no logits on the host.

Why: on a GPU, copying a step's `[rows, vocab]` logits to the host and sampling there makes every step wait
for the device and then the device wait for the host. Here the sampling is tensor work only (no `.item()`,
no `.tolist()`, no branch on device values), so it can be recorded in the same CUDA graph as the forward
(`DecodeGraphs`) and only `rows` token ids come back.

Same semantics as `Sampler`: logit_bias, the min_tokens mask and
the repetition, frequency and presence penalties first (`DeviceLogitState`: per-request rows kept on the
device), then greedy argmax (first of ties), or temperature, min_p, top_k (ties at the k-th value kept),
top_p over the renormalised top-k set, and one uniform per drawn row inverted through its CDF in token
order. The uniform is drawn on the host from the request's own generator (`sampler.draw_uniforms`), exactly
as `Sampler` draws it, and staged with the row's parameters: a seeded request gets the same tokens whichever
of the two samples a step. Rows whose logits are not finite come back as -1 (`DeviceTokens`). Logprobs
(the chosen token's and the top `logprobs`, of the raw logits, as `Sampler` reports them) come back beside
the tokens, `[rows, width]`, not `[rows, vocab]`.

Steps with a grammar's mask, drafts to verify or prompt tokens to score stay on the host sampler.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch

from tokenflow.params import TokenLogprob
from tokenflow.runtime.device_logit_state import DeviceLogitState
from tokenflow.runtime.sampler import GREEDY_EPS, SamplingRow, adjusts_logits, draw_uniforms, inverse_cdf, row_of

if TYPE_CHECKING:
    from tokenflow.protocols import StepPlan

__all__ = ("DeviceSampler", "Draw", "Variant", "device_rows", "draw_of", "variant_of")

Variant = Literal["greedy", "random", "truncated"]  # what work a step's rows need; one graph each

_NEG_INF = float("-inf")
_FIELDS = 6  # temperature (1 for greedy rows), greedy flag, top_k (0: none), top_p, log(min_p), uniform


def device_rows(plan: StepPlan) -> list[SamplingRow] | None:
    """The plan's sampling rows, one per chunk, when the device sampler can draw all of them: every chunk
    samples, and none verifies a draft, scores prompt tokens or follows a grammar. None otherwise: the
    step's logits go to the host sampler."""
    rows = []
    for c in plan.chunks:
        if not c.samples or c.draft or c.num_prompt_logits or c.request.constraint is not None:
            return None
        rows.append(row_of(c.request))
    return rows or None


class Draw(NamedTuple):
    """What a step's device sampling does (each its own graph): its variant, whether rows adjust their logits
    first (`DeviceLogitState`), and how many top logprobs it reports per row (the most any row asks for; -1 when
    none asks)."""

    variant: Variant
    adjusted: bool
    logprobs: int


def draw_of(rows: Sequence[SamplingRow], vocab: int) -> Draw:
    """The draw that samples every one of `rows`."""
    return Draw(variant_of(rows, vocab), any(adjusts_logits(r) for r in rows),
                max((r.params.logprobs for r in rows if r.params.logprobs is not None), default=-1))


def _truncates(row: SamplingRow, vocab: int) -> bool:
    p = row.params
    return 0 < p.top_k < vocab or p.top_p < 1.0


def variant_of(rows: Sequence[SamplingRow], vocab: int) -> Variant:
    """The cheapest variant that samples every row: argmax only, a draw from the whole distribution, or a
    draw after top_k / top_p (a sort of each row)."""
    drawn = [r for r in rows if r.params.temperature >= GREEDY_EPS]
    if not drawn:
        return "greedy"
    return "truncated" if any(_truncates(r, vocab) for r in drawn) else "random"


class DeviceSampler:
    """Per-row parameters staged in one pinned buffer and copied in one transfer; `sample` is device work
    only. One per `DecodeGraphs`: graphs read its device buffer, so it is never reallocated."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device, eos_token_ids: Sequence[int] = ()
                 ) -> None:
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self.logit_state: DeviceLogitState | None = None  # made on the first step with adjusted rows
        self._host = torch.zeros(_FIELDS * max_rows, dtype=torch.float32, pin_memory=device.type == "cuda")
        self._host_np = self._host.numpy()
        self._device = torch.zeros(_FIELDS * max_rows, dtype=torch.float32, device=device)
        self.temperature, self.greedy, self.top_k, self.top_p, self.log_min_p, self.uniform = (
            self._device.view(_FIELDS, max_rows))

    def stage(self, rows: Sequence[SamplingRow]) -> None:
        """Write the rows' parameters and draw their uniforms (rows past `len(rows)` are greedy padding), then
        start the copy to the device. The host buffer is free to rewrite once the step's tokens came back.
        Rows with adjustments get their slot of `DeviceLogitState` (filled there first when stale)."""
        vocab = self.vocab_size
        if any(adjusts_logits(r) for r in rows):
            self.prepare_adjustments()
            assert self.logit_state is not None
            self.logit_state.stage(rows)
        temperature, greedy, top_k, top_p, log_min_p, uniform = self._host_np.reshape(_FIELDS, self.max_rows)
        temperature[:] = 1.0
        greedy[:] = 1.0
        top_k[:] = 0.0
        top_p[:] = 1.0
        log_min_p[:] = _NEG_INF
        uniform[:] = 0.0
        drawn = [j for j, r in enumerate(rows) if r.params.temperature >= GREEDY_EPS]
        for j in drawn:
            p = rows[j].params
            temperature[j] = p.temperature
            greedy[j] = 0.0
            top_k[j] = p.top_k if 0 < p.top_k < vocab else 0
            top_p[j] = p.top_p
            log_min_p[j] = math.log(p.min_p) if p.min_p > 0.0 else _NEG_INF
        if drawn:
            uniform[drawn] = draw_uniforms([rows[j] for j in drawn], torch.device("cpu")).numpy()
        self._device.copy_(self._host, non_blocking=True)

    def prepare_adjustments(self) -> None:
        """The per-request penalty state, made on the first step with adjusted rows (graphs read it from then on)."""
        if self.logit_state is None:
            self.logit_state = DeviceLogitState(self.max_rows, self.vocab_size, self.eos_token_ids, self.device)

    def sample(self, logits: torch.Tensor, variant: Variant, adjusted: bool = False) -> torch.Tensor:
        """int64 token of each of `logits`' rows (`[rows, >= vocab]`, rows <= max_rows), -1 where the row's
        logits (adjusted, scaled by its temperature) are not finite. `adjusted`: the last `stage` had rows with
        adjustments. Device operations only: capturable in a graph."""
        n = logits.shape[0]
        raw = logits[:, : self.vocab_size].float()
        if adjusted:
            assert self.logit_state is not None
            raw = self.logit_state.apply(raw)
        best = raw.argmax(-1)
        greedy_bad = ~raw.gather(1, best[:, None]).squeeze(1).isfinite()  # NaN, +inf, or every logit -inf
        if variant == "greedy":
            return torch.where(greedy_bad, -1, best)
        greedy = self.greedy[:n] > 0
        s = raw / self.temperature[:n, None]
        drawn_bad = ~s.amax(-1).isfinite()
        s = torch.where(drawn_bad[:, None], 0.0, s)  # drawn harmlessly, reported as failed
        s = s.masked_fill(s < s.amax(-1, keepdim=True) + self.log_min_p[:n, None], _NEG_INF)
        if variant == "truncated":
            s = self._truncate(s, n)
        drawn = inverse_cdf(s, self.uniform[:n], torch.empty_like(s))
        token = torch.where(greedy, best, drawn)
        return torch.where(torch.where(greedy, greedy_bad, drawn_bad), -1, token)

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, width: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's chosen token's logprob and its top `width` (values, ids), of the raw logits (before any
        adjustment or temperature, as `Sampler` reports them). Device operations only."""
        raw = logits[:, : self.vocab_size].float()
        max_l = raw.amax(-1)
        log_z = (raw - max_l[:, None]).exp().sum(-1).log()
        chosen = raw.gather(1, tokens.clamp(min=0)[:, None]).squeeze(1) - max_l - log_z
        top_v, top_i = raw.topk(min(width, raw.shape[1]), -1)
        return chosen, top_v - max_l[:, None] - log_z[:, None], top_i

    @staticmethod
    def token_logprobs(rows: Sequence[SamplingRow], tokens: list[int], chosen: list[float],
                       top_v: list[list[float]], top_i: list[list[int]]) -> list[TokenLogprob | None]:
        """`SamplerOutput.logprobs` of the step (host side): an entry for each row that asked and drew a token."""
        out: list[TokenLogprob | None] = []
        for j, row in enumerate(rows):
            w = row.params.logprobs
            ok = w is not None and tokens[j] >= 0
            out.append(TokenLogprob(tokens[j], chosen[j], dict(zip(top_i[j][:w], top_v[j][:w], strict=True)))
                       if ok else None)
        return out

    def record(self, tokens: torch.Tensor) -> None:
        """In a step with adjusted rows, after the draw: count each drawn token in its row's slot (device
        work, in the step's graph)."""
        assert self.logit_state is not None
        self.logit_state.record(tokens)

    def forget_staged(self) -> None:
        """A step with adjusted rows failed: their slots are filled again before they are read."""
        assert self.logit_state is not None
        self.logit_state.forget_staged()

    def recorded(self) -> None:
        """Once such a step's tokens came back: note on the host that each slot holds one more token."""
        assert self.logit_state is not None
        self.logit_state.stepped()

    def _truncate(self, s: torch.Tensor, n: int) -> torch.Tensor:
        """`s` with everything outside each row's top_k, then outside its top_p nucleus of what is left, at
        -inf: `Sampler._truncated_sample` at its full-sort stage, for every row at once."""
        vocab = s.shape[1]
        vals = s.sort(-1, descending=True).values
        k = self.top_k[:n].long()
        has_k = k > 0
        kth = torch.where(has_k[:, None], vals.gather(1, (k - 1).clamp(min=0)[:, None]), _NEG_INF)
        kept = vals.masked_fill(vals < kth, _NEG_INF)
        cum = (kept - torch.logsumexp(kept, -1, keepdim=True)).exp().cumsum(-1)
        p = self.top_p[:n]
        n_p = torch.where(p < 1.0, (cum < p[:, None]).sum(-1) + 1, vocab)  # first position reaching p
        last = torch.minimum(torch.where(has_k, k, vocab), n_p).clamp(max=vocab) - 1
        return s.masked_fill(s < vals.gather(1, last[:, None]), _NEG_INF)
