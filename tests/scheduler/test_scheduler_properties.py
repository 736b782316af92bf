"""Hypothesis: BucketingBatcher + BlockPool invariants over random add / step / abort / timeout sequences.

`Sim` drives the batcher exactly as the step loop does (abort marks a request
finished and the next step reaps it before scheduling; a step advances
`num_computed_tokens` by each chunk and appends a token to the sampling
chunks), and checks after every operation that KV blocks are neither shared,
leaked nor missing, and that every request ends exactly once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from tokenflow.config import EngineConfig
from tokenflow.errors import InvalidRequest, Overloaded
from tokenflow.kv.block_pool import BlockPool
from tokenflow.params import SamplingParams
from tokenflow.request import Request, RequestStatus
from tokenflow.scheduler.scheduler import BucketingBatcher

MAX_MODEL_LEN = 48


def _order(request: Request) -> tuple[int, float]:
    return (request.params.priority, request.arrival_time)


@dataclass
class Sim:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_batch_tokens: int
    max_queue: int = 64
    clock: float = 0.0
    steps: int = 0
    added: list[Request] = field(default_factory=list)
    ends: Counter[str] = field(default_factory=Counter)
    outcomes: dict[str, str] = field(default_factory=dict)
    to_reap: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        config = EngineConfig(
            max_num_seqs=self.max_num_seqs, max_batch_tokens=self.max_batch_tokens, max_queue=self.max_queue,
            block_size=self.block_size,
        )
        self.pool = BlockPool(self.num_blocks, self.block_size)
        self.deadline_step: dict[Request, int | None] = {}
        self.batcher = BucketingBatcher(config)
        self.batcher.pool = self.pool
        self.batcher.max_model_len = MAX_MODEL_LEN

    # -- what the engine does ---------------------------------------------------
    def add(self, prompt_len: int, max_tokens: int, priority: int, deadline: int | None) -> None:
        params = SamplingParams(max_tokens=max_tokens, priority=priority, ignore_eos=True)
        request = Request(params, prompt_token_ids=[7] * prompt_len, arrival_time=self.clock)
        self.deadline_step[request] = None if deadline is None else self.steps + deadline
        self.clock += 1.0
        try:
            self.batcher.add(request)
        except (InvalidRequest, Overloaded):
            self._end(request, "refused")
            return
        self.added.append(request)

    def abort(self, index: int, outcome: str) -> None:
        """`StepLoop.abort`: finished now, blocks released at the next step boundary."""
        live = [r for r in self.added if not r.finished]
        if live:
            self._abort(live[index % len(live)], outcome)

    def _abort(self, request: Request, outcome: str) -> None:
        request.status = RequestStatus.FINISHED
        self.to_reap.append(request)
        self._end(request, outcome)

    def step(self) -> None:
        for request in self.added:  # deadlines that passed since the last step
            due = self.deadline_step[request]
            if not request.finished and due is not None and self.steps >= due:
                self._abort(request, "deadline")
        reap, self.to_reap = self.to_reap, []
        for request in reap:
            self.batcher.finish(request)
        self.check()
        plan = self.batcher.schedule()
        self.steps += 1
        for request, _error in plan.rejected:
            self.batcher.finish(request)
            self._end(request, "rejected")
        self.check_plan(plan)
        sampled = []
        for chunk in plan.chunks:
            if chunk.samples:
                sampled.append(chunk.request)
            chunk.request.num_computed_tokens += chunk.num_tokens
        for request in sampled:
            request.output_token_ids.append(3)
            done = len(request.output_token_ids) >= request.params.max_tokens
            if done or request.num_tokens >= MAX_MODEL_LEN:
                self.batcher.finish(request)
                self._end(request, "completed")
        self.check()

    def _end(self, request: Request, outcome: str) -> None:
        assert request.request_id not in self.outcomes, f"{request.request_id} ended twice"
        self.outcomes[request.request_id] = outcome
        self.ends[outcome] += 1

    # -- invariants ---------------------------------------------------------------
    def check(self) -> None:
        pool, batcher = self.pool, self.batcher
        assert pool.num_used + pool.num_free == pool.num_blocks
        waiting_ids = {id(r) for r in batcher.waiting}
        assert not waiting_ids & {id(r) for r in batcher.running}, "a request both waiting and running"
        assert len(batcher.running) <= self.max_num_seqs
        owned = [b for r in [*batcher.waiting, *batcher.running] for b in r.block_table]
        assert len(owned) == len(set(owned)), "a KV block in two live requests"
        used = {b for b in range(pool.num_blocks) if pool.ref_count(b) > 0}
        assert set(owned) == used, f"leaked {used - set(owned)} / unowned {set(owned) - used}"
        for request in self.added:
            listed = id(request) in waiting_ids or request in batcher.running
            assert listed or not request.block_table, f"{request.request_id} holds blocks outside the batcher"
            assert listed or request.finished, f"{request.request_id} was lost"
            assert request.num_computed_tokens <= request.num_tokens
        for request in batcher.running:
            assert len(request.block_table) >= pool.blocks_needed(request.num_computed_tokens)
            assert request.status in (RequestStatus.RUNNING, RequestStatus.FINISHED)
        order = [_order(r) for r in batcher.waiting]
        assert order == sorted(order), "the waiting queue is out of (priority, arrival) order"
        for request in batcher.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.FINISHED)
            assert not request.block_table and request.num_computed_tokens == 0

    def check_plan(self, plan) -> None:
        assert plan.num_tokens <= self.max_batch_tokens
        seen = set()
        for chunk in plan.chunks:
            request = chunk.request
            assert id(request) not in seen and request in self.batcher.running and not request.finished
            seen.add(id(request))
            assert 0 < chunk.num_tokens <= request.num_tokens - request.num_computed_tokens
            needed = self.pool.blocks_needed(request.num_computed_tokens + chunk.num_tokens)
            assert len(request.block_table) >= needed
        for victim in plan.preempted:  # preemption takes the worst-placed request, never a better one
            assert all(_order(r) <= _order(victim) for r in self.batcher.running), "priority inversion"

    def drain(self, bound: int) -> int:
        """Step with no arrivals until idle; returns the steps it took (fails past `bound`)."""
        start = self.steps
        while self.batcher.has_work() or self.to_reap:
            assert self.steps - start <= bound, f"not drained within {bound} steps: starvation"
            self.step()
        return self.steps - start


pools = st.fixed_dictionaries({
    "num_blocks": st.integers(3, 16),  # small pools: requests compete for blocks and get preempted
    "block_size": st.sampled_from([1, 2, 4]),
    "max_num_seqs": st.integers(1, 5),
    "max_batch_tokens": st.integers(1, 24),
})
add_op = st.tuples(
    st.just("add"), st.integers(1, 12), st.integers(1, 10), st.integers(-1, 1),
    st.one_of(st.none(), st.none(), st.integers(0, 30)),  # a deadline, in steps, for a third of them
)
step_op = st.tuples(st.just("step"))
ops = st.lists(
    st.one_of(  # weighted towards adds and steps, so pools fill up and preemption happens
        add_op, add_op, step_op, step_op, step_op,
        st.tuples(st.just("abort"), st.integers(0, 1000)),
        st.tuples(st.just("timeout"), st.integers(0, 1000)),
    ),
    min_size=5,
    max_size=80,
)


def _run(sim: Sim, program: list[tuple]) -> None:
    for op in program:
        if op[0] == "add":
            sim.add(*op[1:])
        elif op[0] == "step":
            sim.step()
        else:
            sim.abort(op[1], "aborted" if op[0] == "abort" else "deadline")
        sim.check()


def _work_bound(sim: Sim) -> int:
    """Drain steps allowed: twice the tokens the live requests may still need, plus a step each.

    Every step computes at least one token; recomputation after preemption is the only waste, and
    since a preempted request is always the worst placed, the best one always progresses. (A
    targeted hypothesis search found at most 0.97 steps per token of work.)
    """
    live = [r for r in sim.added if not r.finished]
    total = sum(r.num_prompt_tokens + r.params.max_tokens for r in live)
    return 2 * total + len(live) + 2


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pools, ops)
def test_block_and_queue_invariants_hold_and_everything_drains(pool: dict, program: list[tuple]) -> None:
    sim = Sim(**pool)
    _run(sim, program)
    sim.drain(_work_bound(sim))
    assert sim.pool.num_used == 0 and sim.pool.num_free == sim.pool.num_blocks
    assert not sim.batcher.waiting and not sim.batcher.running
    ended = set(sim.outcomes)
    assert all(r.request_id in ended for r in sim.added), "a request never ended"
    assert all(r.block_table == [] for r in sim.added)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pools, st.lists(add_op, min_size=1, max_size=12))
def test_no_request_starves_without_new_arrivals(pool: dict, adds: list[tuple]) -> None:
    """A burst of requests, then no arrivals: every one completes (or is refused) within the bound,
    and the best-placed request (priority, then arrival) is never held back by preemption forever."""
    sim = Sim(**pool)
    for op in adds:
        sim.add(op[1], op[2], op[3], None)  # no deadlines: only completion can end them
    bound = _work_bound(sim)
    steps = sim.drain(bound)
    target(steps / max(bound, 1))
    assert set(sim.ends) <= {"completed", "refused", "rejected"}
    assert sim.ends["completed"] == len(sim.added)
    assert sim.pool.num_used == 0
