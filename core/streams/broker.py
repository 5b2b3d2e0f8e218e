"""Celery apps on Ferry's broker (its Redis): the Celery worker's, Flower's and the GPU workers'.

The GPU worker is not a Celery worker but speaks Celery's event protocol (for
Flower); it builds its app here rather than importing the Celery side's tasks.
"""

from __future__ import annotations

from celery import Celery

from core.streams.target import RedisTarget


def celery_on_broker(target: RedisTarget) -> Celery:
    """A Celery app on Ferry's broker: what the Celery worker, Flower and GPU workers share."""
    try:
        url, transport = target.broker()
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    app = Celery("ferry", broker=url, set_as_current=False)
    app.conf.update(task_serializer="json", accept_content=["json"], event_serializer="json")
    if transport:
        app.conf.broker_transport_options = transport
    return app


def celery_for_events(target: RedisTarget) -> Celery:
    """An app for a GPU worker's events and remote-control answers (Flower).

    Short timeouts and no connection retries: a broker that is down or hung
    costs the sender thread two seconds, never an unbounded wait.
    """
    app = celery_on_broker(target)
    app.conf.update(
        broker_connection_timeout=2.0,
        broker_connection_retry=False,
        broker_transport_options={
            **app.conf.broker_transport_options,
            "max_retries": 0,
            "socket_timeout": 2.0,
            "socket_connect_timeout": 2.0,
        },
    )
    return app
