"""The ``ferry`` command: the composition root that wires every part together.

Typer builds the command line (help, shell completion); each command imports
what it runs only when it runs, so ``ferry api`` never loads torch and
``ferry --help`` or ``ferry jobs`` load no model, database or Celery code.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Annotated, Any, NoReturn

import typer

from ferry import backfill_cli, jobs_cli, keys_cli, models_cli
from ferry.console import choice_argument, on_terminal

app = typer.Typer(
    help="Ferry: queue-driven asynchronous inference jobs.",
    no_args_is_help=True,
    # The servers' tracebacks go to logs: in Python's own form, and never with locals.
    pretty_exceptions_enable=False,
)
app.add_typer(keys_cli.app, name="keys")
app.add_typer(backfill_cli.app, name="backfill")
app.add_typer(models_cli.app, name="models")
app.add_typer(jobs_cli.app, name="jobs")
db_app = typer.Typer(help="database migrations", no_args_is_help=True)
app.add_typer(db_app, name="db")

MetricsPortOption = Annotated[
    int | None,
    typer.Option(
        "--metrics-port",
        help="serve /metrics, /healthz and /readyz on this port",
        show_default=False,
    ),
]


@app.command("up", help="run the whole stack in the foreground")
def _up() -> int:
    from core.config.settings import get_settings
    from ferry.up import up

    return up(get_settings())


@app.command("api", help="run the HTTP API")
def _api(
    host: Annotated[str | None, typer.Option("--host", show_default=False)] = None,
    port: Annotated[int | None, typer.Option("--port", show_default=False)] = None,
    reuse_port: Annotated[
        bool,
        typer.Option(
            "--reuse-port",
            help="share the port with other API processes (SO_REUSEPORT); one process",
        ),
    ] = False,
) -> int:
    from core.config.settings import get_settings
    from core.ops import tracing
    from core.ops.logs import configure_logging

    settings = get_settings()
    configure_logging(settings.log_level, "api")
    tracing.setup("api")
    host = host or settings.api_host
    port = port or settings.api_port
    if settings.api_processes > 1 and not reuse_port:
        from ferry.serve import run_api_processes

        return run_api_processes(settings, host, port)
    from ferry.serve import serve_api

    serve_api(settings, host, port, reuse_port=reuse_port)
    end_process(0)


@app.command("worker", help="run a GPU worker for one model")
def _worker(
    model: Annotated[str, typer.Option("--model", show_default=False)],
    device: Annotated[
        str | None,
        typer.Option("--device", help="cpu, cuda or cuda:N (default: FERRY_DEVICE)"),
    ] = None,
    name: Annotated[
        str | None, typer.Option("--name", help="consumer name (default: host:model:device)")
    ] = None,
    instance: Annotated[
        int | None,
        typer.Option("--instance", help="which of several workers of the model on this device"),
    ] = None,
    metrics_port: MetricsPortOption = None,
) -> NoReturn:
    from core.config.settings import get_settings
    from core.ops import tracing
    from core.ops.logs import configure_logging
    from workers.gpu.main import run_worker

    settings = get_settings()
    configure_logging(settings.log_level, f"worker-{model}")
    tracing.setup(f"worker-{model}")
    end_process(run_worker(settings, model, device, name, metrics_port, instance))


@app.command("celery", help="run the Celery worker or beat")
def _celery(
    role: Annotated[
        str,
        choice_argument("ROLE", ("worker", "beat"), "worker or beat"),
    ],
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            help="worker: serve /metrics, /healthz and /readyz on this port",
            show_default=False,
        ),
    ] = None,
) -> int:
    from core.config.settings import get_settings
    from core.ops import tracing
    from core.ops.logs import configure_logging
    from workers.tasks.app import create_celery

    settings = get_settings()
    configure_logging(settings.log_level, f"celery-{role}")
    tracing.setup(f"celery-{role}")
    celery_app = create_celery(settings)
    if role == "worker":
        if metrics_port:
            _serve_celery_health(settings.metrics_host, metrics_port, settings.metrics_bearer)
        celery_app.worker_main(
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
                # Ferry's Celery workers share nothing with each other at start-up (mingle)
                # or while they run (gossip): Flower sees them by their events. Both are
                # known to leave a worker connected and consuming nothing after its broker
                # connection was lost and restored, and mingle holds every start for 1 s.
                "--without-mingle",
                "--without-gossip",
            ]
        )
    else:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        schedule = settings.data_dir / "celerybeat-schedule"
        from workers.tasks.beat import run_beat

        run_beat(celery_app, settings.log_level, schedule)
    return 0


def _serve_celery_health(host: str, port: int, token: str | None) -> None:
    """/metrics, /healthz and /readyz (ready from Celery's worker_ready to its shutdown)."""
    import threading

    from celery.signals import worker_ready, worker_shutting_down

    from core.ops.health import serve

    ready = threading.Event()

    def _ready(**_: Any) -> None:
        ready.set()

    def _stopping(**_: Any) -> None:
        ready.clear()

    worker_ready.connect(_ready, weak=False)
    worker_shutting_down.connect(_stopping, weak=False)
    serve(host, port, ready.is_set, token)


@app.command("flower", help="run Flower (every worker and batch) with basic auth")
def _flower() -> int:
    from core.config.settings import get_settings
    from core.ops.logs import configure_logging
    from workers.tasks.app import create_celery

    settings = get_settings()
    configure_logging(settings.log_level, "flower")
    if settings.flower_password is None:
        raise SystemExit("FERRY_FLOWER_PASSWORD is not set (`ferry up` makes one)")
    celery_app = create_celery(settings)
    # Through Flower's environment, not its command line (which `ps` shows).
    password = settings.flower_password.get_secret_value()
    os.environ["FLOWER_BASIC_AUTH"] = f"{settings.flower_user}:{password}"
    guard_flower_metrics(settings.metrics_bearer)
    celery_app.start(
        [
            "flower",
            f"--address={settings.flower_host}",
            f"--port={settings.flower_port}",
            # Workers gone for this long leave the Workers page.
            f"--purge_offline_workers={settings.flower_forget_offline_s}",
            # Flower holds every task it has seen up to this many: its memory's bound.
            f"--max_tasks={settings.flower_max_tasks}",
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

    from core.ops.metrics import token_matches

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


@db_app.command("upgrade", help="migrate to the newest revision")
def db_upgrade(revision: Annotated[str, typer.Option("--revision")] = "head") -> int:
    from core.config.settings import get_settings
    from core.db import migrate

    settings = get_settings()
    if settings.database_url is None:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    migrate.upgrade(settings.sqlalchemy_url, revision)
    print(f"database at revision {revision}")
    return 0


def end_process(code: int) -> NoReturn:
    """End a server process whose work is done, without tearing its interpreter down.

    A worker's interpreter takes seconds to finalize the thousands of modules its
    model brought (torch, transformers: about 1.5 CPU seconds for minilm, 0.4 for
    the sim model), all after its loop has stopped, its jobs are settled and its
    threads are joined (an API's, after uvicorn has shut down), and a restart or a
    scale-down waits for it. What an orderly exit would still do is done here:
    traces sent, logs and output flushed.
    """
    from core.ops import tracing
    from core.ops.logs import stop_logging

    tracing.shutdown()
    stop_logging()  # the queued lines written
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """Run one command and return its exit status (2 for a usage error, as Typer's own)."""
    # Typer carries its own Click: this is what its usage errors are.
    from typer._click.exceptions import ClickException

    from core.models.repository import RepositoryError

    # Help and usage errors in plain text off a terminal (scripts, logs), Rich on one.
    app.rich_markup_mode = "rich" if on_terminal() else None
    try:
        return int(app(args=argv, prog_name="ferry", standalone_mode=False) or 0)
    except ClickException as exc:
        if on_terminal(sys.stderr) and app.rich_markup_mode is not None:
            from typer.rich_utils import rich_format_error

            rich_format_error(exc)
        else:
            exc.show()
        return exc.exit_code
    except typer.Abort:
        print("Aborted!", file=sys.stderr)
        return 1
    except RepositoryError as exc:
        # A repository that cannot be served: say every reason, then stop.
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        print("the model repository cannot be served (ferry models check)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
