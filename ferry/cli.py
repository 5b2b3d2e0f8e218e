"""The ``ferry`` command: the composition root that wires every part together."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from core.logs import configure_logging
from core.settings import get_settings
from ferry import backfill_cli, keys_cli, models_cli


def _cmd_up(_args: argparse.Namespace) -> int:
    from ferry.up import up

    return up(get_settings())


def _cmd_api(args: argparse.Namespace) -> int:
    settings = get_settings()
    configure_logging(settings.log_level, "api")
    host = args.host or settings.api_host
    port = args.port or settings.api_port
    if settings.api_processes > 1 and not args.reuse_port:
        from ferry.serve import run_api_processes

        return run_api_processes(settings, host, port)
    from ferry.serve import serve_api

    serve_api(settings, host, port, reuse_port=args.reuse_port)
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    from workers.gpu.main import run_worker

    settings = get_settings()
    configure_logging(settings.log_level, f"worker-{args.model}")
    return run_worker(
        settings, args.model, args.device, args.name, args.metrics_port, args.instance
    )


def _cmd_celery(args: argparse.Namespace) -> int:
    from workers.tasks.app import create_celery

    settings = get_settings()
    configure_logging(settings.log_level, f"celery-{args.role}")
    app = create_celery(settings)
    if args.role == "worker":
        if args.metrics_port:
            _serve_celery_health(settings.metrics_host, args.metrics_port, settings.metrics_bearer)
        app.worker_main(
            [
                "worker",
                "--loglevel",
                settings.log_level,
                "--pool",
                "threads",
                "--concurrency",
                str(settings.celery_concurrency),
                "--hostname",
                "ferry-celery@%h",
                "--task-events",
            ]
        )
    else:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        schedule = settings.data_dir / "celerybeat-schedule"
        app.start(["beat", "--loglevel", settings.log_level, "--schedule", str(schedule)])
    return 0


def _serve_celery_health(host: str, port: int, token: str | None) -> None:
    """/metrics, /healthz and /readyz (ready from Celery's worker_ready to its shutdown)."""
    import threading

    from celery.signals import worker_ready, worker_shutting_down

    from core.health import serve

    ready = threading.Event()

    def _ready(**_: Any) -> None:
        ready.set()

    def _stopping(**_: Any) -> None:
        ready.clear()

    worker_ready.connect(_ready, weak=False)
    worker_shutting_down.connect(_stopping, weak=False)
    serve(host, port, ready.is_set, token)


def _cmd_flower(_args: argparse.Namespace) -> int:
    from workers.tasks.app import create_celery

    settings = get_settings()
    configure_logging(settings.log_level, "flower")
    if settings.flower_password is None:
        raise SystemExit("FERRY_FLOWER_PASSWORD is not set (`ferry up` makes one)")
    app = create_celery(settings)
    # Through Flower's environment, not its command line (which `ps` shows).
    password = settings.flower_password.get_secret_value()
    os.environ["FLOWER_BASIC_AUTH"] = f"{settings.flower_user}:{password}"
    guard_flower_metrics(settings.metrics_bearer)
    app.start(
        [
            "flower",
            f"--address={settings.flower_host}",
            f"--port={settings.flower_port}",
            # Workers gone for this long leave the Workers page.
            f"--purge_offline_workers={settings.flower_forget_offline_s}",
        ]
    )
    return 0


def guard_flower_metrics(token: str | None) -> None:
    """Flower serves /metrics without its login: ask for credentials there too.

    With FERRY_METRICS_TOKEN, the bearer token every Ferry /metrics asks for
    (what Prometheus scrapes with); without it, Flower's own basic auth.
    """
    import tornado.web
    from flower.views.monitor import Metrics

    from core.metrics import token_matches

    unguarded = getattr(Metrics, "_ferry_unguarded", Metrics.get)

    async def get(self: Metrics) -> None:
        if token is None:
            if not self.get_current_user():  # Flower's login (basic auth raises 401 itself)
                raise tornado.web.HTTPError(401)
        elif not token_matches(token, self.request.headers.get("Authorization")):
            self.set_header("WWW-Authenticate", 'Bearer realm="metrics"')
            raise tornado.web.HTTPError(401)
        await unguarded(self)

    Metrics._ferry_unguarded = unguarded
    Metrics.get = get


def _cmd_db(args: argparse.Namespace) -> int:
    from core import migrate

    settings = get_settings()
    if settings.database_url is None:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    migrate.upgrade(settings.sqlalchemy_url, args.revision)
    print(f"database at revision {args.revision}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferry", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("up", help="run the whole stack in the foreground").set_defaults(fn=_cmd_up)

    api = sub.add_parser("api", help="run the HTTP API")
    api.add_argument("--host")
    api.add_argument("--port", type=int)
    api.add_argument(
        "--reuse-port",
        action="store_true",
        help="share the port with other API processes (SO_REUSEPORT); one process",
    )
    api.set_defaults(fn=_cmd_api)

    worker = sub.add_parser("worker", help="run a GPU worker for one model")
    worker.add_argument("--model", required=True)
    worker.add_argument("--device", help="cpu, cuda or cuda:N (default: FERRY_DEVICE)")
    worker.add_argument("--name", help="consumer name (default: host:model:device)")
    worker.add_argument(
        "--instance", type=int, help="which of several workers of the model on this device"
    )
    worker.add_argument(
        "--metrics-port", type=int, help="serve /metrics, /healthz and /readyz on this port"
    )
    worker.set_defaults(fn=_cmd_worker)

    celery = sub.add_parser("celery", help="run the Celery worker or beat")
    celery.add_argument("role", choices=["worker", "beat"])
    celery.add_argument(
        "--metrics-port", type=int, help="worker: serve /metrics, /healthz and /readyz on this port"
    )
    celery.set_defaults(fn=_cmd_celery)

    flower = sub.add_parser("flower", help="run Flower (every worker and batch) with basic auth")
    flower.set_defaults(fn=_cmd_flower)

    db = sub.add_parser("db", help="database migrations")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    upgrade = db_sub.add_parser("upgrade", help="migrate to the newest revision")
    upgrade.add_argument("--revision", default="head")
    upgrade.set_defaults(fn=_cmd_db)

    keys_cli.add_parser(sub)
    backfill_cli.add_parser(sub)
    models_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from core.repository import RepositoryError

    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except RepositoryError as exc:
        # A repository that cannot be served: say every reason, then stop.
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        print("the model repository cannot be served (ferry models check)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
