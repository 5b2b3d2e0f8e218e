# ruff: noqa: RUF001
"""The inference protocol's cost: ``POST /v2/models/minilm/infer`` against ``POST /v1/jobs?wait=``.

One ``ferry up`` (minilm, SQLite, no Flower, the rate limit and the quota out
of the way: ``bench/clients.py``'s settings) and ``--clients`` closed-loop
client threads (``bench/peers.py``'s loop), each sending one text of the
benchmark corpus a request and waiting for its embedding, two ways on the
same stack:

* **wait**: Ferry's one round trip, ``POST /v1/jobs?wait=30`` with the text in
  JSON, the job resource (and its 384 numbers) back in JSON;
* **infer**: the protocol's, as ``tritonclient`` sends it by default: the text
  as one ``BYTES`` row in the binary tensor data extension, the ``FP32``
  embedding back in binary;
* **grpc**: the protocol's gRPC form (the stack's ``FERRY_GRPC_PORT``), as
  ``tritonclient.grpc`` sends it: the text in ``raw_input_contents``, the
  embedding back in ``raw_output_contents``, one channel a client thread.

``--rounds`` rounds, each running every way (``--warmup`` s, then
``--duration`` s measured), in an order that rotates round by round. Per
round and way: requests/s answered in the measured window, p50 and p99, and
the API processes' CPU per request over the window (from /proc,
``bench/api.py``'s accounting); per round, each protocol way over wait for
both. The figures are the median of the rounds and their range. Target: the
protocol costs no more than 10 % more: a rate of at least 0.9 times and API
CPU of at most 1.1 times the one round trip's, each way. The stack serves
gRPC in every round, so the REST ways are measured with it listening.

    python -m bench.oip [--clients 32] [--warmup 3] [--duration 10] [--rounds 5]
                        [--threads 1] [--out bench/results/oip.json]
"""

from __future__ import annotations

import argparse
import json
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import results
from bench.api import cpu_delta
from bench.clients import MODEL, ferry_settings, started_ferry
from bench.corpus import load_corpus
from bench.peers import (
    DIMENSIONS,
    Call,
    Connect,
    Load,
    Measured,
    closed_loop,
    ferry_call,
    http_connect,
)
from bench.report import (
    Figure,
    Results,
    Spread,
    counted,
    decimal,
    measured_on,
    table,
    times,
    verdict,
)
from harness.ports import free_port

WAYS = ("wait", "infer", "grpc")
PROTOCOL_WAYS = ("infer", "grpc")  # each against wait
HEADER_LENGTH = "Inference-Header-Content-Length"
TARGET_RATE = 0.9  # infer's requests/s over wait's, at least
TARGET_CPU = 1.1  # infer's API CPU per request over wait's, at most


@dataclass
class WayRun(Measured):
    """One way in one round, with the API's CPU a request over its window."""

    api_cpu_ms_per_request: float | None = None


@dataclass
class Round:
    round: int
    order: list[str]  # the ways in the order this round measured them
    wait: WayRun
    infer: WayRun
    grpc: WayRun
    ratios: dict[str, dict[str, float | None]]  # per protocol way, over wait: per_s, api_cpu


@dataclass
class WayTarget:
    per_s_met: bool  # in every round
    api_cpu_met: bool
    met: bool


@dataclass
class Target:
    per_s_at_least: float
    api_cpu_at_most: float
    infer: WayTarget
    grpc: WayTarget


@dataclass
class Report:
    """bench/results/oip.json besides its head (bench.report.typed reads it; summary writes it)."""

    rounds: list[Round]
    ways: dict[str, dict[str, Spread]]  # per way and figure, over the rounds
    ratios: dict[str, dict[str, Spread]]
    target: Target


RESULT = Report


def infer_call(token: str) -> Callable[[Any], Call]:
    """A client's call through the protocol: one BYTES row in, the FP32 embedding out."""
    headers = {"Authorization": f"Bearer {token}"}

    def make(client: Any) -> Call:
        def call(text: str) -> int | None:
            data = text.encode()
            tensor = {
                "name": "text",
                "datatype": "BYTES",
                "shape": [1, 1],
                "parameters": {"binary_data_size": 4 + len(data)},
            }
            header = json.dumps(
                {"inputs": [tensor], "parameters": {"binary_data_output": True}}
            ).encode()
            response = client.post(
                f"/v2/models/{MODEL}/infer",
                content=header + struct.pack("<I", len(data)) + data,
                headers={**headers, HEADER_LENGTH: str(len(header))},
            )
            if response.status_code != 200:
                raise RuntimeError(f"{response.status_code} {response.text[:200]}")
            length = int(response.headers[HEADER_LENGTH])
            if len(response.content) - length != 4 * DIMENSIONS:
                raise ValueError(f"not a {DIMENSIONS}-number embedding")
            return None  # the protocol's answer does not say the batch

        return call

    return make


def grpc_connect(address: str, token: str, timeout_s: float) -> Connect:
    """Each client thread with a gRPC channel of its own, sending as tritonclient.grpc does."""
    import numpy as np
    import tritonclient.grpc as triton

    headers = {"authorization": f"Bearer {token}"}

    def connect() -> tuple[Call, Callable[[], None]]:
        client = triton.InferenceServerClient(address)

        def call(text: str) -> int | None:
            tensor = triton.InferInput("text", [1], "BYTES")
            tensor.set_data_from_numpy(np.array([text.encode()], dtype=object))
            result = client.infer(MODEL, [tensor], headers=headers, client_timeout=timeout_s)
            found = result.as_numpy("embedding")
            if found is None or found.shape != (1, DIMENSIONS):
                raise ValueError(f"not a {DIMENSIONS}-number embedding")
            return None  # the protocol's answer does not say the batch

        return call, client.close

    return connect


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="the worker's torch threads")
    parser.add_argument("--wait", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("bench/results/oip.json"))
    args = parser.parse_args(argv)
    head = results.provenance("oip", argv)
    load = Load(args.clients, args.warmup, args.duration)
    texts = load_corpus().texts[:1000]
    settings = {
        "clients": args.clients,
        "warmup_s": args.warmup,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "threads": args.threads,
        "texts": len(texts),
    }
    rounds: list[dict[str, Any]] = []
    first = {"model": MODEL, "input": texts[0]}
    grpc_port = free_port()
    extra = {"FERRY_GRPC_PORT": str(grpc_port)}
    with started_ferry(ferry_settings(args.threads, extra), first, "ferry-bench-oip-") as up:
        print(f"Ferry up after {up.startup_s:.0f} s, {up.stack.base}", flush=True)
        connects = {
            "wait": http_connect(
                ferry_call(up.stack.token, args.wait, one_trip=True), args.wait + 30, up.stack.base
            ),
            "infer": http_connect(infer_call(up.stack.token), args.wait + 30, up.stack.base),
            "grpc": grpc_connect(f"127.0.0.1:{grpc_port}", up.stack.token, args.wait + 30),
        }
        for number in range(args.rounds):
            turn = number % len(WAYS)
            order = list(WAYS[turn:] + WAYS[:turn])
            found: dict[str, Any] = {"round": number + 1, "order": order}
            for way in order:
                snapshots: dict[str, Any] = {}

                def window(moment: str, into: dict[str, Any] = snapshots) -> None:
                    into[moment] = up.watched.snapshot()

                measured = closed_loop(way, connects[way], texts, load, window)
                spent = cpu_delta(snapshots["begin"], snapshots["end"]).ms
                figures = asdict(measured)
                figures["api_cpu_ms_per_request"] = (
                    round(spent["api"] / measured.requests, 3) if measured.requests else None
                )
                found[way] = figures
                print(
                    f"  round {number + 1}, {way:5}: {measured.per_s:7.1f}/s  p50 "
                    f"{measured.p50_ms} ms  p99 {measured.p99_ms} ms  API CPU "
                    f"{figures['api_cpu_ms_per_request']} ms a request"
                    + (f"  !! {measured.errors} errors" if measured.errors else ""),
                    flush=True,
                )
            found["ratios"] = {way: over_wait(found["wait"], found[way]) for way in PROTOCOL_WAYS}
            rounds.append(found)
            results.write(args.out, summary(rounds), settings=settings, head=head)
    report = summary(rounds)
    for way in PROTOCOL_WAYS:
        print(
            f"{way} over wait: requests/s {report['ratios'][way]['per_s']}, API CPU per "
            f"request {report['ratios'][way]['api_cpu']}; target met: "
            f"{report['target'][way]['met']}"
        )
    print(f"wrote {args.out}")
    return 0


def over_wait(wait: dict[str, Any], way: dict[str, Any]) -> dict[str, float | None]:
    """A round's rate and API CPU a request of ``way`` over the one round trip's."""
    cpu, wait_cpu = way["api_cpu_ms_per_request"], wait["api_cpu_ms_per_request"]
    return {
        "per_s": round(way["per_s"] / wait["per_s"], 3) if wait["per_s"] else None,
        "api_cpu": round(cpu / wait_cpu, 3) if cpu and wait_cpu else None,
    }


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def over(way: str, key: str) -> dict[str, float]:
        values = [r[way][key] for r in rounds if r[way].get(key) is not None]
        return results.spread([float(v) for v in values])

    def ratios(way: str, key: str) -> dict[str, float]:
        found = [r["ratios"][way][key] for r in rounds]
        return results.spread([float(v) for v in found if v])

    def target(way: str) -> dict[str, Any]:
        found = [r["ratios"][way] for r in rounds]
        rate_met = all(f["per_s"] and f["per_s"] >= TARGET_RATE for f in found)
        cpu_met = all(f["api_cpu"] and f["api_cpu"] <= TARGET_CPU for f in found)
        return {"per_s_met": rate_met, "api_cpu_met": cpu_met, "met": rate_met and cpu_met}

    return {
        "rounds": rounds,
        "ways": {
            way: {
                key: over(way, key)
                for key in ("per_s", "p50_ms", "p99_ms", "api_cpu_ms_per_request", "errors")
            }
            for way in WAYS
        },
        "ratios": {
            way: {key: ratios(way, key) for key in ("per_s", "api_cpu")} for way in PROTOCOL_WAYS
        },
        "target": {
            "per_s_at_least": TARGET_RATE,
            "api_cpu_at_most": TARGET_CPU,
            **{way: target(way) for way in PROTOCOL_WAYS},
        },
    }


# --- its tables (python -m bench.render) --------------------------------------------------

OIP_WAYS = {
    "wait": "`POST /v1/jobs?wait=` (JSON)",
    "infer": "`POST /v2/models/minilm/infer` (binary tensors)",
    "grpc": "gRPC `ModelInfer` (raw tensors)",
}


def render_oip(results: Results) -> list[str]:
    doc, report = results["oip"], results.typed("oip", Report)
    s = doc["settings"]
    ms = decimal(1, " ms")
    rows = []
    for way, name in OIP_WAYS.items():
        f = {k: Figure.summary(v) for k, v in report.ways[way].items()}
        rows.append(
            [name, f["per_s"].text(decimal(1), way != "wait")]
            + [f[k].text(decimal(0, " ms")) for k in ("p50_ms", "p99_ms")]
            + [f["api_cpu_ms_per_request"].text(ms)]
        )
    target = report.target
    verdicts = []
    protocols = (("infer", "REST's infer", target.infer), ("grpc", "gRPC's", target.grpc))
    for way, name, met in protocols:
        rate = Figure.summary(report.ratios[way]["per_s"]).text(times(), True)
        cpu = Figure.summary(report.ratios[way]["api_cpu"]).text(times())
        verdicts.append(
            f"{name}: requests/s {rate} (target ≥ {target.per_s_at_least:g}×: "
            f"{verdict(met.per_s_met)}), API CPU a request {cpu} (target ≤ "
            f"{target.api_cpu_at_most:g}×: {verdict(met.api_cpu_met)})"
        )
    return [
        f"{measured_on(doc)}; minilm, "
        f"{s['clients']} closed-loop clients, {s['duration_s']:g} s measured after "
        f"{s['warmup_s']:g} s of warm-up, each way in each of "
        f"{counted(s['rounds'], 'round', 'rounds')} (median, min–max); the stack serves "
        "gRPC throughout:",
        "",
        *table(["way", "requests/s", "p50", "p99", "API CPU a request"], "lrrrr", rows),
        "",
        "The protocol over the one round trip, round by round: " + "; ".join(verdicts) + ".",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
