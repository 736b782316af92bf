"""Vectorised next-token sampler over a packed batch: one logits row per sequence that samples this step.

Order follows vLLM v1: raw logprobs -> min_tokens mask -> repetition, frequency, presence penalties ->
greedy argmax, or temperature -> min_p -> top_k / top_p -> draw. Work no row needs is skipped.

Each sampled row draws ONE uniform (from its own generator when seeded) and inverts its own CDF, so a
seeded row's token depends only on its logits and its generator, never on the other rows of the batch.
Top-k / top-p rows first look at their top 64 (then 1024, 8192) candidates and fall back to a full
sort only when the nucleus or the top-k set does not fit: a full sort of every row's vocabulary costs
far more than the rest of the step on a CPU.
Penalties touch only the logits of tokens that occurred (O(tokens), not O(rows x vocab)), and the
`[rows, vocab]` intermediates live in scratch buffers reused across steps.

Sampling is total: a row whose logits are NaN, +inf or all -inf when it is drawn gets no token but an
entry in `SamplerOutput.failed` (its own request fails; the other rows of the step are unaffected), and
every drawn id is checked to lie in the vocabulary.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import torch

from tokenflow.params import SamplingParams, TokenLogprob
from tokenflow.protocols import DeviceTokens, GreedyTokens, RowFailure, SamplerOutput
from tokenflow.request import Request
from tokenflow.structured.bitmask import StepMasks, apply_bitmask

if TYPE_CHECKING:
    from tokenflow.protocols import StepPlan

__all__ = ("GREEDY_EPS", "GreedyTokens", "RowFailure", "Sampler", "SamplerOutput", "SamplingRow", "adjusts_logits",
           "argmax_only", "draw_uniforms", "has_penalty", "inverse_cdf", "make_generator", "plain_greedy", "row_of",
           "tokens_output")

GREEDY_EPS = 1e-5  # as vLLM: dividing by a smaller temperature overflows fp32, so treat it as greedy
_STAGES = (64, 1024, 8192)  # candidate counts tried before a full sort for top-k / top-p rows
_NEG_INF = float("-inf")
_NON_FINITE = "the model produced non-finite logits for this request"


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one sequence that samples this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far (penalties, min_tokens)
    generator: torch.Generator | None = None  # the request's own, from `make_generator`, when seeded
    stop_token_ids: Collection[int] = ()  # masked with EOS while min_tokens is not reached


def plain_greedy(row: SamplingRow) -> bool:
    """Whether the row's token is its raw logits' argmax and nothing else is read from them: greedy, no
    logprobs, no logit_bias, penalties or min_tokens mask (a constraint's mask is the caller's to check)."""
    return row.params.temperature < GREEDY_EPS and row.params.logprobs is None and not adjusts_logits(row)


def argmax_only(plan: StepPlan) -> bool:
    """Whether the step reads nothing of its logits but each sampling row's argmax: every such row
    `plain_greedy`, unconstrained, without drafts to verify or prompt tokens to score."""
    rows = [c for c in plan.chunks if c.samples]
    return bool(rows) and all(
        not c.draft and not c.num_prompt_logits and c.request.constraint is None and plain_greedy(row_of(c.request))
        for c in rows)


def adjusts_logits(row: SamplingRow) -> bool:
    """Whether `Sampler._adjust` changes the row's logits: logit_bias, the min_tokens mask, penalties."""
    p = row.params
    return len(row.output_token_ids) < p.min_tokens or has_penalty(p) or bool(p.logit_bias)


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's generator. The seed goes through a 64-bit mix first because the CPU generator keeps
    only its low 32 bits: without it, seeds 1 and 2**32 + 1 would produce the same stream."""
    z = (seed + 0x9E3779B97F4A7C15) % 2**64  # splitmix64 finaliser: a bijection on 64 bits
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    gen = torch.Generator(device=device)
    gen.manual_seed(z ^ (z >> 31))
    return gen


def row_of(request: Request) -> SamplingRow:
    """The sampler's view of a request (both backends build rows the same way)."""
    return SamplingRow(
        params=request.params,
        prompt_token_ids=request.prompt_token_ids or [],
        output_token_ids=request.output_token_ids,
        generator=request.generator,
        stop_token_ids=request.stop_token_ids,
    )


def tokens_output(tokens: GreedyTokens | DeviceTokens) -> SamplerOutput:
    """The sampler's output for rows a backend settled (`Sampler.greedy_output`); touches no sampler state, so it
    may run off the model thread."""
    failed = {i: RowFailure(_NON_FINITE, model_fault=True) for i, t in enumerate(tokens.token_ids) if t < 0}
    logprobs = tokens.logprobs if isinstance(tokens, DeviceTokens) else None
    return SamplerOutput(list(tokens.token_ids), logprobs, failed)


class Sampler:
    """Samples one token per row. Keeps reusable scratch buffers (fresh `[rows, vocab]` blocks are
    mmapped, so they would page-fault on every step), so use one Sampler per step loop:
    it is not thread-safe."""

    def __init__(self, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted({int(t) for t in eos_token_ids}))
        self._scratch: dict[str, torch.Tensor] = {}
        # The last `sample`'s tempered logits and CDFs of the rows it drew by inverting their CDF, and where
        # each row is in them: what `redraw_rejecting` and `redraw` draw from again.
        self._drawn: tuple[torch.Tensor, torch.Tensor, dict[int, int]] | None = None

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow], masks: StepMasks | None = None
               ) -> SamplerOutput:
        """`logits` is `[len(rows), >= vocab]` in any float dtype; it is never modified. `masks`: the
        allowed tokens of constrained rows (structured outputs), applied before anything else, so
        logprobs are those of the constrained distribution (as vLLM reports them)."""
        n = len(rows)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {n} rows")
        self._drawn = None
        if n == 0:
            return SamplerOutput([], None)
        src = logits[:, : min(self.vocab_size, logits.shape[1])]  # columns past the vocab are padding
        copy = src.dtype != torch.float32 or masks is not None
        raw = self._buf("raw", *src.shape, src).copy_(src) if copy else src
        if masks is not None:
            apply_bitmask(raw, masks.rows, masks.words)
        output = self._sample(raw, rows)
        if masks is not None:
            for row, error in masks.errors.items():
                output.failed[row] = RowFailure(f"the output constraint cannot go on: {error}", model_fault=False)
        return output

    def greedy_output(self, tokens: GreedyTokens | DeviceTokens) -> SamplerOutput:
        """`sample`'s output for rows a backend settled as `GreedyTokens` or `DeviceTokens` (the failure a
        row with non-finite logits gets from `sample`)."""
        self.forget_draws()
        return tokens_output(tokens)

    def forget_draws(self) -> None:
        """This step's rows were not drawn here: nothing to draw again (`redraw`)."""
        self._drawn = None

    def redrawable(self, row: int) -> bool:
        """Whether `redraw` can draw row `row` of the last `sample` again (a row drawn at random without
        top-k or top-p; a greedy or truncated row goes through `sample` again)."""
        return self._drawn is not None and row in self._drawn[2]

    def redraw_rejecting(self, idx: list[int], rows: Sequence[SamplingRow], accepts: Callable[[int, int], bool],
                         tries: int) -> dict[int, int]:
        """`{row: token}` for the rows of `idx` (of the last `sample`) that fresh draws from their kept CDF
        settle: up to `tries` draws each, keeping the first token `accepts(row, token)`. Draws from p until
        one lands in the allowed set A are draws from p restricted to A, so this is exact, and it costs a
        few binary searches where the mask of the whole vocabulary costs a pass over it; the rows it does
        not settle go to `redraw`."""
        if not idx:
            return {}
        assert self._drawn is not None
        _, cdf, where = self._drawn
        total = cdf[:, -1:]
        u = torch.zeros(cdf.shape[0], tries, device=cdf.device)  # rows not asked for search at 0, harmlessly
        for i in idx:
            gen = rows[i].generator
            u[where[i]] = torch.rand(tries, generator=gen, device=gen.device) if gen is not None else torch.rand(tries)
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        candidates = torch.searchsorted(cdf, target, right=True).tolist()  # every row's draws in one search
        found: dict[int, int] = {}
        for i in idx:
            refused: set[int] = set()
            for token in candidates[where[i]]:
                if token not in refused:
                    if accepts(i, token):
                        found[i] = token
                        break
                    refused.add(token)
        return found

    @torch.inference_mode()
    def redraw(self, idx: list[int], rows: Sequence[SamplingRow], masks: StepMasks) -> SamplerOutput:
        """Draw rows `idx` of the last `sample` again under `masks` (mask `j` is row `idx[j]`'s), from the
        tempered logits that call kept: the token a second `sample` of those rows with these masks would
        draw (the same uniforms from the same generators), without redoing its work. A structured row whose
        unconstrained token its grammar refused comes here; the output's rows are `idx`'s order."""
        assert self._drawn is not None and all(self.redrawable(i) for i in idx)
        s, _, where = self._drawn
        x = _gather_rows(s, [where[i] for i in idx], self._buf("redraw", len(idx), s.shape[1], s))
        apply_bitmask(x, list(range(len(idx))), masks.words)
        bad = ~x.amax(-1).isfinite()  # the mask left nothing the sampling parameters allow
        if bad.any():
            x[bad] = 0.0  # drawn harmlessly, reported as failed
        u = draw_uniforms([rows[i] for i in idx], s.device)
        tokens = inverse_cdf(x, u, self._buf("tmp", len(idx), s.shape[1], s)).tolist()
        failed = {j: RowFailure("the output constraint allows no token with a finite logit", model_fault=False)
                  for j in bad.nonzero().squeeze(-1).tolist()}
        for row, error in masks.errors.items():
            failed[row] = RowFailure(f"the output constraint cannot go on: {error}", model_fault=False)
        return SamplerOutput(tokens, None, failed)

    def _sample(self, raw: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        n = len(rows)
        params = [r.params for r in rows]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        stats = self._logprob_stats(raw, lp_rows, max(p.logprobs or 0 for p in params)) if lp_rows else None

        greedy = [i for i, p in enumerate(params) if p.temperature < GREEDY_EPS]
        tokens = torch.empty(n, dtype=torch.long, device=raw.device)
        bad = torch.zeros(n, dtype=torch.bool, device=raw.device)
        if greedy:
            x = self._rows(raw, greedy, rows, "tmp")
            best = x.argmax(-1)
            # argmax lands on a NaN or +inf when the row has one, and on -inf only when all are: one gather checks
            bad[greedy] = ~x.gather(1, best[:, None]).squeeze(1).isfinite()
            tokens[greedy] = best
        if len(greedy) < n:
            order, sampled, order_bad = self._sample_random(raw, rows, set(greedy))
            tokens[order] = sampled
            bad[order] = order_bad
        bad |= (tokens < 0) | (tokens >= raw.shape[1])
        token_ids = tokens.tolist()
        failed = {i: self._failure(raw[i]) for i in bad.nonzero().squeeze(-1).tolist()} if bad.any() else {}
        if stats is None:
            return SamplerOutput(token_ids, None, failed)
        max_l, log_z, top_v, top_i = stats
        chosen = (raw[lp_rows, tokens[lp_rows]] - max_l - log_z).tolist()
        out: list[TokenLogprob | None] = [None] * n
        for j, i in enumerate(lp_rows):
            w = params[i].logprobs or 0
            if i not in failed:
                out[i] = TokenLogprob(token_ids[i], chosen[j], dict(zip(top_i[j][:w], top_v[j][:w], strict=True)))
        return SamplerOutput(token_ids, out, failed)

    @staticmethod
    def _failure(raw_row: torch.Tensor) -> RowFailure:
        """Only on failure: tell a model fault (raw logits not finite) from degenerate sampling parameters."""
        if not raw_row.isfinite().all():
            return RowFailure(_NON_FINITE, model_fault=True)
        return RowFailure("the sampling parameters left no finite logit to sample from", model_fault=False)

    def _buf(self, name: str, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        """A `[rows, cols]` fp32 view of the named scratch buffer, grown when too small."""
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < rows * cols or buf.device != like.device:
            buf = self._scratch[name] = torch.empty(rows * cols, dtype=torch.float32, device=like.device)
        return buf[: rows * cols].view(rows, cols)

    def _rows(
        self, raw: torch.Tensor, idx: list[int], rows: Sequence[SamplingRow], name: str
    ) -> torch.Tensor:
        """Rows `idx` of `raw` with min_tokens and penalties applied: `raw` itself when untouched."""
        sub = [rows[i] for i in idx]
        adjust = any(adjusts_logits(r) for r in sub)
        every = idx == list(range(raw.shape[0]))
        if every and not adjust:
            return raw
        out = self._buf(name, len(idx), raw.shape[1], raw)
        if every:
            out.copy_(raw)
        else:
            _gather_rows(raw, idx, out)
        if adjust:
            self._adjust(out, sub)
        return out

    def _adjust(self, x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        """logit_bias, the min_tokens mask, then repetition, frequency and presence penalties, in place on `x`
        (row j of `x` is `rows[j]`), touching only the positions of tokens that occurred. No `unique`: repeated
        positions are written the same value, and counts are accumulated in `x` itself (a parallel sort
        of the keys stalls when another process holds the other cores)."""
        vocab, dev = x.shape[1], x.device
        flat = x.view(-1)
        biased = [(j * vocab + t, b) for j, r in enumerate(rows) for t, b in (r.params.logit_bias or {}).items()
                  if t < vocab]
        if biased:  # OpenAI's logit_bias: added to the raw logit, before min_tokens and penalties
            keys, values = zip(*biased, strict=True)
            flat.index_add_(0, torch.tensor(keys, device=dev), torch.tensor(values, dtype=x.dtype, device=dev))
        masked = [
            j * vocab + t
            for j, r in enumerate(rows)
            if len(r.output_token_ids) < r.params.min_tokens
            for t in {*self.eos_token_ids, *r.stop_token_ids}
            if 0 <= t < vocab
        ]
        if masked:
            flat[torch.tensor(masked, device=dev)] = _NEG_INF
        rep = [j for j, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
        if rep:  # CTRL: positive logits divided, negative multiplied, so a seen token always loses
            seqs = [s for j in rep for s in (rows[j].prompt_token_ids, rows[j].output_token_ids)]
            keys = _flat_keys(seqs, [j for j in rep for _ in (0, 1)], vocab, dev)
            penalty = torch.tensor([r.params.repetition_penalty for r in rows], device=dev)[keys // vocab]
            v = flat[keys]
            flat[keys] = torch.where(v > 0, v / penalty, v * penalty)
        fp = [j for j, r in enumerate(rows) if r.params.frequency_penalty or r.params.presence_penalty]
        if fp:  # OpenAI: logit -= frequency * count + presence * (count > 0), over generated tokens only
            seqs = [rows[j].output_token_ids for j in fp]
            keys = _flat_keys(seqs, fp, vocab, dev)
            row = keys // vocab
            freq = torch.tensor([r.params.frequency_penalty for r in rows], device=dev)[row]
            pres = torch.tensor([r.params.presence_penalty for r in rows], device=dev)[row]
            v = flat[keys]
            flat[keys] = 0.0
            counts = flat.index_add_(0, keys, torch.ones_like(v))[keys]  # each occurrence sees its count
            flat[keys] = v - (freq * counts + pres)

    def _logprob_stats(
        self, raw: torch.Tensor, idx: list[int], width: int
    ) -> tuple[torch.Tensor, torch.Tensor, list[list[float]], list[list[int]]]:
        """Row max, log-partition and top-`width` raw logprobs of rows `idx` (log_softmax, unmaterialised)."""
        buf = self._buf("tmp", len(idx), raw.shape[1], raw)
        every = idx == list(range(raw.shape[0]))
        x = raw if every else _gather_rows(raw, idx, buf)
        max_l = x.amax(-1)
        top = x.topk(min(width, x.shape[1]), -1) if width else None
        exp = torch.sub(raw, max_l[:, None], out=buf) if every else x.sub_(max_l[:, None])
        log_z = exp.exp_().sum(-1).log_()
        if top is None:
            return max_l, log_z, [[] for _ in idx], [[] for _ in idx]
        return max_l, log_z, (top[0] - max_l[:, None] - log_z[:, None]).tolist(), top[1].tolist()

    def _sample_random(
        self, raw: torch.Tensor, rows: Sequence[SamplingRow], greedy: set[int]
    ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """(row indices, their tokens, which rows could not be drawn) for the non-greedy rows. Rows are
        regrouped so that top-k/top-p rows by first candidate stage, then the untruncated ones, are
        contiguous slices, not copies."""
        vocab, dev = raw.shape[1], raw.device
        stages = [k for k in _STAGES if k < vocab] + [vocab]
        idx = [i for i in range(len(rows)) if i not in greedy]
        key = {i: _stage_key(rows[i].params, stages) for i in idx}
        order = sorted(idx, key=key.__getitem__)
        srows = [rows[i] for i in order]
        ps = [r.params for r in srows]
        s = self._rows(raw, order, rows, "s")
        temps = torch.tensor([p.temperature for p in ps], device=dev)[:, None]
        s = s.div_(temps) if s is not raw else torch.div(raw, temps, out=self._buf("s", *raw.shape, raw))
        bad = ~s.amax(-1).isfinite()  # NaN or +inf anywhere, or nothing left: the draw would be garbage
        if bad.any():
            s[bad] = 0.0  # drawn harmlessly, reported as failed
        mp = [j for j, p in enumerate(ps) if p.min_p > 0.0]
        if mp:  # p_i < min_p * p_max  <=>  logit_i < max_logit + log(min_p): no softmax needed
            sub = s if len(mp) == len(ps) else s[mp]
            log_min_p = torch.tensor([math.log(ps[j].min_p) for j in mp], device=dev)
            sub.masked_fill_(sub < sub.amax(-1, keepdim=True) + log_min_p[:, None], _NEG_INF)
            if sub is not s:
                s[mp] = sub
        u = draw_uniforms(srows, dev)
        t = sum(1 for i in order if key[i][0] == 0)
        out = torch.empty(len(order), dtype=torch.long, device=dev)
        if t:
            out[:t] = self._truncated_sample(s[:t], ps[:t], u[:t], stages)
        if t < len(order):
            cdf = self._buf("tmp", len(order) - t, vocab, s)
            out[t:] = inverse_cdf(s[t:], u[t:], cdf)
            self._drawn = (s[t:], cdf, {i: j - t for j, i in enumerate(order) if j >= t})
        return order, out, bad

    def _truncated_sample(
        self, s: torch.Tensor, ps: list[SamplingParams], u: torch.Tensor, stages: list[int]
    ) -> torch.Tensor:
        """Top-k (ties at the k-th value kept), then top-p over the renormalised top-k set, then a draw.

        Each row tries the candidate counts in `stages` and is resolved at the first one that holds its
        whole kept set, so its path (and its token) depends on its own logits only."""
        t, vocab = s.shape
        dev = s.device
        top_k = [p.top_k if p.top_k < vocab else 0 for p in ps]
        kk = torch.tensor(top_k, device=dev)
        pp = torch.tensor([p.top_p for p in ps], device=dev)
        start = [_stage_key(p, stages)[1] for p in ps]
        lse = torch.zeros(t, device=dev)
        a = sum(1 for k in top_k if k == 0)  # top-p alone normalises over the whole row (rows come first)
        if a:
            max_l = s[:a].amax(-1)
            exp = torch.sub(s[:a], max_l[:, None], out=self._buf("tmp", a, vocab, s)).exp_()
            lse[:a] = exp.sum(-1).log_() + max_l
        out = torch.empty(t, dtype=torch.long, device=dev)
        pending = list(range(t))
        for k in stages:
            here = [j for j in pending if start[j] <= k]
            if not here:
                continue
            sub = s[: len(here)] if here == list(range(len(here))) else s[here]
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
                sub.masked_fill_(sub < cut, _NEG_INF)
                out[here] = inverse_cdf(sub, u[here], self._buf("tmp", *sub.shape, sub))
                break
            # resolved when no left-out candidate can tie the cut (or the k-th value, which the top-p
            # normalisation needs), or when everything left out is already -inf
            tail = vals[:, -1:]
            done = ((tail < torch.where(has_k[:, None], kth, cut)) | (tail == _NEG_INF)).squeeze(-1)
            if done.any():
                d = done.nonzero().squeeze(-1)
                order = cols[d].argsort(-1)  # walk candidates in token order, as the full-row draw does
                c, v = cols[d].gather(1, order), vals[d].gather(1, order)
                v = v.masked_fill(v < cut[d], _NEG_INF)
                finished = [here[j] for j in d.tolist()]
                pos = inverse_cdf(v, u[finished], torch.empty_like(v))
                out[finished] = c.gather(1, pos[:, None]).squeeze(1)
                pending = sorted(set(pending).difference(finished))
        return out


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _stage_key(p: SamplingParams, stages: list[int]) -> tuple[int, int, bool]:
    """(untruncated?, first candidate stage that can hold the k-th value, has top-k) for grouping rows."""
    vocab = stages[-1]
    k = p.top_k if 0 < p.top_k < vocab else 0
    if not k and p.top_p >= 1.0:
        return (1, vocab, False)
    return (0, next(s for s in stages if s == vocab or k < s), k > 0)


def _flat_keys(
    seqs: Sequence[Sequence[int]], row: list[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """`row * vocab + token` for every in-vocabulary token of `seqs[j]` (belonging to row `row[j]`)."""
    lengths = [len(s) for s in seqs]
    if not sum(lengths):
        return torch.empty(0, dtype=torch.long, device=device)
    ids = torch.frombuffer(array("q", chain.from_iterable(seqs)), dtype=torch.int64)
    keys = torch.repeat_interleave(torch.tensor(row) * vocab, torch.tensor(lengths)) + ids
    outside = (ids < 0) | (ids >= vocab)
    return (keys[~outside] if outside.any() else keys).to(device)


def _gather_rows(src: torch.Tensor, idx: list[int], out: torch.Tensor) -> torch.Tensor:
    """`src[idx]` into `out`. Not index_select: for long rows it copies row by row, one parallel region
    each, and every region stalls when another process holds the other cores."""
    index = torch.tensor(idx, device=src.device)[:, None].expand(-1, src.shape[1])
    return torch.gather(src, 0, index, out=out)


def draw_uniforms(rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
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


def inverse_cdf(logits: torch.Tensor, u: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Column drawn from each row's softmax by inverting its CDF at `u` (columns at -inf never win)."""
    # softmax, not sub + exp: its kernel keeps its speed on rows full of -inf (a grammar's mask), exp's does not
    cdf = torch.softmax(logits, -1, out=scratch).cumsum_(-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)  # first column whose CDF > target
