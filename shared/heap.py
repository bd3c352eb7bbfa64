"""The garbage collector's settings of a serving process (the gateway's and the scheduler's).

Their hot loops allocate many short-lived objects per token or step, while what they loaded
at start (modules, the tokenizer, the scheduler's pool) lives as long as the process.
"""
from __future__ import annotations

import gc

GC_THRESHOLD = (20_000, 50, 100)   # young collections every 20k allocations while serving


def settle_heap() -> None:
    """Call once start-up is done, before serving: what was loaded so far is frozen out of
    the collector (the collections that the per-token objects trigger do not rescan it),
    and young collections run every GC_THRESHOLD[0] allocations. Process-wide: for a
    service's own process, not for an app embedded in another one."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)
