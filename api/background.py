"""Stopping an API process's background tasks without ever hanging its shutdown."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def stop_task(task: asyncio.Task[Any] | None, timeout_s: float = 2.0) -> None:
    """Cancel ``task`` and wait for it at most ``timeout_s``.

    Bounded because a task may outlive its cancellation: redis-py can turn a
    cancelled command into a connection error, which a loop that retries on
    Redis errors takes for an outage.
    """
    if task is not None:
        task.cancel()
        await asyncio.wait({task}, timeout=timeout_s)


async def close_client(client: Any, timeout_s: float = 2.0) -> None:
    """Close an asyncio Redis client, giving up after ``timeout_s``."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.aclose(), timeout=timeout_s)
