"""Vectorised next-token sampler over a packed batch: one logits row per sequence that samples this step.

Order follows vLLM v1: raw logprobs -> min_tokens mask -> repetition, frequency, presence penalties ->
greedy argmax, or temperature -> min_p -> top_k / top_p -> draw. Work is skipped when no row needs it.

Each sampled row draws ONE uniform (from its own generator when seeded) and inverts its own CDF, so a
seeded row's token depends only on its logits and its generator, never on the other rows of the batch.
Top-k / top-p rows first look at their top 64 (then 1024) candidates and only fall back to a full sort
when the nucleus or the top-k set does not fit: a full sort of 256 x 49,152 costs about a second on CPU.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from tokenflow.params import SamplingParams, TokenLogprob

__all__ = ("Sampler", "SamplerOutput", "SamplingRow", "make_generator")

_GREEDY_EPS = 1e-5  # as vLLM: dividing by a smaller temperature overflows fp32, so treat it as greedy
_STAGES = (64, 1024)  # candidate counts tried before a full sort for top-k / top-p rows
_NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one sequence that samples this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far (penalties, min_tokens)
    generator: torch.Generator | None = None  # the request's own, from `make_generator`, when seeded


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None  # None when no row asked; else one entry per row


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's generator. The seed goes through a 64-bit mix first because the CPU generator keeps
    only its low 32 bits: without it, seeds 1 and 2**32 + 1 would produce the same stream."""
    z = (seed + 0x9E3779B97F4A7C15) % 2**64  # splitmix64 finaliser: a bijection on 64 bits
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    gen = torch.Generator(device=device)
    gen.manual_seed(z ^ (z >> 31))
    return gen


class Sampler:
    """Samples one token per row; stateless apart from the vocabulary size and the EOS ids."""

    def __init__(self, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted({int(t) for t in eos_token_ids}))

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """`logits` is `[len(rows), >= vocab]` in any float dtype; it is never modified."""
        n = len(rows)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {n} rows")
        if n == 0:
            return SamplerOutput([], None)
        vocab = min(self.vocab_size, logits.shape[1])  # columns past the tokenizer's vocab are padding
        raw = logits[:, :vocab].float()  # a view of `logits` when already fp32
        params = [r.params for r in rows]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = torch.log_softmax(_take(raw, lp_rows), -1) if lp_rows else None
        x = self._penalise(raw, rows, owned=raw.data_ptr() != logits.data_ptr())

        greedy = [i for i, p in enumerate(params) if p.temperature < _GREEDY_EPS]
        if len(greedy) == n:
            tokens = x.argmax(-1)
        else:
            tokens = torch.empty(n, dtype=torch.long, device=x.device)
            if greedy:
                tokens[greedy] = _take(x, greedy).argmax(-1)
            greedy_set = set(greedy)
            sampled = [i for i in range(n) if i not in greedy_set]
            tokens[sampled] = _sample_random(x, sampled, rows)
        token_ids = tokens.tolist()
        logprobs = _gather_logprobs(raw_logprobs, tokens, token_ids, lp_rows, params) if lp_rows else None
        return SamplerOutput(token_ids, logprobs)

    def _penalise(self, raw: torch.Tensor, rows: Sequence[SamplingRow], owned: bool) -> torch.Tensor:
        """min_tokens mask and penalties; returns `raw` itself when no row needs either."""
        n, vocab = raw.shape
        mask_r: list[int] = []
        mask_c: list[int] = []
        for i, r in enumerate(rows):
            if len(r.output_token_ids) < r.params.min_tokens:
                ids = {*self.eos_token_ids, *r.params.stop_token_ids}
                cols = [t for t in ids if 0 <= t < vocab]
                mask_r += [i] * len(cols)
                mask_c += cols
        pen = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
        if not mask_r and not pen:
            return raw
        x = raw if owned else raw.clone()
        if mask_r:
            x[mask_r, mask_c] = _NEG_INF
        if not pen:
            return x
        dev = x.device
        ps = [rows[i].params for i in pen]
        xp = _take(x, pen)
        counts = _token_counts([rows[i].output_token_ids for i in pen], vocab, dev)
        rep = [p.repetition_penalty for p in ps]
        if any(r != 1.0 for r in rep):
            prompts = [rows[i].prompt_token_ids if r != 1.0 else () for i, r in zip(pen, rep, strict=True)]
            seen = (_token_counts(prompts, vocab, dev) + counts) > 0
            factor = torch.where(seen, torch.tensor(rep, device=dev)[:, None], 1.0)
            xp = torch.where(xp > 0, xp / factor, xp * factor)  # CTRL: always pushes the logit down
        freq = torch.tensor([p.frequency_penalty for p in ps], device=dev)[:, None]
        pres = torch.tensor([p.presence_penalty for p in ps], device=dev)[:, None]
        if freq.any():
            xp = xp - freq * counts
        if pres.any():
            xp = xp - pres * (counts > 0)
        if len(pen) == n:
            return xp
        x[pen] = xp
        return x


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _take(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """Rows `idx` of `t`; `t` itself (no copy) when that is every row in order."""
    return t if len(idx) == t.shape[0] else t[idx]


def _token_counts(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """`[len(seqs), vocab]` fp32 occurrence counts, built with one index_add over the flattened ids.

    Ids outside the vocabulary land in a spare column that is dropped."""
    lengths = [len(s) for s in seqs]
    counts = torch.zeros(len(seqs), vocab + 1, device=device)
    if sum(lengths):
        buf = array("q", chain.from_iterable(seqs))
        ids = torch.frombuffer(buf, dtype=torch.int64)
        ids = torch.where((ids >= 0) & (ids < vocab), ids, vocab)
        row = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(lengths))
        flat = (row * (vocab + 1) + ids).to(device)
        counts.view(-1).index_add_(0, flat, torch.ones(flat.shape[0], device=device))
    return counts[:, :vocab]


def _uniforms(rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
    """One U[0, 1) per row: seeded rows from their own generator, the others in one default draw."""
    free = [j for j, r in enumerate(rows) if r.generator is None]
    if len(free) == len(rows):
        return torch.rand(len(rows), device=device)
    u = torch.empty(len(rows), device=device)
    if free:
        u[free] = torch.rand(len(free), device=device)
    for j, r in enumerate(rows):
        if r.generator is not None:
            u[j] = torch.rand(1, generator=r.generator, device=r.generator.device)[0]
    return u


def _sample_random(x: torch.Tensor, idx: list[int], rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Tokens for the non-greedy rows `idx` of the penalised logits `x`."""
    srows = [rows[i] for i in idx]
    ps = [r.params for r in srows]
    m, vocab = len(idx), x.shape[1]
    dev = x.device
    s = _take(x, idx) / torch.tensor([p.temperature for p in ps], device=dev)[:, None]  # a fresh tensor
    mp = [j for j, p in enumerate(ps) if p.min_p > 0.0]
    if mp:  # p_i < min_p * p_max  <=>  logit_i < max_logit + log(min_p): no softmax needed
        sub = _take(s, mp)
        log_min_p = torch.tensor([math.log(ps[j].min_p) for j in mp], device=dev)
        floor = sub.amax(-1, keepdim=True) + log_min_p[:, None]
        sub.masked_fill_(sub < floor, _NEG_INF)
        if len(mp) < m:
            s[mp] = sub
    u = _uniforms(srows, dev)
    out = torch.empty(m, dtype=torch.long, device=dev)
    trunc = [j for j, p in enumerate(ps) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if trunc:
        top_k = [ps[j].top_k if ps[j].top_k < vocab else 0 for j in trunc]
        out[trunc] = _truncated_sample(_take(s, trunc), top_k, [ps[j].top_p for j in trunc], u[trunc])
    full = sorted(set(range(m)).difference(trunc))
    if full:
        out[full] = _inverse_cdf(_take(s, full), u[full])
    return out


def _inverse_cdf(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column drawn from each row's softmax by inverting its CDF at `u` (tokens at -inf never win)."""
    cdf = (logits - logits.amax(-1, keepdim=True)).exp_().cumsum_(-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)  # first column whose CDF > target


def _truncated_sample(s: torch.Tensor, top_k: list[int], top_p: list[float], u: torch.Tensor) -> torch.Tensor:
    """Top-k (0 = off), then top-p over the renormalised top-k set, then draw; ties at a cut are kept.

    Each row tries the candidate counts in `_STAGES` and is resolved at the first one that holds its
    whole kept set, so its path (and its token) depends on its own logits only."""
    t, vocab = s.shape
    dev = s.device
    kk = torch.tensor(top_k, device=dev)
    pp = torch.tensor(top_p, device=dev)
    stages = [k for k in _STAGES if k < vocab] + [vocab]
    start = [next(k for k in stages if k == vocab or tk < k) for tk in top_k]  # k-th value must be in
    need_lse = [j for j in range(t) if top_k[j] == 0]
    lse = torch.zeros(t, device=dev)
    if need_lse:  # top-p alone normalises over the whole row
        lse[need_lse] = torch.logsumexp(_take(s, need_lse), -1)
    out = torch.empty(t, dtype=torch.long, device=dev)
    pending = list(range(t))
    for k in stages:
        here = [j for j in pending if start[j] <= k]
        if not here:
            continue
        sub = _take(s, here)
        vals, cols = sub.sort(-1, descending=True) if k == vocab else sub.topk(k)
        rk, rp = kk[here], pp[here]
        has_k = rk > 0
        kth = torch.where(has_k[:, None], vals.gather(1, (rk - 1).clamp(min=0)[:, None]), _NEG_INF)
        kept = vals.masked_fill(vals < kth, _NEG_INF)
        norm = torch.where(has_k, torch.logsumexp(kept, -1), lse[here])
        cum = (kept - norm[:, None]).exp_().cumsum_(-1)
        n_p = torch.where(rp < 1.0, (cum < rp[:, None]).sum(-1) + 1, k)  # first position reaching p
        last = torch.minimum(torch.where(has_k, rk, k), n_p).clamp(max=k) - 1
        cut = vals.gather(1, last[:, None])
        if k == vocab:
            out[here] = _inverse_cdf(sub.masked_fill(sub < cut, _NEG_INF), u[here])
            break
        # resolved when no candidate left out could tie the cut (or the k-th value, for the top-k norm)
        # (or when the last candidate is already -inf: everything left out has zero mass)
        tail = vals[:, -1:]
        done = ((tail < torch.where(has_k[:, None], kth, cut)) | (tail == _NEG_INF)).squeeze(-1)
        if done.any():
            d = done.nonzero().squeeze(-1)
            order = cols[d].argsort(-1)  # index order, as the full-row draw would walk them
            c, v = cols[d].gather(1, order), vals[d].gather(1, order)
            v = v.masked_fill(v < cut[d], _NEG_INF)
            rows_done = [here[j] for j in d.tolist()]
            out[rows_done] = c.gather(1, _inverse_cdf(v, u[rows_done])[:, None]).squeeze(-1)
            pending = sorted(set(pending).difference(rows_done))
    return out


def _gather_logprobs(
    logprobs: torch.Tensor,
    tokens: torch.Tensor,
    token_ids: list[int],
    lp_rows: list[int],
    params: list[SamplingParams],
) -> list[TokenLogprob | None]:
    """Raw logprob of each sampled token plus the row's top-`logprobs` alternatives."""
    chosen = logprobs.gather(1, tokens[lp_rows][:, None]).squeeze(-1).tolist()
    width = max(params[i].logprobs or 0 for i in lp_rows)
    top_v: list[list[float]] = [[] for _ in lp_rows]
    top_i: list[list[int]] = [[] for _ in lp_rows]
    if width:
        tv, ti = logprobs.topk(min(width, logprobs.shape[1]), -1)
        top_v, top_i = tv.tolist(), ti.tolist()
    out: list[TokenLogprob | None] = [None] * len(token_ids)
    for j, i in enumerate(lp_rows):
        w = params[i].logprobs or 0
        out[i] = TokenLogprob(token_ids[i], chosen[j], dict(zip(top_i[j][:w], top_v[j][:w], strict=True)))
    return out
