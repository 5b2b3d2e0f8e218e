"""Prometheus metrics: every name Ferry exports, in one place.

Each process (API, GPU worker, Celery worker) exports the metrics it updates
at ``/metrics``: the API on its own port, the others on
``FERRY_METRICS_PORT``. Queue state (depth, lag, pending entries) is read from
Redis when the API is scraped, so it is right whichever worker is alive.
Names follow Prometheus conventions: ``ferry_`` prefix, units in the name,
``_total`` for counters.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from core.models.estimates import ModelEstimate
from core.ops.autoscale import DesiredWorkers
from core.streams.queues import (
    arrivals,
    lane_states,
    live_workers,
    model_stats,
    nearest_deadline_ms,
    tenant_depths,
)
from scheduler.vocabulary import Lane

LATENCY_BUCKETS_S = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
COST_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)

# The API.
JOBS_ACCEPTED = Counter("ferry_jobs_accepted_total", "Jobs accepted (202).", ["model", "lane"])
JOBS_REFUSED = Counter(
    "ferry_jobs_refused_total",
    "New jobs refused by the API, by why (the error's type: queue_full, overloaded, "
    "deadline_unattainable, quota_exceeded, unavailable, ...).",
    ["model", "lane", "reason"],
)
BREAKER_LEVEL = Gauge(
    "ferry_breaker_level",
    "The model's circuit breaker in this API process: 0 closed, 1 sheds bulk, 2 sheds bulk "
    "and normal.",
    ["model"],
    multiprocess_mode="max",  # several API processes: the most shedding one's
)
HTTP_REQUESTS = Counter(
    "ferry_http_requests_total", "HTTP requests answered.", ["method", "route", "status"]
)
HTTP_DURATION = Histogram(
    "ferry_http_request_duration_seconds",
    "Time to answer an HTTP request (a long-poll counts its wait).",
    ["method", "route"],
    buckets=LATENCY_BUCKETS_S,
)
GRPC_REQUESTS = Counter(
    "ferry_grpc_requests_total",
    "Inference protocol gRPC calls answered, by method and status code.",
    ["method", "code"],
)
GRPC_DURATION = Histogram(
    "ferry_grpc_request_duration_seconds",
    "Time to answer an inference protocol gRPC call (an infer counts its jobs' wait).",
    ["method"],
    buckets=LATENCY_BUCKETS_S,
)

# Jobs reaching a terminal state: succeeded, failed, expired (workers),
# cancelled (API, backfill feeder).
JOBS_FINISHED = Counter(
    "ferry_jobs_finished_total", "Jobs that reached a terminal state.", ["model", "lane", "status"]
)
JOBS_DEAD_LETTERED = Counter(
    "ferry_jobs_dead_lettered_total",
    "Jobs that used up their attempts and went to the dead-letter stream.",
    ["model", "lane"],
)
JOB_LATENCY = Histogram(
    "ferry_job_latency_seconds",
    "End to end: accepted (or queued by the feeder) to result recorded.",
    ["model", "lane"],
    buckets=LATENCY_BUCKETS_S,
)
JOB_QUEUE_WAIT = Histogram(
    "ferry_job_queue_wait_seconds",
    "Accepted to its batch starting.",
    ["model", "lane"],
    buckets=LATENCY_BUCKETS_S,
)

# Batches (GPU workers).
BATCH_SIZE = Histogram("ferry_batch_size", "Jobs per batch.", ["model"], buckets=SIZE_BUCKETS)
BATCH_COST = Histogram(
    "ferry_batch_cost",
    "Summed job cost per batch (tokens for minilm).",
    ["model"],
    buckets=COST_BUCKETS,
)
BATCH_EFFICIENCY = Histogram(
    "ferry_batch_efficiency_ratio",
    "Sum of costs / (jobs x largest cost): the share of computed work that is not padding.",
    ["model"],
    buckets=RATIO_BUCKETS,
)
BATCH_LATENCY = Histogram(
    "ferry_batch_latency_seconds",
    "Observed time to run a batch.",
    ["model"],
    buckets=LATENCY_BUCKETS_S,
)
BATCH_PREDICTED = Histogram(
    "ferry_batch_predicted_latency_seconds",
    "The scheduler's prediction of the same batches' latency.",
    ["model"],
    buckets=LATENCY_BUCKETS_S,
)
BATCH_STAGE = Histogram(
    "ferry_batch_stage_seconds",
    "Time a batch spends in each stage: prepare (tokenise, decode, stage on the device), "
    "compute, record (the result write) and acknowledge (Redis).",
    ["model", "stage"],
    buckets=LATENCY_BUCKETS_S,
)
COMPUTE_SECONDS = Counter(
    "ferry_worker_compute_seconds_total",
    "Time a GPU worker spent running batches on its model (1 - its rate: the device's idle share).",
    ["model"],
)
BATCH_WINDOW = Gauge("ferry_batch_window_seconds", "The adaptive batching window now.", ["model"])
ENTRIES_RECLAIMED = Counter(
    "ferry_entries_reclaimed_total",
    "Stream entries taken over from a worker that stopped acknowledging them.",
    ["model"],
)
EVENTS_DROPPED = Counter(
    "ferry_worker_events_dropped_total",
    "Celery events (heartbeats, batches) a GPU worker could not send to Flower's broker.",
    ["model"],
)
MEMORY = Gauge(
    "ferry_worker_memory_bytes",
    "The worker's memory (kind=in_use, peak): on a GPU, what torch.cuda has allocated and "
    "the peak of the last batch; on the CPU, the process's resident set and its peak. "
    "On a GPU also kind=reserved (held by the caching allocator) and kind=fragmentation "
    "(reserved but not allocated).",
    ["model", "kind"],
)
GPU_MEMORY_RECLAIMS = Counter(
    "ferry_gpu_memory_reclaims_total",
    "Times a GPU worker gave fragmented memory back to the device (FERRY_GPU_RECLAIM_BYTES).",
    ["model"],
)

# Generation workers: observed once per step, and once per job as it ends.
TOKEN_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.035,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    1.0,
    2.5,
)
GENERATION_TOKENS = Counter(
    "ferry_generation_tokens_total",
    "Tokens generated (sampled) by a generation worker.",
    ["model"],
)
GENERATION_CACHED_TOKENS = Counter(
    "ferry_generation_prompt_tokens_cached_total",
    "Prompt tokens a generation worker found in its KV cache (a prefix another prompt "
    "computed) and did not compute.",
    ["model"],
)
GENERATION_STEPS = Counter(
    "ferry_generation_steps_total",
    "Steps a generation worker ran (each a forward pass).",
    ["model"],
)
GENERATION_STEP_SECONDS = Histogram(
    "ferry_generation_step_seconds",
    "Device time of one generation step.",
    ["model"],
    buckets=LATENCY_BUCKETS_S,
)
GENERATION_TTFT = Histogram(
    "ferry_generation_time_to_first_token_seconds",
    "Accepted to a generation job's first token.",
    ["model", "lane"],
    buckets=LATENCY_BUCKETS_S,
)
GENERATION_TPOT = Histogram(
    "ferry_generation_time_per_output_token_seconds",
    "A generation job's mean time per output token after its first.",
    ["model", "lane"],
    buckets=TOKEN_BUCKETS_S,
)
GENERATION_KV_BLOCKS_IN_USE = Gauge(
    "ferry_generation_kv_blocks_in_use", "KV blocks held by running sequences.", ["model"]
)
GENERATION_KV_BLOCKS_BUDGET = Gauge(
    "ferry_generation_kv_blocks_budget", "KV blocks in the worker's pool.", ["model"]
)
GENERATION_SEQUENCES = Gauge(
    "ferry_generation_sequences",
    "Sequences in a generation worker (state=running: in the batch; waiting: read, not "
    "admitted, preempted ones included).",
    ["model", "state"],
)
GENERATION_PREEMPTIONS = Counter(
    "ferry_generation_preemptions_total",
    "Running sequences evicted so that an urgent one fits (they resume later).",
    ["model"],
)
GENERATION_JOBS_ENDED = Counter(
    "ferry_generation_jobs_ended_total",
    "Generation jobs that ended, by finish_reason (stop, length, cancelled, expired).",
    ["model", "finish_reason"],
)

# Webhooks (Celery worker).
WEBHOOK_ATTEMPTS = Counter(
    "ferry_webhook_attempts_total",
    "Webhook delivery attempts, by what the delivery became: delivered, retrying, failed.",
    ["outcome"],
)


@dataclass(frozen=True)
class AutoscaleSettings:
    """How desired workers are reckoned (``Settings.section``: FERRY_AUTOSCALE_...)."""

    SETTINGS_PREFIX: ClassVar[str] = "autoscale_"
    target_utilisation: float
    window_s: float
    cooldown_s: float
    drain_s: float


class Scalers:
    """Each model's desired workers, as this process has seen them at each scrape.

    Every API process reads the same counters from Redis, so each gives about
    the same figure; an autoscaler can take any of them (or their maximum).
    """

    def __init__(self, autoscale: AutoscaleSettings) -> None:
        self.autoscale = autoscale
        self.by_model: dict[str, DesiredWorkers] = {}
        # /metrics is answered on the thread pool: two scrapes at once share this state.
        self.lock = threading.Lock()

    def observe(
        self,
        client: redis.Redis,
        prefix: str,
        model: str,
        backlog: int,
        now: float,
        bulk_backlog: int = 0,
        depths: dict[str, dict[str, int]] | None = None,
    ) -> tuple[int, DesiredWorkers, float | None]:
        """(desired workers, the model's tracker, the learned jobs per second per worker)."""
        scaler = self.by_model.get(model)
        if scaler is None:
            scaler = self.by_model[model] = DesiredWorkers(
                self.autoscale.target_utilisation,
                self.autoscale.window_s,
                self.autoscale.cooldown_s,
            )
        # Capacity, not the batches seen: at light load batches are small, and their
        # rate would understate what a worker can do.
        estimate = ModelEstimate.from_hash(model_stats(client, prefix, model))
        per_worker = None if estimate is None else estimate.jobs_per_second()
        horizon = self.autoscale.drain_s
        nearest = nearest_deadline_ms(client, prefix, model, depths) if backlog else None
        if nearest is not None:
            # A deadline already passed still leaves a second: the backlog cannot go faster.
            horizon = min(horizon, max(nearest / 1000.0 - now, 1.0))
        arrived = arrivals(client, prefix, model)
        with self.lock:
            desired = scaler.observe(now, arrived, backlog, per_worker, horizon, bulk_backlog)
        return desired, scaler, per_worker


def queue_metrics(
    client: redis.Redis, prefix: str, models: Iterable[str], scalers: Scalers | None = None
) -> bytes:
    """Per model and lane, read from Redis now: depth, group lag, pending entries; and with
    ``scalers``, per model: live workers, arrivals, and the workers it wants."""
    registry = CollectorRegistry()
    depth = Gauge(
        "ferry_queue_depth",
        "Entries not yet acknowledged (queued or running).",
        ["model", "lane"],
        registry=registry,
    )
    lag = Gauge(
        "ferry_queue_lag",
        "Entries no worker has read yet (consumer-group lag).",
        ["model", "lane"],
        registry=registry,
    )
    pending = Gauge(
        "ferry_queue_pending_entries",
        "Entries read by a worker and not acknowledged yet.",
        ["model", "lane"],
        registry=registry,
    )
    scaling = None if scalers is None else _scaling_gauges(registry)
    now = time.time()
    for model in models:
        backlog = bulk = 0
        # Read once a scrape: the lanes' states and the nearest deadline both list them.
        depths = tenant_depths(client, prefix, model)
        for lane, state in lane_states(client, prefix, model, depths).items():
            depth.labels(model, lane).set(state.depth)
            pending.labels(model, lane).set(state.pending)
            lag.labels(model, lane).set(state.lag)
            if lane == Lane.BULK:
                bulk = state.depth
            else:
                backlog += state.depth
        if scalers is not None and scaling is not None:
            desired, scaler, per_worker = scalers.observe(
                client, prefix, model, backlog, now, bulk, depths
            )
            scaling["desired"].labels(model).set(desired)
            scaling["workers"].labels(model).set(live_workers(client, prefix, model, now))
            scaling["arrivals"].labels(model).set(scaler.arrival_rate)
            if per_worker is not None:
                scaling["per_worker"].labels(model).set(per_worker)
    return generate_latest(registry)


def _scaling_gauges(registry: CollectorRegistry) -> dict[str, Gauge]:
    return {
        "desired": Gauge(
            "ferry_model_desired_workers",
            "Workers the model wants: its arrivals at the target utilisation, plus its queue "
            "drained before the nearest deadline in it; falls only after the cool-down.",
            ["model"],
            registry=registry,
        ),
        "workers": Gauge(
            "ferry_model_workers",
            "Live workers of the model (heartbeat within 10 s).",
            ["model"],
            registry=registry,
        ),
        "arrivals": Gauge(
            "ferry_model_arrival_rate",
            "Jobs enqueued per second for the model, over the autoscale window.",
            ["model"],
            registry=registry,
        ),
        "per_worker": Gauge(
            "ferry_model_worker_throughput",
            "Jobs per second one worker finishes (learned from its batches).",
            ["model"],
            registry=registry,
        ),
    }


def token_matches(expected: str | None, authorization: str | None) -> bool:
    """Whether an Authorization header carries the metrics token (always, when none is set)."""
    if expected is None:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    # As bytes: compare_digest refuses non-ASCII str, and a header may hold anything.
    return scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), expected.encode()
    )
