"""What the Redis failure scenarios share: the reconciler running as beat runs it, and the
wait until every accepted job has finished, read back from the database."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from core.config.settings import Settings
from core.db.schema import Job
from harness.threads import OnAThread
from workers.tasks.app import reconcile_streams


@contextlib.contextmanager
def reconciling(settings: Settings, every_s: float = 1.0) -> Iterator[list[int]]:
    """The reconciler every ``every_s`` on a thread until the block ends; yields the number
    of jobs each run enqueued again."""
    requeued: list[int] = []

    def run(stop: threading.Event) -> None:
        while not stop.wait(every_s):
            try:
                requeued.append(reconcile_streams(settings))
            except Exception:
                continue  # Redis failing over or a slot moving: the next run does it

    with OnAThread(run):
        yield requeued


def settled(sessions: sessionmaker[Session], ids: list[str], settle_s: float) -> dict[str, Job]:
    """Wait up to ``settle_s`` for every job of ``ids`` to succeed; their rows, detached."""
    until = time.monotonic() + settle_s
    while time.monotonic() < until:
        with sessions() as session:
            done = session.scalar(
                select(func.count())
                .select_from(Job)
                .where(Job.id.in_(ids), Job.status == "succeeded")
            )
        if done == len(ids):
            break
        time.sleep(0.2)
    with sessions() as session:
        jobs = {job.id: job for job in session.scalars(select(Job).where(Job.id.in_(ids)))}
        for job in jobs.values():
            session.expunge(job)
    return jobs
