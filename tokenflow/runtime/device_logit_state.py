"""Per-request logit adjustments kept on the device for `DeviceSampler`: logit_bias, the min_tokens mask, and
repetition, frequency and presence penalties, as `Sampler._adjust` applies them.

Why state on the device: the penalties read every token a request has seen, and sending those with every step
would cost host work that grows with the context. Instead each request with adjustments owns a slot of dense
`[vocab]` rows on the device (its bias, its stop tokens, the tokens it has seen, its output token counts), filled
once from the host and then advanced inside the step's graph by the token the step draws. The host keeps, per
slot, which request's output list filled it and how many of its tokens the counts hold: a slot whose view
differs (a request's first device-sampled step, or a step the host sampler drew meanwhile) is filled again.

Memory: `(max_rows + 1) x vocab x 10` bytes, allocated on the first step that needs it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from tokenflow.runtime.sampler import SamplingRow, adjusts_logits

__all__ = ("DeviceLogitState",)

_NEG_INF = float("-inf")
_FIELDS = 5  # slot, repetition penalty, frequency penalty, presence penalty, min_tokens still to reach (0/1)


class DeviceLogitState:
    """Slots of per-request adjustment rows, and the per-step fields that pick and weigh them."""

    def __init__(self, max_rows: int, vocab_size: int, eos_token_ids: Collection[int], device: torch.device) -> None:
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self.device = device
        slots = max_rows + 1  # the last one stays empty: rows without adjustments read it (every op a no-op)
        self.empty_slot = max_rows
        self.bias = torch.zeros(slots, vocab_size, device=device)
        self.stops = torch.zeros(slots, vocab_size, dtype=torch.bool, device=device)  # EOS and the stop ids
        self.seen = torch.zeros(slots, vocab_size, dtype=torch.bool, device=device)  # prompt and output tokens
        self.counts = torch.zeros(slots, vocab_size, device=device)  # output tokens (float: the penalty's dtype)
        self._owner: list[Sequence[int] | None] = [None] * max_rows  # the output list a slot was filled from
        self._synced = [0] * max_rows  # how many of its tokens the slot's counts hold
        self._host = torch.zeros(_FIELDS * max_rows, dtype=torch.float32, pin_memory=device.type == "cuda")
        self._host_np = self._host.numpy()
        self._device = torch.zeros(_FIELDS * max_rows, dtype=torch.float32, device=device)
        self.slot, self.repetition, self.frequency, self.presence, self.min_tokens_left = (
            self._device.view(_FIELDS, max_rows))
        self._staged: list[int] = []  # the slot of each adjusted row of the last `stage`
        self.num_fills = 0

    def stage(self, rows: Sequence[SamplingRow]) -> None:
        """Give every row with adjustments a slot (filled again where stale) and stage the step's fields."""
        slot, repetition, frequency, presence, min_left = self._host_np.reshape(_FIELDS, self.max_rows)
        slot[:] = self.empty_slot
        repetition[:] = 1.0
        frequency[:] = 0.0
        presence[:] = 0.0
        min_left[:] = 0.0
        adjusted = [j for j, r in enumerate(rows) if adjusts_logits(r)]
        slots = self._slots([rows[j] for j in adjusted])
        for j, s in zip(adjusted, slots, strict=True):
            row, p = rows[j], rows[j].params
            if self._owner[s] is not row.output_token_ids or self._synced[s] != len(row.output_token_ids):
                self._fill(s, row)
            slot[j] = s
            repetition[j] = p.repetition_penalty
            frequency[j] = p.frequency_penalty
            presence[j] = p.presence_penalty
            min_left[j] = float(len(row.output_token_ids) < p.min_tokens)
        self._staged = slots
        self._device.copy_(self._host, non_blocking=True)

    def stepped(self) -> None:
        """After the step's tokens came back: each adjusted row's slot now holds one more of its tokens."""
        for s in self._staged:
            self._synced[s] += 1

    def forget_staged(self) -> None:
        """The last staged step failed part-way: its slots may count a token no request took."""
        for s in self._staged:
            self._owner[s] = None
        self._staged = []

    def apply(self, raw: torch.Tensor) -> torch.Tensor:
        """`raw` with each row's bias added, its stop tokens at -inf while min_tokens is not reached, then the
        repetition penalty on seen tokens and the frequency and presence penalties on its output's counts."""
        n = raw.shape[0]
        slot = self.slot[:n].long()
        x = raw + self.bias[slot]
        x = x.masked_fill(self.stops[slot] & (self.min_tokens_left[:n, None] > 0), _NEG_INF)
        penalty = self.repetition[:n, None]
        x = torch.where(self.seen[slot], torch.where(x > 0, x / penalty, x * penalty), x)
        counts = self.counts[slot]
        return x - (self.frequency[:n, None] * counts + self.presence[:n, None] * (counts > 0))

    def record(self, tokens: torch.Tensor) -> None:
        """Count each row's drawn token in its slot (rows without adjustments write the empty slot, which is
        cleared again). Device operations only, in the step's graph."""
        n = tokens.shape[0]
        # flat positions, and scatter rather than index_put_(accumulate=True), whose bounds check reads a
        # device value back on some torch releases (no graph can hold that)
        where = self.slot[:n].long() * self.vocab_size + tokens.clamp(min=0)  # a failed row's request fails
        self.counts.view(-1).scatter_add_(0, where, torch.ones(n, device=tokens.device))
        self.seen.view(-1).scatter_(0, where, torch.ones(n, dtype=torch.bool, device=tokens.device))
        self.counts[self.empty_slot].zero_()
        self.seen[self.empty_slot].zero_()

    def _slots(self, rows: Sequence[SamplingRow]) -> list[int]:
        """A slot per row: the one its output list already owns, else one no row of this step owns."""
        owned = {id(o): s for s, o in enumerate(self._owner) if o is not None}
        mine = [owned.get(id(r.output_token_ids)) for r in rows]
        kept = {s for s in mine if s is not None}
        free = iter(s for s in range(self.max_rows) if s not in kept)
        return [s if s is not None else next(free) for s in mine]

    def _fill(self, s: int, row: SamplingRow) -> None:
        """Slot `s` from the host's view of the row (outside any graph, before the step)."""
        vocab, dev = self.vocab_size, self.device

        def ids(tokens: Collection[int]) -> torch.Tensor:
            return torch.tensor([t for t in tokens if 0 <= t < vocab], dtype=torch.long).to(dev, non_blocking=True)

        self._owner[s] = None  # until the fill is whole
        bias = {t: b for t, b in (row.params.logit_bias or {}).items() if 0 <= t < vocab}
        self.bias[s].zero_()
        if bias:
            self.bias[s, ids(bias)] = torch.tensor(list(bias.values()), dtype=torch.float32).to(dev)
        self.stops[s].zero_()
        self.stops[s, ids({*self.eos_token_ids, *row.stop_token_ids})] = True
        self.seen[s].zero_()
        self.seen[s, ids([*row.prompt_token_ids, *row.output_token_ids])] = True
        self.counts[s].zero_()
        output = ids(row.output_token_ids)
        self.counts[s].index_add_(0, output, torch.ones(output.shape[0], device=dev))
        self._owner[s] = row.output_token_ids
        self._synced[s] = len(row.output_token_ids)
        self.num_fills += 1
