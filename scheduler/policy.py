"""Ferry's batching policy: which pending items run now, which expire, how long to wait.

The worker keeps a local set of pending items and asks :func:`decide` what to
do with them; it applies the returned :class:`BatchDecision` and asks again.
Everything :func:`decide` knows comes in its arguments: the items, the model's
:class:`Profile` (limits plus what has been learned about the model) and
``now``. Times are seconds on one clock chosen by the caller.

A batch's *work* is what the model really computes: for a padded model every
input is padded to the longest one, so the work is ``n x max cost``; for an
unpadded model it is the sum of the costs. Latency and memory are predicted
from the work; *efficiency* is ``sum cost / (n x max cost)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from scheduler.vocabulary import RANK, Lane, Trigger, batch_work, work_of

INF = float("inf")
# The efficiency floor is dropped while clearing everything pending would
# take more than this share of the tightest non-urgent deadline's slack:
# a backlog clears fastest without it.
PRESSED_SHARE = 0.5
DUE_SHARE = 0.5  # a padded batch is led by an item that has waited this share of its deadline


@dataclass(frozen=True)
class PendingItem:
    """One job waiting in a worker."""

    key: str  # the caller's handle (the stream entry id)
    lane: str  # a Lane
    cost: int
    arrival_s: float  # when the job was accepted
    deadline_s: float | None = None  # when it must have finished, if ever
    tenant: str = ""  # whose job it is (the API key)
    # When the tenant last had a job in a batch, as a count of the caller's
    # batches (-1: never); with several tenants pending, the one served least
    # recently goes first among equals.
    last_served: int = -1


@dataclass(frozen=True)
class LinearFit:
    """``y = intercept + slope x``; the learned latency (s) or peak memory (bytes) of a batch."""

    intercept: float = 0.0
    slope: float = 0.0

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x

    def inverse(self, y: float) -> float:
        """The largest ``x`` whose prediction stays at or below ``y``."""
        if self.slope <= 0:
            return INF if self.intercept <= y else 0.0
        return (y - self.intercept) / self.slope


@dataclass(frozen=True)
class Profile:
    """A model's limits and learned behaviour, as the policy sees them at one moment.

    ``max_batch_size``/``max_batch_cost``: hard limits on items and on work.
    ``window_s``: how long the oldest item of a batch may wait for company (the
    caller adapts it). ``target_cost``: the batch cost the current load supplies;
    once that much is pending there is no point waiting. ``latency``/``memory``:
    the learned fits over work. ``memory_limit``: the memory a batch may be
    predicted to peak at (a fraction of the budget, lowered after an
    out-of-memory). ``bulk_slots``: slots of each batch kept for the bulk lane
    while it is backlogged. ``idle``: the model has had nothing to run for a
    while, so a short queue runs at once instead of waiting out the window.
    ``max_batch_s``: no batch of more than one item may be predicted to take
    longer (the caller sets it while urgent traffic is about: a GPU cannot be
    preempted, so an urgent job first waits for the batch already running).
    ``urgent_latency_s``: an urgent job should be done this long after it
    arrived; the items that ride along with urgent ones are limited so that
    the batch is predicted to end by then. ``min_efficiency``: for a padded
    model with more pending than one batch holds, the least share of a batch's
    work that is not padding (the first item in order still runs at once).
    ``bulk_turn``: the bulk lane has had no job in a batch for a while; unless
    an urgent job is pending, its first job leads this batch (so bulk never
    starves, whatever limit closes the batches).
    ``bulk_ride_factor``: in a batch that carries interactive (non-bulk) items,
    bulk items beyond the reserved slots ride along only while the batch is
    predicted to take at most this x what the interactive items alone would
    (a backfill uses the capacity live traffic leaves, not its latency).
    """

    max_batch_size: int
    window_s: float
    max_batch_cost: float = INF
    target_cost: float = INF
    padded: bool = False
    latency: LinearFit = LinearFit()
    memory: LinearFit = LinearFit()
    memory_limit: float = INF
    bulk_slots: int = 0
    idle: bool = False
    idle_queue: int = 1
    max_batch_s: float = INF
    urgent_latency_s: float = INF
    min_efficiency: float = 0.0
    bulk_turn: bool = False
    bulk_ride_factor: float = INF

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if not self.window_s >= 0:  # also refuses NaN
            raise ValueError("window_s must be a non-negative number")
        if not self.max_batch_cost > 0:
            raise ValueError("max_batch_cost must be positive")
        if self.bulk_slots < 0 or self.idle_queue < 0:
            raise ValueError("bulk_slots and idle_queue must not be negative")
        if not (self.max_batch_s > 0 and self.urgent_latency_s > 0):
            raise ValueError("max_batch_s and urgent_latency_s must be positive")
        if not 0 <= self.min_efficiency <= 1:
            raise ValueError("min_efficiency must be in [0, 1]")
        if not self.bulk_ride_factor >= 1:
            raise ValueError("bulk_ride_factor must be at least 1")

    @property
    def max_work(self) -> float:
        """The work cap: the cost, memory or latency limit, whichever is lowest."""
        return self.work_limit()[0]

    def work_limit(self) -> tuple[float, Trigger]:
        """The work cap of a batch and the name of the limit that sets it."""
        limits = [
            (self.max_batch_cost, Trigger.COST),
            (self.memory.inverse(self.memory_limit), Trigger.MEMORY),
            (self.latency.inverse(self.max_batch_s), Trigger.LATENCY),
        ]
        return min(limits, key=lambda limit: limit[0])

    def work(self, count: int, total_cost: float, max_cost: float) -> float:
        return work_of(count, total_cost, max_cost, self.padded)


@dataclass(frozen=True)
class BatchDecision:
    """What the worker should do now.

    ``run``: the items to run as one batch now, in order (empty: run nothing).
    ``expire``: items whose deadline has passed or can no longer be met; end
    them without running. ``wait_s``: when nothing runs, how long until the
    policy should be asked again even if nothing new arrives (``None``: nothing
    pending, wait for work). ``trigger``: why the batch was dispatched
    (a :class:`~scheduler.vocabulary.Trigger`).
    ``predicted_s``: the predicted latency of the batch.
    """

    run: tuple[PendingItem, ...] = ()
    expire: tuple[PendingItem, ...] = ()
    wait_s: float | None = None
    trigger: Trigger | None = None
    predicted_s: float = 0.0


def order_key(item: PendingItem) -> tuple[int, float, float]:
    """Lane first, then earliest deadline, then arrival."""
    deadline = item.deadline_s if item.deadline_s is not None else INF
    return (RANK[item.lane], deadline, item.arrival_s)


def fair_order(items: list[PendingItem]) -> list[PendingItem]:
    """Lane first, then the tenants in turn: each one's first job, then each one's second...

    Within a tenant the order is :func:`order_key`'s. Among jobs of equal turn
    the tenant served least recently goes first, then the earliest deadline,
    then arrival. With one tenant this is exactly :func:`order_key`'s order;
    with several, a tenant's backlog (or its deadlines) cannot put its jobs
    ahead of another tenant's first one.
    """
    items = sorted(items, key=order_key)
    if len({item.tenant for item in items}) < 2:
        return items
    seen: dict[tuple[str, str], int] = {}
    turns: dict[int, int] = {}
    for item in items:
        group = (item.tenant, item.lane)
        turns[id(item)] = seen.get(group, 0)
        seen[group] = turns[id(item)] + 1
    # Stable: ties keep order_key's order (deadline, then arrival).
    return sorted(items, key=lambda item: (RANK[item.lane], turns[id(item)], item.last_served))


def efficiency(costs: Sequence[int]) -> float:
    """Useful work over computed work when every input is padded to the longest."""
    if not costs:
        return 1.0
    return sum(costs) / batch_work(costs, padded=True)


def decide(pending: Iterable[PendingItem], profile: Profile, now: float) -> BatchDecision:
    """What to do with ``pending`` at ``now``: the items whose deadline even a batch of one
    could not meet expire; of the rest, a batch is chosen in fair order (lanes, then tenants
    in turn) up to the profile's limits, and it runs now when something closes it (an urgent
    item, a limit reached, the target cost, the earliest deadline's slack, or the wait
    window), otherwise the decision says how long to wait before asking again."""
    expire: list[PendingItem] = []
    live: list[PendingItem] = []
    for item in pending:
        if (
            item.deadline_s is not None
            and _alone_finishes_at(item, profile, now) >= item.deadline_s
        ):
            expire.append(item)
        else:
            live.append(item)
    if not live:
        return BatchDecision(expire=tuple(expire))

    live = fair_order(live)
    batch, limit = _select(live, profile, now)
    batch, limit = _bulk_riders(batch, limit, profile)
    costs = [item.cost for item in batch]
    predicted_s = profile.latency(profile.work(len(batch), sum(costs), max(costs)))
    window_s = profile.window_s
    if profile.idle and len(live) <= profile.idle_queue:
        window_s = 0.0
    oldest = min(item.arrival_s for item in batch)
    waited_s = now - oldest
    slack_s = min(
        (item.deadline_s - now - predicted_s for item in batch if item.deadline_s is not None),
        default=INF,
    )

    trigger: Trigger | None
    if any(item.lane == Lane.URGENT for item in batch):
        trigger = Trigger.URGENT
    elif limit is not None:
        trigger = limit
    elif sum(item.cost for item in live) >= profile.target_cost:
        trigger = Trigger.COST
    elif slack_s <= max(0.0, window_s - waited_s):
        # Waiting out the window would leave no slack for the earliest deadline.
        trigger = Trigger.DEADLINE
    elif waited_s >= window_s - 1e-9:  # a wait of under a nanosecond is no wait
        trigger = Trigger.IDLE if window_s < profile.window_s else Trigger.TIME
    else:
        trigger = None

    if trigger is not None:
        return BatchDecision(
            run=tuple(batch), expire=tuple(expire), trigger=trigger, predicted_s=predicted_s
        )
    wait_s = max(0.0, min(window_s - waited_s, slack_s))
    return BatchDecision(expire=tuple(expire), wait_s=wait_s)


def _bulk_riders(
    batch: list[PendingItem], limit: Trigger | None, profile: Profile
) -> tuple[list[PendingItem], Trigger | None]:
    """Drop the bulk items past the ride limit from a batch that carries interactive ones.

    The reserved slots stay (so a backfill always moves); the others may only
    stretch the batch to ``bulk_ride_factor`` x the interactive items' latency.
    A batch cut here is closed by latency: it runs now.
    """
    if not math.isfinite(profile.bulk_ride_factor):
        return batch, limit
    interactive = [item for item in batch if item.lane != Lane.BULK]
    if not interactive or len(interactive) == len(batch):
        return batch, limit

    def seconds(items: list[PendingItem]) -> float:
        costs = [item.cost for item in items]
        return profile.latency(profile.work(len(costs), sum(costs), max(costs)))

    allowed_s = seconds(interactive) * profile.bulk_ride_factor
    kept = list(interactive)
    riders = 0
    for item in batch:
        if item.lane != Lane.BULK:
            continue
        if riders >= profile.bulk_slots and seconds([*kept, item]) > allowed_s:
            cut = [i for i in batch if i.lane != Lane.BULK or any(i is k for k in kept)]
            return cut, Trigger.LATENCY
        kept.append(item)
        riders += 1
    return batch, limit


def _alone_finishes_at(item: PendingItem, profile: Profile, now: float) -> float:
    return now + profile.latency(profile.work(1, item.cost, item.cost))


def _select(
    live: list[PendingItem], profile: Profile, now: float
) -> tuple[list[PendingItem], Trigger | None]:
    """The batch to run next, and the limit that closed it (``None``: it has room).

    Without padding, lanes are taken in order: a lane that fits whole is taken
    whole, the first that does not is cut where a limit (size, cost, memory,
    latency) is reached, and no lower lane may then join (no overtaking),
    except the bulk lane's reserved slots. A padded model's batch is a cost
    band instead (see :func:`_select_padded`).
    """
    lanes: dict[int, list[PendingItem]] = {}
    for item in live:
        lanes.setdefault(RANK[item.lane], []).append(item)
    bulk = lanes.get(Lane.BULK.rank, [])
    reserved = min(profile.bulk_slots, len(bulk), profile.max_batch_size - 1)
    limits = _Limits(*profile.work_limit(), *profile.work_limit())
    urgent = lanes.get(Lane.URGENT.rank)
    if urgent and math.isfinite(profile.urgent_latency_s):
        left_s = profile.urgent_latency_s - (now - min(item.arrival_s for item in urgent))
        ride = profile.latency.inverse(left_s) if left_s > 0 else 0.0
        if ride < limits.ride_work:
            limits = _Limits(limits.work, limits.name, ride, Trigger.LATENCY)
    batch: list[PendingItem] = []
    if profile.bulk_turn and bulk and not urgent:
        first = bulk[0]
        live = [first] + [item for item in live if item is not first]
        if profile.padded:
            return _select_padded(live, profile, now, reserved, limits, bulk_turn=True)
        batch.append(first)
        lanes[Lane.BULK.rank] = bulk = bulk[1:]
        reserved = min(reserved, len(bulk))
    if profile.padded:
        return _select_padded(live, profile, now, reserved, limits)

    limit: Trigger | None = None
    for rank in sorted(lanes):
        items = lanes[rank]
        is_bulk = rank == Lane.BULK.rank
        room = profile.max_batch_size - len(batch) - (0 if is_bulk else reserved)
        max_work, work_name = limits.of(rank == Lane.URGENT.rank)
        chosen, lane_limit = _best_group(batch, items, room, profile, max_work, work_name)
        batch += chosen
        if lane_limit is not None and limit is None:
            limit = lane_limit
        if lane_limit is not None and not is_bulk:
            # Cut by a limit: only the bulk lane's reserved slots may still be filled.
            if reserved:
                max_work, work_name = limits.of(False)
                chosen, lane_limit = _best_group(
                    batch, bulk, reserved, profile, max_work, work_name
                )
                batch += chosen
            break
    if len(batch) >= profile.max_batch_size:
        limit = Trigger.SIZE
    return batch, limit


@dataclass(frozen=True)
class _Limits:
    """The work cap of the urgent items, and that of the items riding along with them."""

    work: float
    name: Trigger
    ride_work: float
    ride_name: Trigger

    def of(self, urgent: bool) -> tuple[float, Trigger]:
        return (self.work, self.name) if urgent else (self.ride_work, self.ride_name)


def _select_padded(
    live: list[PendingItem],
    profile: Profile,
    now: float,
    reserved: int,
    limits: _Limits,
    bulk_turn: bool = False,
) -> tuple[list[PendingItem], Trigger | None]:
    """A padded model's batch: the first item in order and the pending items of similar cost.

    Every input is padded to the batch's longest, so the batch is a cost band
    ``[low, top]`` that holds the head's cost: the head (the first item in
    order, which must run now so that every item's turn comes; with it every
    urgent item that fits) plus the items whose cost lies in the band,
    whatever their lane, taken in order (:func:`fair_order`) while they fit.
    The band is the one whose batch gives the most useful work per second
    (``sum cost / predicted latency``):
    while few items are pending that mixes costs (the fixed cost of a batch
    dominates); once the limits bind, it is the band that wastes least on
    padding. ``min_efficiency`` may forbid the mixing while more is pending
    than one batch holds. An item outside the band waits for a batch of its
    own cost, which it leads when it comes first in order; an item that has
    waited half its time to its deadline leads before any higher lane but
    the urgent one, so that an odd cost in a lower lane is never starved.
    """
    head = live[0]
    if head.lane != Lane.URGENT and not bulk_turn:
        # An item that has used up half its time to the deadline leads, earliest
        # deadline first: an odd-cost item of a lower lane may match no band
        # while higher lanes always have work pending.
        due = [item for item in live if _due(item, now)]
        if due:
            head = min(due, key=lambda item: (item.deadline_s, item.arrival_s))
            live = [head] + [item for item in live if item is not head]
    if head.lane == Lane.BULK:
        reserved = 0  # nothing but bulk is pending
    room = profile.max_batch_size - reserved

    def fits(top: int, max_work: float) -> int:
        """How many items of cost at most ``top`` a batch may hold."""
        by_work = int(max_work // top) if math.isfinite(max_work) else room
        return min(room, by_work)

    # The head runs now; so does every urgent item that fits beside it.
    forced = [head]
    if head.lane == Lane.URGENT:
        for item in live[1:]:
            if item.lane != Lane.URGENT:
                break
            top = max(item.cost, max(f.cost for f in forced))
            if len(forced) + 1 > fits(top, limits.work):
                break
            forced.append(item)
    max_work, work_name = limits.ride_work, limits.ride_name  # for the items riding along
    forced_keys = {id(item) for item in forced}
    floor = max(item.cost for item in forced)
    forced_cost = sum(item.cost for item in forced)
    counts: dict[int, int] = {floor: 0}
    for item in live:
        if id(item) not in forced_keys and (item.lane != Lane.BULK or not reserved):
            counts[item.cost] = counts.get(item.cost, 0) + 1
    values = sorted(counts)
    at = values.index(floor)

    # Pending more than one batch holds: the rest will fill batches of their
    # own, so a batch must not waste more than this on padding.
    top_all = max(item.cost for item in live)
    floor_eff = profile.min_efficiency
    if len(live) <= fits(top_all, max_work) or _pressed(live, profile, now, max_work):
        # Everything fits in one batch, or deadlines are at stake: throughput
        # first (a backlog of due jobs clears fastest without the floor).
        floor_eff = 0.0
    work = len(forced) * floor
    best = (forced_cost / max(profile.latency(work), 1e-12), INF, floor)  # (rate, low, top)
    for j in range(at, len(values)):
        top = values[j]
        cap = fits(top, max_work)
        if cap <= len(forced):
            break  # not even one more item this long fits beside the forced ones
        count, total = len(forced), forced_cost
        for i in range(j, -1, -1):
            if count >= cap:
                break
            take = min(counts[values[i]], cap - count)
            count += take
            total += take * values[i]
            if values[i] > floor:
                continue  # the band must reach down to the head's cost
            rate = total / max(profile.latency(count * top), 1e-12)
            if total < floor_eff * count * top:
                continue
            if rate > best[0] * (1 + 1e-9):
                best = (rate, values[i], top)
    _, low, top = best
    cap = max(len(forced), fits(top, max_work))
    batch = list(forced)
    limit: Trigger | None = None
    for item in live[1:]:
        if id(item) in forced_keys:
            continue
        if low <= item.cost <= top and (item.lane != Lane.BULK or not reserved):
            if len(batch) >= cap:
                limit = Trigger.SIZE if cap >= room else work_name
                break
            batch.append(item)
    if limit is None:
        # Full when the next item in order would not fit beside the batch;
        # otherwise the rest was left out by choice and the batch has room.
        taken = {id(item) for item in batch}
        following = next((item for item in live if id(item) not in taken), None)
        if following is not None and not (following.lane == Lane.BULK and reserved):
            top_with = max(following.cost, max(item.cost for item in batch))
            if len(batch) + 1 > room:
                limit = Trigger.SIZE
            elif (len(batch) + 1) * top_with > max_work:
                limit = work_name
    if reserved:
        bulk = [item for item in live if item.lane == Lane.BULK and id(item) not in forced_keys]
        chosen, _ = _best_group(batch, bulk, reserved, profile, max_work, work_name)
        batch += chosen
    if len(batch) >= profile.max_batch_size:
        limit = Trigger.SIZE
    return batch, limit


def _pressed(live: list[PendingItem], profile: Profile, now: float, max_work: float) -> bool:
    """Whether the pending items would take too long to clear for their deadlines."""
    slack = min(
        (i.deadline_s - now for i in live if i.deadline_s is not None and i.lane != Lane.URGENT),
        default=INF,
    )
    if math.isinf(slack):
        return False
    total = sum(item.cost for item in live)
    batches = math.ceil(len(live) / profile.max_batch_size)
    if math.isfinite(max_work) and max_work > 0:
        batches = max(batches, math.ceil(total / max_work))
    fit = profile.latency
    # Padded work is at least the cost, and at the floor's efficiency 1/floor times it.
    work = total / max(profile.min_efficiency, 0.5) if profile.padded else total
    return batches * fit.intercept + fit.slope * work >= PRESSED_SHARE * slack


def _due(item: PendingItem, now: float, share: float = DUE_SHARE) -> bool:
    if item.deadline_s is None:
        return False
    return now - item.arrival_s >= share * (item.deadline_s - item.arrival_s)


def _best_group(
    batch: list[PendingItem],
    items: list[PendingItem],
    room: int,
    profile: Profile,
    max_work: float,
    work_name: Trigger,
) -> tuple[list[PendingItem], Trigger | None]:
    """Items of one lane to add to ``batch``: a run of similar costs, best throughput first.

    With nothing in the batch yet, the lane's first item (in order) must be in
    the group, so every item's turn comes; otherwise a group joins only if it
    raises the batch's throughput. Returns the group and the limit that kept it
    from growing (``size``, or ``work_name`` for ``max_work``), if one did.
    """
    if room <= 0 or not items:
        return [], (Trigger.SIZE if items else None)
    base_n = len(batch)
    base_cost = sum(item.cost for item in batch)
    base_max = max((item.cost for item in batch), default=0)

    def limited(count: int, total: float, top: float) -> Trigger | None:
        if count > room:
            return Trigger.SIZE
        if base_n + count == 1:
            return None  # one item always runs, even when predicted over the limit
        if profile.work(base_n + count, base_cost + total, max(base_max, top)) > max_work:
            return work_name
        return None

    if not profile.padded:
        # No padding to save: take the lane in order until a limit is reached.
        chosen: list[PendingItem] = []
        total = 0
        for item in items:
            why = limited(len(chosen) + 1, total + item.cost, 0)
            if why is not None:
                return chosen, why
            chosen.append(item)
            total += item.cost
        return chosen, None

    by_cost = sorted(range(len(items)), key=lambda i: (items[i].cost, i))
    costs = [items[i].cost for i in by_cost]
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    head_at = by_cost.index(0) if base_n == 0 else None

    best: tuple[float, int, int] | None = None  # (rate, start, end) over by_cost[start:end]
    if base_n:
        # A group must do better than the batch without it.
        base_rate = base_cost / max(
            profile.latency(profile.work(base_n, base_cost, base_max)), 1e-12
        )
    starts = range(head_at + 1) if head_at is not None else range(len(costs))
    for start in starts:
        first_end = head_at + 1 if head_at is not None else start + 1
        for end in range(first_end, len(costs) + 1):
            count = end - start
            total = prefix[end] - prefix[start]
            if limited(count, total, costs[end - 1]) is not None:
                break
            work = profile.work(base_n + count, base_cost + total, max(base_max, costs[end - 1]))
            rate = (base_cost + total) / max(profile.latency(work), 1e-12)
            if (best is None or rate > best[0] * (1 + 1e-9)) and (
                not base_n or rate > base_rate * (1 + 1e-9)
            ):
                best = (rate, start, end)
    if best is None:
        # No group fits beside what the batch holds, or none would raise its
        # throughput: the batch is full if the lane's next item breaks a limit.
        return [], limited(1, items[0].cost, items[0].cost)
    _, start, end = best
    chosen = [items[i] for i in sorted(by_cost[start:end])]
    if len(chosen) == len(items):
        return chosen, None
    # Full when the next item in lane order would break a limit; otherwise the
    # rest was left out by choice (a different cost group) and the batch has room.
    taken = set(by_cost[start:end])
    following = items[next(i for i in range(len(items)) if i not in taken)]
    return chosen, limited(
        len(chosen) + 1,
        sum(item.cost for item in chosen) + following.cost,
        max(following.cost, max(item.cost for item in chosen)),
    )
