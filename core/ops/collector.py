"""The garbage collector in Ferry's long-lived processes (an API process, a GPU worker).

What a process builds to start (its libraries, the app or the model and its
warm-up) lives as long as it does. Frozen out of the collector's sight once
started, a full collection walks only what was made since: unfrozen, it walked
150,000 (API) to 200,000 (worker) objects, pauses of 80-260 ms during which
every request in flight or batch waited. Only the process entries freeze: the
tests build many apps and loops in one process, and freezing there would keep
their garbage.
"""

from __future__ import annotations

import gc


def freeze_start_up() -> None:
    """Once started: collect what start-up left behind, and freeze what remains."""
    gc.collect()
    gc.freeze()


def refreeze() -> None:
    """In a process that froze its start-up, unfreeze, collect and freeze again: a model
    version loaded at start-up and dropped since (hot reload) is among the frozen objects,
    which the collector never frees, so whatever of it sits in reference cycles (a model's
    modules, its tensors) would stay. A full collection, once a switch. A process that
    froze nothing is left as it is."""
    if gc.get_freeze_count():
        gc.unfreeze()
        freeze_start_up()
