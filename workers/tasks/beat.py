"""``ferry celery beat``: Celery's beat, stopped by SIGTERM or SIGINT without a closed schedule.

Celery's own handler saves and closes the schedule (a shelve file) inside the signal
handler, then raises SystemExit. A signal handler runs wherever the main thread happens
to be, a finalizer among those places, and an exception raised in a finalizer is printed
and dropped: beat's loop then goes on, reads the closed shelve on its next tick
("invalid operation on closed shelf") and exits 1 instead of 0. Here the handler asks the
service to stop and raises SystemExit; the service's own ``finally`` saves and closes the
schedule, once, in the loop, and a dropped SystemExit only delays the stop to the loop's
next pass.
"""

from __future__ import annotations

from pathlib import Path
from types import FrameType

from celery import Celery, beat
from celery.apps.beat import Beat
from celery.platforms import signals


class StoppingBeat(Beat):
    def install_sync_handler(self, service: beat.Service) -> None:
        def _stop(signum: int, frame: FrameType | None) -> None:
            service.stop()
            raise SystemExit()

        signals.update(SIGTERM=_stop, SIGINT=_stop)


def run_beat(app: Celery, loglevel: str, schedule: Path) -> None:
    """What ``celery beat --loglevel LEVEL --schedule FILE`` runs, with the handler above."""
    StoppingBeat(app=app, loglevel=loglevel, schedule=str(schedule)).run()
