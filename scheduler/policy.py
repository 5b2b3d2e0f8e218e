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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

LANE_ORDER = {"urgent": 0, "vip": 1, "normal": 2, "bulk": 3}
INF = float("inf")


@dataclass(frozen=True)
class PendingItem:
    """One job waiting in a worker."""

    key: str  # the caller's handle (the stream entry id)
    lane: str  # urgent | vip | normal | bulk
    cost: int
    arrival_s: float  # when the job was accepted
    deadline_s: float | None = None  # when it must have finished, if ever


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
    ``urgent_batch_s``: the same for a batch that carries urgent items.
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
    urgent_batch_s: float = INF

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if not self.window_s >= 0:  # also refuses NaN
            raise ValueError("window_s must be a non-negative number")
        if not self.max_batch_cost > 0:
            raise ValueError("max_batch_cost must be positive")
        if self.bulk_slots < 0 or self.idle_queue < 0:
            raise ValueError("bulk_slots and idle_queue must not be negative")
        if not (self.max_batch_s > 0 and self.urgent_batch_s > 0):
            raise ValueError("max_batch_s and urgent_batch_s must be positive")

    @property
    def max_work(self) -> float:
        """The work cap: the cost, memory or latency limit, whichever is lowest."""
        return self.work_limit(urgent=False)[0]

    def work_limit(self, urgent: bool) -> tuple[float, str]:
        """The work cap of a batch, with urgent items or without, and what sets it."""
        limits = [
            (self.max_batch_cost, "cost"),
            (self.memory.inverse(self.memory_limit), "memory"),
            (self.latency.inverse(self.max_batch_s), "latency"),
        ]
        if urgent:
            limits.append((self.latency.inverse(self.urgent_batch_s), "latency"))
        return min(limits, key=lambda limit: limit[0])

    def work(self, count: int, total_cost: float, max_cost: float) -> float:
        return count * max_cost if self.padded else total_cost


@dataclass(frozen=True)
class BatchDecision:
    """What the worker should do now.

    ``run``: the items to run as one batch now, in order (empty: run nothing).
    ``expire``: items whose deadline has passed or can no longer be met; end
    them without running. ``wait_s``: when nothing runs, how long until the
    policy should be asked again even if nothing new arrives (``None``: nothing
    pending, wait for work). ``trigger``: why the batch was dispatched
    (``urgent``, ``size``, ``cost``, ``memory``, ``latency``, ``deadline``,
    ``time``, ``idle``).
    ``predicted_s``: the predicted latency of the batch.
    """

    run: tuple[PendingItem, ...] = ()
    expire: tuple[PendingItem, ...] = ()
    wait_s: float | None = None
    trigger: str | None = None
    predicted_s: float = 0.0


def order_key(item: PendingItem) -> tuple[int, float, float]:
    """Lane first, then earliest deadline, then arrival."""
    deadline = item.deadline_s if item.deadline_s is not None else INF
    return (LANE_ORDER[item.lane], deadline, item.arrival_s)


def efficiency(costs: Sequence[int]) -> float:
    """Useful work over computed work when every input is padded to the longest."""
    if not costs:
        return 1.0
    return sum(costs) / (len(costs) * max(costs))


def decide(pending: Iterable[PendingItem], profile: Profile, now: float) -> BatchDecision:
    expire: list[PendingItem] = []
    live: list[PendingItem] = []
    for item in pending:
        if item.deadline_s is not None and _alone_finishes_at(item, profile, now) >= item.deadline_s:
            expire.append(item)
        else:
            live.append(item)
    if not live:
        return BatchDecision(expire=tuple(expire))

    live.sort(key=order_key)
    batch, limit = _select(live, profile)
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

    trigger: str | None
    if any(item.lane == "urgent" for item in batch):
        trigger = "urgent"
    elif limit is not None:
        trigger = limit
    elif sum(item.cost for item in live) >= profile.target_cost:
        trigger = "cost"
    elif slack_s <= max(0.0, window_s - waited_s):
        # Waiting out the window would leave no slack for the earliest deadline.
        trigger = "deadline"
    elif waited_s >= window_s:
        trigger = "idle" if window_s < profile.window_s else "time"
    else:
        trigger = None

    if trigger is not None:
        return BatchDecision(
            run=tuple(batch), expire=tuple(expire), trigger=trigger, predicted_s=predicted_s
        )
    wait_s = max(0.0, min(window_s - waited_s, slack_s))
    return BatchDecision(expire=tuple(expire), wait_s=wait_s)


def _alone_finishes_at(item: PendingItem, profile: Profile, now: float) -> float:
    return now + profile.latency(profile.work(1, item.cost, item.cost))


def _select(live: list[PendingItem], profile: Profile) -> tuple[list[PendingItem], str | None]:
    """The batch to run next, and the limit that closed it (``None``: it has room).

    Lanes are taken in order. A lane that fits whole is taken whole. A lane
    that does not fit is cut to the items of similar cost that give the best
    throughput; once a limit (size, cost, memory, latency) cuts a lane, no
    lower lane may join (no overtaking), except the bulk lane's reserved slots.
    A padded lane's items of a different cost that were left out by choice (a
    batch of their own pads less) do not close the batch: lower lanes' items
    of similar cost may still fill it, and the left-out items lead the next one.
    """
    lanes: dict[int, list[PendingItem]] = {}
    for item in live:
        lanes.setdefault(LANE_ORDER[item.lane], []).append(item)
    bulk = lanes.get(LANE_ORDER["bulk"], [])
    reserved = min(profile.bulk_slots, len(bulk), profile.max_batch_size - 1)
    max_work, work_name = profile.work_limit(urgent=LANE_ORDER["urgent"] in lanes)

    batch: list[PendingItem] = []
    limit: str | None = None
    for rank in sorted(lanes):
        items = lanes[rank]
        is_bulk = rank == LANE_ORDER["bulk"]
        room = profile.max_batch_size - len(batch) - (0 if is_bulk else reserved)
        chosen, lane_limit = _best_group(batch, items, room, profile, max_work, work_name)
        batch += chosen
        if lane_limit is not None and limit is None:
            limit = lane_limit
        if lane_limit is not None and not is_bulk:
            # Cut by a limit: only the bulk lane's reserved slots may still be filled.
            if reserved:
                chosen, lane_limit = _best_group(
                    batch, bulk, reserved, profile, max_work, work_name
                )
                batch += chosen
            break
    if len(batch) >= profile.max_batch_size:
        limit = "size"
    return batch, limit


def _best_group(
    batch: list[PendingItem],
    items: list[PendingItem],
    room: int,
    profile: Profile,
    max_work: float,
    work_name: str,
) -> tuple[list[PendingItem], str | None]:
    """Items of one lane to add to ``batch``: a run of similar costs, best throughput first.

    With nothing in the batch yet, the lane's first item (in order) must be in
    the group, so every item's turn comes; otherwise a group joins only if it
    raises the batch's throughput. Returns the group and the limit that kept it
    from growing (``size``, or ``work_name`` for ``max_work``), if one did.
    """
    if room <= 0 or not items:
        return [], ("size" if items else None)
    base_n = len(batch)
    base_cost = sum(item.cost for item in batch)
    base_max = max((item.cost for item in batch), default=0)

    def limited(count: int, total: float, top: float) -> str | None:
        if count > room:
            return "size"
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
        base_rate = base_cost / max(profile.latency(profile.work(base_n, base_cost, base_max)), 1e-12)
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
