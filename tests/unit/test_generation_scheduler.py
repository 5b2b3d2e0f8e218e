"""The step-level generation scheduler: each rule a row, then the guards, the fit, the estimate."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from scheduler.generation import (
    STEP_PRIOR,
    Chunk,
    FinishReason,
    GenerationLimits,
    GenerationRequest,
    GenerationScheduler,
    StepOutput,
    StepPlan,
)
from scheduler.generation_queue import WaitingQueue
from scheduler.generation_state import NEVER, BlockPool, SequenceState, prefix_hashes
from scheduler.policy import LinearFit
from scheduler.vocabulary import Lane

U, V, N, B = Lane.URGENT, Lane.VIP, Lane.NORMAL, Lane.BULK
STOP, LENGTH, CANCELLED = FinishReason.STOP, FinishReason.LENGTH, FinishReason.CANCELLED
# A step takes 10 ms plus 1 ms a token, before anything is measured.
PRIOR = LinearFit(0.010, 0.001)


def req(
    id: str,
    prompt: int = 4,
    max_tokens: int = 4,
    lane: Lane = N,
    tenant: str = "",
    deadline: float | None = None,
    arrival: float = 0.0,
    weight: float = 1.0,
) -> GenerationRequest:
    return GenerationRequest(id, prompt, max_tokens, lane, tenant, deadline, arrival, weight=weight)


def flood(
    tenant: str, count: int, weight: float = 1.0, lane: Lane = N
) -> tuple[GenerationRequest, ...]:
    """``count`` requests of ``tenant`` (2 blocks each with the default limits), in order."""
    return tuple(
        req(f"{tenant}{i}", tenant=tenant, arrival=i, weight=weight, lane=lane)
        for i in range(1, count + 1)
    )


def make(**limits: int) -> GenerationScheduler:
    base = {
        "kv_blocks": 64,
        "block_size": 4,
        "max_running": 8,
        "step_tokens": 32,
        "prefill_chunk_tokens": 8,
    }
    return GenerationScheduler(GenerationLimits(**(base | limits)), step_prior=PRIOR)


@dataclass(frozen=True)
class Step:
    """Before ``schedule(now)``: ``add`` then ``cancel``; the runtime then samples a token
    for every sampling sequence and reports ``finish``."""

    now: float = 0.0
    add: tuple[GenerationRequest, ...] = ()
    cancel: tuple[str, ...] = ()
    finish: Mapping[str, FinishReason] = field(default_factory=dict)


def run(scheduler: GenerationScheduler, steps: tuple[Step, ...]) -> StepPlan:
    """Drive the steps; the last one's plan (its output reported too)."""
    plan = StepPlan()
    for step in steps:
        for request in step.add:
            scheduler.add(request)
        for id in step.cancel:
            assert scheduler.cancel(id), id
        plan = scheduler.schedule(step.now)
        output = StepOutput({id: 1 for id in plan.sampling}, dict(step.finish), PRIOR(plan.tokens))
        scheduler.update_from_output(plan, output, step.now + 0.01)
    return plan


@dataclass(frozen=True)
class Case:
    name: str
    limits: Mapping[str, int]
    steps: tuple[Step, ...]
    expect: Mapping[str, Any]  # StepPlan fields of the last plan


CASES = [
    Case(
        "a tenant alone takes the whole pool: an idle share is lent",
        {"kv_blocks": 8},
        (Step(add=flood("a", 4)),),
        {"admitted": ("a1", "a2", "a3", "a4")},
    ),
    Case(
        "a tenant that waits takes its share back: the lender's latest admitted is preempted",
        {"kv_blocks": 8},
        (Step(add=flood("a", 4)), Step(add=(req("b1", tenant="b", arrival=9),))),
        {"preempted": ("a4",), "admitted": ("b1",), "decode": ("a1", "a2", "a3")},
    ),
    Case(
        "a tenant past its share is passed over (its preempted one too) and the other's "
        "request behind it gets in, taking back another block",
        {"kv_blocks": 8},
        (
            Step(add=flood("a", 4)),
            Step(add=(req("b1", tenant="b", arrival=9),)),
            Step(add=(req("b2", tenant="b", arrival=10),)),
        ),
        {"preempted": ("a3",), "admitted": ("b2",), "resumed": (), "decode": ("a1", "a2", "b1")},
    ),
    Case(
        "the share is by weight: 3 to 1 of four slots leaves the lighter tenant one",
        {"max_running": 4},
        (
            Step(add=flood("a", 4, weight=3)),
            Step(add=(req("b1", tenant="b", arrival=9), req("b2", tenant="b", arrival=10))),
        ),
        {"preempted": ("a4",), "admitted": ("b1",), "decode": ("a1", "a2", "a3")},
    ),
    Case(
        "when every request waiting is past its tenant's share, what is free is lent in order",
        {"max_running": 4},
        (
            Step(add=flood("a", 4, weight=3)),
            Step(add=(req("b1", tenant="b", arrival=9), req("b2", tenant="b", arrival=10))),
            Step(finish={"a1": STOP}),
            Step(),
        ),
        {"resumed": ("a4",), "admitted": (), "decode": ("a2", "a3", "b1")},
    ),
    Case(
        "a higher lane's request is not held back for another tenant's lower lane",
        {"kv_blocks": 8},
        (
            Step(add=flood("a", 3)),
            Step(add=(req("a4", tenant="a", lane=V, arrival=4), req("b1", tenant="b", lane=B))),
        ),
        {"admitted": ("a4",), "preempted": ()},
    ),
    Case(
        "an urgent request starts at the next step whatever its tenant holds (and the other "
        "tenant's then takes its share back)",
        {"kv_blocks": 8},
        (
            Step(add=flood("a", 3)),
            Step(add=(req("b1", tenant="b"), req("a4", tenant="a", lane=U, arrival=4))),
        ),
        {"admitted": ("a4", "b1"), "preempted": ("a3",)},
    ),
    Case(
        "running decodes go first, then a new prompt's chunk takes what is left",
        {"step_tokens": 10, "prefill_chunk_tokens": 8},
        (Step(add=(req("a"), req("b"))), Step(add=(req("c", prompt=20),))),
        {"decode": ("a", "b"), "prefill": (Chunk("c", 0, 8, False),), "admitted": ("c",)},
    ),
    Case(
        "a long prompt goes on in chunks; a continuing prefill goes before a new admission",
        {"step_tokens": 10, "prefill_chunk_tokens": 8},
        (Step(add=(req("c", prompt=20),)), Step(add=(req("d"),))),
        {"prefill": (Chunk("c", 8, 8, False), Chunk("d", 0, 2, False)), "admitted": ("d",)},
    ),
    Case(
        "the last chunk reaches the end of the prompt and samples",
        {"step_tokens": 10, "prefill_chunk_tokens": 8},
        (Step(add=(req("c", prompt=20),)), Step(), Step()),
        {"prefill": (Chunk("c", 16, 4, True),), "decode": ()},
    ),
    Case(
        "whole prompts only: a prompt waits until the decodes leave it room in one step",
        {"step_tokens": 10, "prefill_chunk_tokens": 0},
        (Step(add=(req("a"), req("b"))), Step(add=(req("c", prompt=9),))),
        {"decode": ("a", "b"), "prefill": (), "admitted": ()},
    ),
    Case(
        "whole prompts only: one that fits the leftover runs whole",
        {"step_tokens": 12, "prefill_chunk_tokens": 0},
        (Step(add=(req("a"), req("b"))), Step(add=(req("c", prompt=9),))),
        {"decode": ("a", "b"), "prefill": (Chunk("c", 0, 9, True),)},
    ),
    Case(
        "every block a sequence can need is given at admission; one that does not fit waits",
        {"kv_blocks": 4},
        (Step(add=(req("a", prompt=4, max_tokens=8), req("b"))),),
        {"admitted": ("a",), "blocks": {"a": (0, 1, 2)}},
    ),
    Case(
        "nothing overtakes a request that does not fit, even one that would",
        {"kv_blocks": 4},
        (Step(add=(req("a", 4, 8), req("b", 4, 4, arrival=1), req("c", 1, 1, arrival=2))),),
        {"admitted": ("a",)},
    ),
    Case(
        "a finished sequence's blocks are free for the next step (its last block first)",
        {"kv_blocks": 4},
        (Step(add=(req("a", 4, 8), req("b")), finish={"a": STOP}), Step(now=1)),
        {"admitted": ("b",), "blocks": {"b": (3, 2)}, "decode": ()},
    ),
    Case(
        "max_running bounds the running batch",
        {"max_running": 2},
        (Step(add=(req("a"), req("b"), req("c"))),),
        {"admitted": ("a", "b")},
    ),
    Case(
        "a running sequence cancelled is released at the next schedule, making room there",
        {"kv_blocks": 4},
        (Step(add=(req("a", 4, 8), req("b"))), Step(now=1, cancel=("a",))),
        {"released": ("a",), "ended": {"a": CANCELLED}, "admitted": ("b",), "decode": ()},
    ),
    Case(
        "a waiting request cancelled is dropped at once: ended, not released (nothing holds it)",
        {"kv_blocks": 4},
        (Step(add=(req("a", 4, 8), req("b"))), Step(now=1, cancel=("b",))),
        {"released": (), "ended": {"b": CANCELLED}, "admitted": (), "decode": ("a",)},
    ),
    Case(
        "lanes in order: urgent, vip, normal, then bulk with what is left",
        {"max_running": 3},
        (Step(add=(req("b", lane=B), req("n", lane=N), req("v", lane=V), req("u", lane=U))),),
        {"admitted": ("u", "v", "n")},
    ),
    Case(
        "within a lane, tenants take turns: each one's first, then each one's second",
        {"max_running": 3},
        (
            Step(
                add=(
                    req("a1", tenant="a"),
                    req("a2", tenant="a", arrival=1),
                    req("b1", tenant="b", arrival=2),
                )
            ),
        ),
        {"admitted": ("a1", "b1", "a2")},
    ),
    Case(
        "the tenant admitted least recently goes first, whatever arrived earlier",
        {"max_running": 1},
        (
            Step(
                add=(req("b1", tenant="b"), req("a1", tenant="a", arrival=1)), finish={"b1": STOP}
            ),
            Step(now=1, add=(req("b2", tenant="b", arrival=0.5),)),
        ),
        {"admitted": ("a1",)},
    ),
    Case(
        "within a tenant's turn the earliest deadline, then arrival, then id",
        {"max_running": 3},
        (
            Step(
                add=(
                    req("y", arrival=1),
                    req("x", arrival=1),
                    req("late", deadline=90),
                    req("soon", arrival=2, deadline=50),
                )
            ),
        ),
        {"admitted": ("soon", "late", "x")},
    ),
    Case(
        "an urgent request preempts the lowest lane first to get blocks",
        {"kv_blocks": 4},
        (Step(add=(req("n", lane=N), req("b", lane=B))), Step(now=1, add=(req("u", lane=U),))),
        {"preempted": ("b",), "admitted": ("u",), "blocks": {"u": (3, 2)}, "decode": ("n",)},
    ),
    Case(
        "within the lowest lane, the most recently admitted is preempted first",
        {"kv_blocks": 4},
        (
            Step(add=(req("b1", lane=B), req("b2", lane=B, arrival=1))),
            Step(now=1, add=(req("u", lane=U),)),
        ),
        {"preempted": ("b2",), "admitted": ("u",), "decode": ("b1",)},
    ),
    Case(
        "an urgent request preempts only as many as it needs, in order",
        {"kv_blocks": 6},
        (
            Step(add=(req("v", lane=V), req("n", lane=N), req("b", lane=B))),
            Step(now=1, add=(req("u", 4, 8, lane=U),)),
        ),
        {"preempted": ("b", "n"), "admitted": ("u",), "decode": ("v",)},
    ),
    Case(
        "an urgent request preempts for a running slot too",
        {"max_running": 2},
        (Step(add=(req("n1"), req("n2", arrival=1))), Step(now=1, add=(req("u", lane=U),))),
        {"preempted": ("n2",), "admitted": ("u",), "decode": ("n1",)},
    ),
    Case(
        "no preemption when evicting every lower lane still would not make it fit",
        {"kv_blocks": 4},
        (
            Step(add=(req("u1", lane=U), req("b", lane=B))),
            Step(now=1, add=(req("u2", 4, 12, lane=U),)),
        ),
        {"preempted": (), "admitted": (), "decode": ("u1", "b")},
    ),
    Case(
        "a non-urgent lane never preempts",
        {"kv_blocks": 4},
        (Step(add=(req("b1", lane=B), req("b2", lane=B))), Step(now=1, add=(req("v", lane=V),))),
        {"preempted": (), "admitted": (), "decode": ("b1", "b2")},
    ),
    Case(
        "a preempted sequence is resumed (not admitted) and prefills prompt + generated",
        {"kv_blocks": 4},
        (
            Step(add=(req("n", 4, 8, lane=N),)),
            Step(now=1, add=(req("u", lane=U),)),
            Step(now=2, finish={"u": STOP}),
            Step(now=3, add=(req("n2", lane=N, arrival=3),)),
        ),
        # It sampled one token before it was preempted: 4 + 1 known tokens.
        {"resumed": ("n",), "admitted": (), "prefill": (Chunk("n", 0, 5, True),)},
    ),
    Case(
        "a preempted sequence heads its lane: a fresh one of its lane does not overtake it",
        {"kv_blocks": 5},
        (
            Step(add=(req("b1", 4, 4, lane=B),)),
            Step(now=1, add=(req("u", 4, 12, lane=U), req("b2", 1, 3, lane=B))),
        ),
        {"preempted": ("b1",), "admitted": ("u",), "resumed": ()},
    ),
    Case(
        "a waiting request whose deadline has passed expires",
        {"max_running": 1},
        (Step(add=(req("a"),)), Step(now=1, add=(req("late", deadline=0.5),))),
        {"expired": ("late",), "decode": ("a",)},
    ),
    Case(
        "one that cannot start before this step ends expires; one that can wait stays",
        {"max_running": 1},
        (
            Step(add=(req("a"),)),
            Step(now=1, add=(req("x", deadline=1.005), req("y", deadline=9))),
        ),
        {"expired": ("x",), "decode": ("a",), "admitted": ()},
    ),
    Case(
        "a request admitted at its deadline's moment is not expired",
        {},
        (Step(now=1, add=(req("x", deadline=1.0),)),),
        {"expired": (), "admitted": ("x",)},
    ),
    Case(
        "a running sequence keeps running until its deadline",
        {},
        (Step(add=(req("a", max_tokens=8, deadline=5.0),)), Step(now=4.9)),
        {"expired": (), "decode": ("a",), "ended": {}},
    ),
    Case(
        "a running sequence whose deadline passes ends expired, its blocks free that step",
        {"kv_blocks": 3, "block_size": 4},
        (
            Step(add=(req("a", max_tokens=8, deadline=5.0),)),
            Step(now=1, add=(req("b", max_tokens=8),)),  # no room beside a: it waits
            Step(now=5),
        ),
        {
            "ended": {"a": FinishReason.EXPIRED},
            "released": ("a",),
            "decode": (),
            "admitted": ("b",),
            "expired": (),
        },
    ),
    Case(
        "a preempted sequence waiting past its deadline ends expired, for its kept tokens",
        {"kv_blocks": 3, "block_size": 4},
        (
            Step(add=(req("b", lane=B, max_tokens=8, deadline=5.0),)),
            Step(now=1, add=(req("u", lane=U, max_tokens=8),)),  # preempts b
            Step(now=5),
        ),
        {"ended": {"b": FinishReason.EXPIRED}, "released": ("b",), "decode": ("u",)},
    ),
    Case(
        "a sequence at its max_tokens that the runtime did not finish is ended as length",
        {},
        (Step(add=(req("a", max_tokens=1), req("b", max_tokens=2))), Step(now=1)),
        {"released": ("a",), "ended": {"a": LENGTH}, "decode": ("b",)},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_each_rule(case: Case) -> None:
    scheduler = make(**case.limits)
    plan = run(scheduler, case.steps)
    got = {name: getattr(plan, name) for name in case.expect}
    assert got == dict(case.expect)
    assert plan.tokens <= scheduler.limits.step_tokens


def request_fields(**fields: Any) -> GenerationRequest:
    return req(**({"id": "r"} | fields))


@pytest.mark.parametrize(
    ("limits", "request_", "message"),
    [
        ({"kv_blocks": 4}, request_fields(prompt=10, max_tokens=7), "need 5 KV blocks"),
        ({"kv_blocks": 4}, request_fields(prompt=10, max_tokens=6), None),
        ({"prefill_chunk_tokens": 0}, request_fields(prompt=33), "prefilled whole"),
        ({"prefill_chunk_tokens": 0}, request_fields(prompt=32), None),
        ({"prefill_chunk_tokens": 8}, request_fields(prompt=200), None),
        ({}, request_fields(prompt=0), "at least 1"),
        ({}, request_fields(max_tokens=0), "at least 1"),
    ],
)
def test_add_refuses_what_could_never_run(
    limits: dict[str, int], request_: GenerationRequest, message: str | None
) -> None:
    scheduler = make(**limits)
    if message is None:
        scheduler.add(request_)
        assert scheduler.waiting_count == 1
    else:
        with pytest.raises(ValueError, match=message):
            scheduler.add(request_)
        assert scheduler.waiting_count == 0


def test_a_known_id_is_refused_waiting_or_running() -> None:
    scheduler = make()
    scheduler.add(req("a"))
    with pytest.raises(ValueError, match="already"):
        scheduler.add(req("a"))
    run(scheduler, (Step(),))
    assert scheduler.state_of("a") == "running"
    with pytest.raises(ValueError, match="already"):
        scheduler.add(req("a"))


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"kv_blocks": 0}, "kv_blocks"),
        ({"max_running": 33, "step_tokens": 32}, "must not exceed step_tokens"),
        ({"prefill_chunk_tokens": -1}, "negative"),
    ],
)
def test_limits_refuse_what_cannot_work(limits: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(**limits)


def test_cancel_says_whether_there_was_anything_to_cancel() -> None:
    scheduler = make()
    assert not scheduler.cancel("nobody")
    scheduler.add(req("a"))
    run(scheduler, (Step(),))
    assert scheduler.cancel("a")
    assert not scheduler.cancel("a")  # once is enough
    plan = scheduler.schedule(1.0)
    assert plan.released == ("a",) and plan.ended == {"a": CANCELLED}
    assert scheduler.blocks_free == 64 and not scheduler.cancel("a")


def test_a_sequence_cancelled_during_its_step_is_still_reported_then_released() -> None:
    scheduler = make()
    scheduler.add(req("a", max_tokens=8))
    plan = scheduler.schedule(0.0)
    assert scheduler.cancel("a")  # while the runtime executes the plan
    scheduler.update_from_output(plan, StepOutput({"a": 5}, {}, 0.01), 0.01)
    assert scheduler.state_of("a") == "running"
    plan = scheduler.schedule(0.02)
    assert plan.released == ("a",) and plan.decode == ()


def test_a_sequence_cancelled_during_the_step_it_finishes_in_ends_as_the_runtime_says() -> None:
    scheduler = make()
    scheduler.add(req("a", max_tokens=8))
    plan = scheduler.schedule(0.0)
    assert scheduler.cancel("a")
    scheduler.update_from_output(plan, StepOutput({"a": 5}, {"a": STOP}, 0.01), 0.01)
    later = scheduler.schedule(0.02)
    assert later.released == () and later.ended == {} and scheduler.blocks_free == 64


def test_a_preempted_sequence_cancelled_is_released_for_its_kept_tokens() -> None:
    scheduler = make(kv_blocks=2)
    run(scheduler, (Step(add=(req("b", lane=B),)), Step(now=1, add=(req("u", lane=U),))))
    assert scheduler.state_of("b") == "waiting"
    assert scheduler.cancel("b")
    plan = scheduler.schedule(2.0)
    assert plan.released == ("b",) and plan.ended == {"b": CANCELLED}


def test_a_sequence_finished_by_the_runtime_leaves_at_once_and_is_not_ended_again() -> None:
    scheduler = make()
    plan = run(scheduler, (Step(add=(req("a", max_tokens=8),), finish={"a": STOP}),))
    assert plan.admitted == ("a",)
    assert scheduler.state_of("a") is None and scheduler.blocks_free == 64
    later = scheduler.schedule(1.0)
    assert later.empty and later.released == () and later.ended == {}


def test_a_failed_step_keeps_nothing_and_its_sequences_then_resume_one_at_a_time() -> None:
    scheduler = make()
    run(scheduler, (Step(add=(req("a", max_tokens=6), req("b", max_tokens=6))),))
    scheduler.add(req("c", max_tokens=2))
    plan = scheduler.schedule(1.0)  # a and b decode, c is admitted: then the runtime raises
    assert set(plan.sampling) == {"a", "b", "c"}
    assert scheduler.abort(plan) == ("c", "a", "b")  # prefill first, then decodes
    assert scheduler.blocks_free == 64 and scheduler.running_count == 0
    with pytest.raises(ValueError, match="once"):
        scheduler.abort(plan)
    # Each resumes alone (from the tokens it had) until it samples again; nothing, not
    # even a new request, runs beside it meanwhile. Then they run together.
    scheduler.add(req("d"))
    steps: list[set[str]] = []
    for step in range(40):
        plan = scheduler.schedule(2.0 + step)
        steps.append({c.id for c in plan.prefill} | set(plan.decode))
        output = StepOutput({id: 1 for id in plan.sampling}, {}, 0.01)
        scheduler.update_from_output(plan, output, 2.01 + step)
        if not scheduler.running_count and not scheduler.waiting_count:
            break
    # Resumed in their first admission's order, each alone for its resuming prefill
    # (a suspect starts only on an empty batch), and then joined by what is not suspect.
    firsts = [next(s for s in steps if x in s) for x in ("a", "b", "c")]
    assert firsts == [{"a"}, {"b"}, {"c"}], steps
    assert steps.index({"a"}) < steps.index({"b"}) < steps.index({"c"}), steps
    assert any(len(s) > 1 for s in steps), steps  # d ran beside one past its prefill
    # a and b had 5 tokens left, c 2, d 4: every one ran to its max_tokens.
    assert sum("a" in s for s in steps) == 5 and sum("b" in s for s in steps) == 5
    assert sum("c" in s for s in steps) == 2 and scheduler.state_of("d") is None


def test_nothing_joins_a_suspect_until_it_samples_and_an_urgent_one_preempts_it() -> None:
    scheduler = make(prefill_chunk_tokens=2)  # room for all: only the rule keeps them apart
    scheduler.add(req("b", lane=B, max_tokens=8))
    scheduler.abort(scheduler.schedule(0.0))
    plan = run(scheduler, (Step(now=1.0, add=(req("n", lane=B),)),))  # b: first of 2 chunks
    assert plan.prefill == (Chunk("b", 0, 2, False),) and scheduler.state_of("n") == "waiting"
    plan = run(scheduler, (Step(now=2.0),))  # its last chunk samples: still alone
    assert plan.prefill == (Chunk("b", 2, 2, True),) and scheduler.state_of("n") == "waiting"
    plan = run(scheduler, (Step(now=3.0),))  # past it: n joins
    assert plan.decode == ("b",) and plan.admitted == ("n",)
    # A suspect again: an urgent arrival does not wait for it, it preempts it.
    scheduler.abort(scheduler.schedule(4.0))
    plan = run(scheduler, (Step(now=5.0, add=(req("u", lane=U),)),))
    assert "u" in plan.admitted and scheduler.state_of("b") == "waiting"


def test_a_sequence_cancelled_during_a_failed_step_ends_cancelled() -> None:
    scheduler = make()
    run(scheduler, (Step(add=(req("a", max_tokens=6), req("b", max_tokens=6))),))
    plan = scheduler.schedule(1.0)
    assert scheduler.cancel("a")
    assert scheduler.abort(plan) == ("a", "b")
    later = scheduler.schedule(2.0)
    assert later.released == ("a",) and later.ended == {"a": CANCELLED}
    assert later.resumed == ("b",)


def test_with_whole_prompts_a_resumed_sequence_longer_than_a_step_goes_in_chunks() -> None:
    # Whole prompts only, 16 tokens a step: a 14-token prompt fits; aborted after 6
    # tokens, its 20 known tokens do not, and it must not block everything behind it.
    scheduler = make(step_tokens=16, prefill_chunk_tokens=0, max_running=4)
    run(scheduler, (Step(add=(req("a", prompt=14, max_tokens=12),)),) + (Step(),) * 5)
    scheduler.abort(scheduler.schedule(1.0))
    scheduler.add(req("b", prompt=4, max_tokens=2))
    chunks = []
    for step in range(30):
        plan = scheduler.schedule(2.0 + step)
        chunks += [c.length for c in plan.prefill if c.id == "a"]
        output = StepOutput({id: 1 for id in plan.sampling}, {}, 0.01)
        scheduler.update_from_output(plan, output, 2.01 + step)
        if not scheduler.running_count and not scheduler.waiting_count:
            break
    assert sum(chunks) == 14 + 6 and max(chunks) <= 16, chunks
    assert scheduler.state_of("a") is None and scheduler.state_of("b") is None


def test_reset_forgets_every_request_and_the_plan_in_flight() -> None:
    scheduler = make()
    run(scheduler, (Step(add=(req("a"), req("b"))),))
    scheduler.add(req("c"))
    scheduler.schedule(1.0)  # then the worker's Redis fails before the output is reported
    scheduler.reset()
    assert (scheduler.running_count, scheduler.waiting_count, scheduler.blocks_free) == (0, 0, 64)
    scheduler.add(req("a"))  # read again: known no more
    plan = scheduler.schedule(2.0)
    assert plan.admitted == ("a",) and plan.ended == {} and plan.released == ()


def test_the_output_must_answer_the_plan() -> None:
    scheduler = make()
    scheduler.add(req("a"))
    plan = scheduler.schedule(0.0)
    with pytest.raises(ValueError, match="did not sample"):
        scheduler.update_from_output(plan, StepOutput({"a": 1, "ghost": 2}, {}, 0.01), 0.01)
    with pytest.raises(ValueError, match="no token and no ending"):
        scheduler.update_from_output(plan, StepOutput({}, {}, 0.01), 0.01)
    with pytest.raises(RuntimeError, match="not reported"):
        scheduler.schedule(0.01)
    scheduler.update_from_output(plan, StepOutput({"a": 1}, {}, 0.01), 0.01)
    with pytest.raises(ValueError, match="once"):
        scheduler.update_from_output(plan, StepOutput({"a": 1}, {}, 0.01), 0.01)


def test_an_empty_plan_sleeps_until_something_is_added() -> None:
    scheduler = make()
    plan = scheduler.schedule(0.0)
    assert plan.empty and plan.wait_s is None and plan.tokens == 0 and plan.predicted_s == 0


def test_the_block_pool_hands_out_each_block_once() -> None:
    pool = BlockPool(3)
    assert pool.take("a", 2) == (0, 1) and pool.free == 1
    with pytest.raises(ValueError, match="2 blocks asked, 1 free"):
        pool.take("b", 2)
    with pytest.raises(ValueError, match="held by a"):
        pool.give_back("b", (0,))
    pool.give_back("a", (1,))
    assert pool.take("b", 2) == (2, 1)
    assert pool.owners() == {"a": (0,), "b": (2, 1)} and pool.used == 3


# --- the waiting order -------------------------------------------------------------


def sorted_order(waiting: Iterable[SequenceState], last: Mapping[str, int]) -> list[SequenceState]:
    """The waiting order, by one sort over every request: what the queue walks lazily."""
    turns: dict[tuple[int, str], int] = {}
    keyed = []
    for s in sorted(waiting, key=lambda s: (s.deadline, s.request.arrival, s.id)):
        if s.started:
            keyed.append(((s.rank, 0, s.first_admitted, 0, 0.0, 0.0, ""), s))
            continue
        turn = turns.get((s.rank, s.request.tenant), 0)
        turns[(s.rank, s.request.tenant)] = turn + 1
        tenant_last = last.get(s.request.tenant, NEVER)
        keyed.append(((s.rank, 1, turn, tenant_last, s.deadline, s.request.arrival, s.id), s))
    return [s for _, s in sorted(keyed, key=lambda pair: pair[0])]


@pytest.mark.parametrize("seed", range(5))
def test_the_queue_walks_the_waiting_order(seed: int) -> None:
    rng = random.Random(seed)
    queue = WaitingQueue()
    for n in range(300):
        deadline = rng.choice([None, float(rng.randrange(5))])
        request = req(
            f"r{n}",
            lane=rng.choice([U, V, N, B]),
            tenant=rng.choice("abcd"),
            deadline=deadline,
            arrival=float(rng.randrange(20)),
        )
        sequence = SequenceState(request, request.lane)
        if rng.random() < 0.1:  # preempted: it ran before
            sequence.first_admitted = sequence.admitted_at = rng.randrange(1000)
        queue.add(sequence)
        if rng.random() < 0.2:
            queue.remove(rng.choice(queue.values()).id)
    last = {tenant: rng.choice([NEVER, 3, 7]) for tenant in "abcd"}
    assert list(queue.order(last)) == sorted_order(queue.values(), last)


def test_the_queue_expires_the_due_never_admitted_earliest_first() -> None:
    queue = WaitingQueue()
    for id, deadline in (("a", 5.0), ("b", 1.0), ("c", None), ("d", 3.0)):
        queue.add(SequenceState(req(id, deadline=deadline), N))
    queue.remove("d")
    assert queue.soonest_deadline() == 1.0
    assert [s.id for s in queue.due(6.0)] == ["b", "a"]
    assert queue.soonest_deadline() == float("inf") and len(queue) == 1 and "c" in queue


# --- the learned step time ---------------------------------------------------------


def test_before_any_step_the_prior_predicts() -> None:
    fit = GenerationScheduler(GenerationLimits(kv_blocks=8)).step_fit
    assert fit.intercept == pytest.approx(STEP_PRIOR.intercept)
    assert fit.slope == pytest.approx(STEP_PRIOR.slope)
    assert make().predicted_step_s(100) == pytest.approx(0.010 + 0.1)


def test_the_step_fit_learns_a_plus_b_tokens_and_recent_steps_weigh_more() -> None:
    scheduler = make(max_running=16, step_tokens=64, prefill_chunk_tokens=64)

    def measure(a: float, b: float, steps: int) -> None:
        for n in range(steps):
            scheduler.add(req(f"r{a}-{n}", prompt=1 + n % 40, max_tokens=1))
            plan = scheduler.schedule(float(n))
            output = StepOutput({id: 1 for id in plan.sampling}, {}, a + b * plan.tokens)
            scheduler.update_from_output(plan, output, float(n))

    measure(0.002, 0.0001, 200)
    fit = scheduler.step_fit
    assert fit.intercept == pytest.approx(0.002, rel=0.05)
    assert fit.slope == pytest.approx(0.0001, rel=0.05)
    measure(0.020, 0.0005, 200)  # the model got slower: the fit follows
    assert scheduler.step_fit.slope == pytest.approx(0.0005, rel=0.05)


# --- the wait estimate ---------------------------------------------------------------


def test_an_idle_scheduler_estimates_the_prompts_chunks_then_one_step_a_token() -> None:
    scheduler = make(prefill_chunk_tokens=8)
    # 20 prompt tokens: chunks of 8, 8 and 4, then 9 decode steps of one token.
    expected = 2 * PRIOR(8) + PRIOR(4) + 9 * PRIOR(1)
    assert scheduler.estimate_wait_s(20, 10, N) == pytest.approx(expected)
    assert scheduler.estimate_wait_s(20, 20, N) > scheduler.estimate_wait_s(20, 10, N)


def test_the_estimate_counts_the_queue_ahead_of_the_lane() -> None:
    scheduler = make(kv_blocks=16)
    for n in range(6):
        scheduler.add(req(f"n{n}", prompt=16, max_tokens=16, lane=N))
    run(scheduler, (Step(),))  # two of them run, four wait
    assert scheduler.running_count == 2 and scheduler.waiting_count == 4
    urgent = scheduler.estimate_wait_s(16, 16, U)
    vip = scheduler.estimate_wait_s(16, 16, V)
    normal = scheduler.estimate_wait_s(16, 16, N)
    idle = make(kv_blocks=16).estimate_wait_s(16, 16, N)
    # Urgent preempts the normal lane (it only shares the steps with it); vip
    # waits for blocks to free; normal waits behind the four queued as well.
    assert idle < urgent < vip < normal
    for n in range(4):
        scheduler.add(req(f"b{n}", prompt=16, max_tokens=16, lane=B))
    assert scheduler.estimate_wait_s(16, 16, N) == pytest.approx(normal)  # bulk is behind
    assert scheduler.estimate_wait_s(16, 16, B) > normal


def drive(
    scheduler: GenerationScheduler, arrivals: Mapping[int, Iterable[GenerationRequest]], steps: int
) -> tuple[dict[str, int], dict[str, int], list[dict[str, int]]]:
    """Step the scheduler ``steps`` times, each request running to its max_tokens: when each
    arrived and sampled its first token (step numbers), and the blocks each tenant held
    after each step (a tenant is its requests' ids' first letter)."""
    arrived: dict[str, int] = {}
    first: dict[str, int] = {}
    held: list[dict[str, int]] = []
    for step in range(steps):
        for request in arrivals.get(step, ()):
            scheduler.add(request)
            arrived[request.id] = step
        plan = scheduler.schedule(float(step))
        for id in plan.sampling:
            first.setdefault(id, step)
        output = StepOutput({id: 1 for id in plan.sampling}, {}, 0.01)
        scheduler.update_from_output(plan, output, step + 0.01)
        holding: dict[str, int] = {}
        for id, blocks in scheduler.owned_blocks().items():
            holding[id[0]] = holding.get(id[0], 0) + len(blocks)
        held.append(holding)
    return arrived, first, held


FAIR = {"kv_blocks": 64, "max_running": 16, "step_tokens": 64, "prefill_chunk_tokens": 16}


def test_a_tenants_first_tokens_under_anothers_flood_come_as_when_the_engine_is_idle() -> None:
    # "a" floods 200 long generations (16 blocks each: the pool holds four) at once; "b"
    # sends a short one every 25 steps. Alone, each of b's starts the step it arrives.
    short = {50 + 25 * i: [req(f"b{i}", prompt=8, max_tokens=8, tenant="b")] for i in range(12)}
    long = [req(f"a{i}", prompt=8, max_tokens=56, tenant="a", arrival=i) for i in range(200)]

    def ttft(arrivals: Mapping[int, list[GenerationRequest]]) -> list[int]:
        arrived, first, _ = drive(make(**FAIR), arrivals, 400)
        return sorted(first[id] - arrived[id] for id in arrived if id.startswith("b"))

    idle = ttft(short)
    flooded = ttft({**short, 0: long})
    assert len(flooded) == len(idle) == 12
    # Steps, not seconds: within 1.5 times the idle p99, and a step.
    assert flooded[-1] <= 1.5 * idle[-1] + 1, (idle, flooded)


@pytest.mark.parametrize("flood_prompt", [8, 120], ids=["short-prompts", "long-prompts"])
def test_a_tenants_first_tokens_stay_near_idle_under_a_flood_at_fifty_times_its_rate(
    flood_prompt: int,
) -> None:
    # "b" sends a short generation every 25 steps; "a" two long ones every step, 50 times
    # b's rate (with long prompts, a's prefills alone would fill every step).
    short = {50 + 25 * i: [req(f"b{i}", prompt=8, max_tokens=8, tenant="b")] for i in range(12)}
    flood: dict[int, list[GenerationRequest]] = {
        step: [
            req(f"a{step}-{k}", prompt=flood_prompt, max_tokens=40, tenant="a") for k in range(2)
        ]
        for step in range(400)
    }
    limits = FAIR | {"kv_blocks": 256}

    def ttft(arrivals: Mapping[int, list[GenerationRequest]]) -> list[int]:
        arrived, first, _ = drive(make(**limits), arrivals, 400)
        return sorted(first[id] - arrived[id] for id in arrived if id.startswith("b"))

    idle = ttft(short)
    flooded = ttft({step: short.get(step, []) + flood[step] for step in range(400)})
    assert len(flooded) == len(idle) == 12
    assert flooded[-1] <= 1.5 * idle[-1], (idle, flooded)


def test_two_flooding_tenants_hold_the_pool_by_their_weights() -> None:
    # Both flood at once, "a" with weight 3 and "b" with 1: while both wait, a holds about
    # three quarters of the blocks held (48 of 64: three requests of 16 blocks to b's one).
    arrivals = {
        0: [
            req(f"{t}{i}", prompt=8, max_tokens=56, tenant=t, arrival=i, weight=w)
            for i in range(60)
            for t, w in (("a", 3.0), ("b", 1.0))
        ]
    }
    _, _, held = drive(make(**FAIR), arrivals, 600)
    # After the first admissions settle, while both still have work waiting.
    shares = [h.get("a", 0) / sum(h.values()) for h in held[10:400] if sum(h.values())]
    mean = sum(shares) / len(shares)
    assert abs(mean - 0.75) <= 0.1 * 0.75, mean


def test_a_floods_long_prompts_take_only_its_share_of_a_step_while_another_tenant_waits() -> None:
    # "a" runs four sequences prefilling 200-token prompts, 32 a chunk: they fill a 128-token
    # step. "b" arrives with a 16-token prompt: by equal weights a's prefills are held to half
    # of the step while b waits, so b is admitted and prefilled in the very next step, and
    # nothing of a's is preempted for it (a holds less than its share of blocks and slots).
    scheduler = make(kv_blocks=1000, max_running=16, step_tokens=128, prefill_chunk_tokens=32)
    four = tuple(req(f"a{i}", prompt=200, tenant="a") for i in range(4))
    plan = run(scheduler, (Step(add=four),))
    assert len(plan.admitted) == 4 and plan.tokens == 128
    plan = run(scheduler, (Step(now=1.0, add=(req("b0", prompt=16, tenant="b"),)),))
    assert plan.admitted == ("b0",) and plan.sampling == ("b0",)  # its first token, at once
    assert not plan.preempted
    by_tenant = {t: sum(c.length for c in plan.prefill if c.id[0] == t) for t in "ab"}
    # a's 64, then what b left of the step lent back to a's prefills: the step is full.
    assert by_tenant == {"a": 112, "b": 16}, plan.prefill
    assert all(c.length <= 32 for c in plan.prefill)


def test_with_nobody_else_waiting_a_tenants_prefills_take_the_whole_step() -> None:
    scheduler = make(kv_blocks=400, max_running=16, step_tokens=128, prefill_chunk_tokens=32)
    run(scheduler, (Step(add=tuple(req(f"a{i}", prompt=200, tenant="a") for i in range(4))),))
    run(scheduler, (Step(now=1.0, add=(req("b0", prompt=4, max_tokens=50, tenant="b"),)),))
    # b runs (nothing of its waits): a's prefills are not held to a share.
    plan = run(scheduler, (Step(now=2.0),))
    assert plan.decode == ("b0",)
    assert sum(c.length for c in plan.prefill) == 127


# --- prefix caching ----------------------------------------------------------------


def test_the_pool_shares_a_cached_prefix_and_keeps_it_once_free() -> None:
    pool = BlockPool(6)
    assert pool.take("a", 3, prefix=(11, 12)) == (0, 1, 2)  # nothing cached yet
    pool.register(0, 11)
    pool.register(1, 12)
    assert pool.needed(3, (11, 12, 13)) == 1  # two of the three are there, in use
    assert pool.take("b", 3, prefix=(11, 12, 13)) == (0, 1, 3)
    assert pool.owners() == {"a": (0, 1, 2), "b": (0, 1, 3)} and pool.used == 4
    with pytest.raises(ValueError, match="held by a, b"):
        pool.give_back("c", (0,))
    pool.give_back("a", (0, 1, 2))
    assert pool.owners() == {"b": (0, 1, 3)} and pool.free == 3  # 0 and 1 still b's
    pool.give_back("b", (0, 1, 3))
    assert pool.free == 6 and pool.cached == 2
    # Free, the prefix is still there: taken again from where it waits in the free list.
    assert pool.take("c", 2, prefix=(11, 12)) == (0, 1)
    # The oldest free blocks go first (a holder's last block first), and a cached one
    # handed out loses its prefix.
    pool.give_back("c", (0, 1))
    assert pool.take("d", 5) == (4, 5, 2, 3, 1)
    assert pool.hits((11, 12)) == [0] and pool.cached == 1
    with pytest.raises(ValueError, match="2 blocks asked, 1 free"):
        pool.take("e", 2, prefix=(99,))


def test_a_different_block_breaks_the_shared_prefix_there() -> None:
    one = prefix_hashes(list(range(12)), 4)
    two = prefix_hashes([*range(4), 9, *range(5, 12)], 4)
    assert len(one) == 3 and one[0] == two[0]
    assert one[1] != two[1] and one[2] != two[2]  # each hash covers everything before it
    assert prefix_hashes(list(range(11)), 4) == one[:2]  # only full blocks


def prefixed(id: str, prompt: int, common: list[int], **fields: Any) -> GenerationRequest:
    tokens = common + [1000 + ord(c) for c in id] * prompt
    return GenerationRequest(id, prompt, 4, prefix=prefix_hashes(tokens[:prompt], 4), **fields)


# Three steps: an 18-token prompt prefilled in chunks of 8, 8 and 2 (its blocks are
# offered to the cache as their KV is computed).
PREFILLED = (Step(), Step())


def test_a_prompt_whose_prefix_is_cached_prefills_only_the_rest() -> None:
    scheduler = make()
    common = list(range(16))
    first = run(scheduler, (Step(add=(prefixed("a", 18, common),)),))
    assert first.cached == {} and first.prefill[0].start == 0  # nothing there before it
    run(scheduler, PREFILLED)
    plan = run(scheduler, (Step(add=(prefixed("b", 18, common), prefixed("c", 8, common))),))
    # b: 16 of its 18 tokens are a's four full blocks; c's prompt is two blocks, of which
    # the last is computed again: its last token's computation gives its first token.
    assert plan.cached == {"b": 16, "c": 4}
    assert [(c.id, c.start, c.length) for c in plan.prefill] == [("b", 16, 2), ("c", 4, 4)]
    owned = scheduler.owned_blocks()
    assert owned["b"][:4] == owned["a"][:4] and owned["c"][:1] == owned["a"][:1]
    assert scheduler.blocks_used == 6 + 2 + 2  # a's 6, then b's and c's own


def test_blocks_are_shared_only_once_their_kv_is_computed() -> None:
    scheduler = make()
    common = list(range(16))
    plan = run(scheduler, (Step(add=(prefixed("a", 18, common), prefixed("b", 18, common))),))
    assert plan.cached == {} and scheduler.blocks_used == 12  # alike, admitted together
    # c comes after a's first chunk only: the two blocks it computed are shared.
    plan = run(scheduler, (Step(add=(prefixed("c", 18, common),)),))
    assert plan.cached == {"c": 8}


def test_a_shared_prefix_needs_no_free_block_and_outlives_its_first_holder() -> None:
    scheduler = make(kv_blocks=8)
    common = list(range(16))
    run(scheduler, (Step(add=(prefixed("a", 18, common),)), *PREFILLED))  # 6 blocks of 8
    plan = run(scheduler, (Step(add=(prefixed("b", 18, common),)),))
    assert plan.admitted == ("b",) and plan.cached == {"b": 16}  # 2 free blocks were enough
    plan = run(scheduler, (Step(finish={"a": STOP}),))
    assert scheduler.owned_blocks().keys() == {"b"} and scheduler.blocks_used == 6


def test_a_preempted_sequence_takes_its_own_prefix_back() -> None:
    scheduler = make(kv_blocks=8)
    common = list(range(16))
    run(scheduler, (Step(add=(prefixed("b", 18, common, lane=B),)), *PREFILLED))
    plan = run(scheduler, (Step(add=(req("u", prompt=12, max_tokens=8, lane=U),)),))
    assert plan.preempted == ("b",) and plan.admitted == ("u",)
    run(scheduler, (Step(finish={"u": STOP}),))
    plan = run(scheduler, (Step(),))
    # u's blocks were the free ones, then b's last three (the last first): the prefix
    # blocks u did not take are still b's to take back.
    assert plan.resumed == ("b",) and plan.cached == {"b": 12}
    assert [(c.start, c.length) for c in plan.prefill] == [(12, 7)]


def test_a_sequence_in_a_failed_step_computes_its_prompt_itself_and_shares_nothing() -> None:
    scheduler = make()
    common = list(range(16))
    run(scheduler, (Step(add=(prefixed("a", 18, common),)), *PREFILLED))
    scheduler.add(prefixed("b", 18, common))
    plan = scheduler.schedule(0.0)
    assert plan.cached == {"b": 16}
    assert scheduler.abort(plan) == ("b", "a")
    # The blocks the failed step read are no one's prefix any more...
    assert scheduler._pool.hits(prefixed("c", 18, common).prefix) == []
    # ...and each one, alone, computes its prompt itself (a first: admitted first).
    plan = scheduler.schedule(0.0)
    assert plan.cached == {} and [(c.id, c.start) for c in plan.prefill] == [("a", 0)]


def test_an_urgent_request_counts_the_prefix_blocks_it_shares_when_it_evicts() -> None:
    scheduler = make(kv_blocks=9)
    common = list(range(16))
    # h, urgent, holds 6 blocks (4 of them its prefix); b, bulk, the other 3.
    run(scheduler, (Step(add=(prefixed("h", 18, common, lane=U),)), *PREFILLED))
    run(scheduler, (Step(add=(req("b", prompt=8, max_tokens=4, lane=B),)),))
    assert scheduler.blocks_free == 0
    # u shares h's 4 prefix blocks: it needs 2 more, which evicting b frees.
    plan = run(scheduler, (Step(add=(prefixed("u", 18, common, lane=U),)),))
    assert plan.preempted == ("b",) and plan.admitted == ("u",) and plan.cached == {"u": 16}
