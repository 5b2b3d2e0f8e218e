"""What an API process does with what its start-up built, run in a process of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

# The server's start-up (the app's lifespan included) in a fresh interpreter, then the
# collector's counts: what start-up built is frozen, and a full collection walks only
# what was made since (a handful of objects, not the app's 150,000).
SCRIPT = textwrap.dedent(
    """
    import asyncio, gc, sys, time
    import uvicorn
    from api.app import create_app
    from core.config.settings import Settings
    from ferry.serve import DrainingServer

    settings = Settings(
        database_url=f"sqlite:///{sys.argv[1]}/ferry.db", data_dir=sys.argv[1],
        redis_url=sys.argv[2], models="sim",
    )
    app = create_app(settings)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None)
    server = DrainingServer(config, app, 0.0)

    async def main():
        serving = asyncio.create_task(server.serve())
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        print(gc.get_freeze_count(), len(gc.get_objects()))
        server.should_exit = True
        await serving

    asyncio.run(main())
    """
)


def test_an_api_process_freezes_what_its_start_up_built(tmp_path: Path, redis_url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), redis_url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    frozen, tracked = map(int, done.stdout.split()[-2:])
    assert frozen > 50_000, done.stdout
    assert tracked < frozen // 10, done.stdout
