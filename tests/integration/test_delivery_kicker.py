"""The first attempt of a new webhook delivery, queued at once for Ferry's Celery worker.

The API and the GPU workers queue it (``core.db.webhooks.DeliveryKicker``); Celery's
own machinery is imported only then, not by every process that imports the module.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import redis

from core.db.webhooks import DELIVER_TASK, DeliveryKicker, celery_queue
from core.streams.target import RedisTarget

ROOT = Path(__file__).resolve().parents[2]


def test_a_kick_queues_one_deliver_task_per_delivery_on_the_prefixs_queue(
    redis_url: str, key_prefix: str, redis_client: redis.Redis
) -> None:
    queue = celery_queue(key_prefix)
    kicker = DeliveryKicker(RedisTarget(url=redis_url), key_prefix)
    try:
        kicker(["d-1", "d-2"])
        kicker([])  # nothing to queue: not even a connection
        messages = [json.loads(m) for m in redis_client.lrange(queue, 0, -1)]
    finally:
        kicker.close()
        redis_client.delete(queue)
    assert sorted(m["headers"]["task"] for m in messages) == [DELIVER_TASK] * 2
    assert sorted(m["headers"]["argsrepr"] for m in messages) == ["['d-1']", "['d-2']"]


def test_importing_the_api_leaves_celery_unimported_until_a_delivery_is_queued() -> None:
    probe = "import sys\nimport api.app\nprint('celery.app' in sys.modules)\n"
    run = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["False"]
