"""core.ops.collector.refreeze: a dropped version is freed in a process that froze its
start-up (each case in a fresh interpreter: freezing is the process's own)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import gc, weakref
    from core.ops.collector import refreeze

    class Runtime:
        pass

    def load():
        runtime = Runtime()
        runtime.model = {"owner": runtime}  # a reference cycle, as a model's modules make
        return runtime

    runtime = load()
    alive = weakref.ref(runtime)
    if FREEZE:
        gc.collect()
        gc.freeze()
    del runtime
    gc.collect()
    kept = alive() is not None
    refreeze()
    print(kept, alive() is not None, gc.get_freeze_count() > 0)
    """
)


def run(freeze: bool) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", f"FREEZE = {freeze}\n{SCRIPT}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.split()


def test_a_version_frozen_at_start_up_and_dropped_is_freed_by_refreeze() -> None:
    # Frozen, a dropped version's cycles survive a collection; refreeze frees them and
    # freezes what is left again.
    assert run(freeze=True) == ["True", "False", "True"]


def test_refreeze_leaves_a_process_that_froze_nothing_as_it_is() -> None:
    assert run(freeze=False) == ["False", "False", "False"]
