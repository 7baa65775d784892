"""What compile regions learn about sharded blocks while Dynamo traces them, kept from trace to trace.

[Note: a restarted trace learns again]
Dynamo may trace a frame again from its start (torch 2.14 and later do, to make a
float that changed a tensor: ``_tensorify_python_scalars``), replaying the first
attempt's decisions, and it refuses a second attempt that takes another path
(``SpeculationLogDivergence``). What a trace learns about blocks sets the path of the
traces after it, so an attempt must not see what an earlier attempt of the same
compile learned: each fact is kept with the attempt that learned it, reads leave out
those of another attempt of the current compile, and the next write drops them.
Another compile sees what every attempt before it learned: facts about a block's
forward, true whichever attempt found them.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

from . import _dynamo


class RegionRegistry:
    """The learning state of compile regions: the facts per block signature, and per trace the keys it ran.

    Written only at trace time (``_dynamo.at_trace_time``); ``reset()`` forgets it all,
    as ``torch._dynamo.reset()`` forgets the traces that learned it.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        #: Signature -> the attempt that learned that blocks with it run inlined.
        self._inlined: dict[int, tuple | None] = {}
        #: Signature -> per attempt, the plain attribute names the bodies of blocks with it read.
        self._read_names: dict[int, dict[tuple | None, frozenset[str]]] = {}
        #: The trace (not hashable: by weak reference) and the keys whose first block it has run.
        self._claimed: tuple[weakref.ref | None, set[int]] = (None, set())
        #: Per ``start_block``: the graph, its last node then, and every tensor's version.
        self._block_starts: dict[int, tuple[Any, Any, dict]] = {}
        self._start_numbers = itertools.count()
        self._fresh_keys = itertools.count(-1, -1)

    def _visible(self, learned_in: tuple | None) -> bool:
        """Whether a fact learned in ``learned_in`` holds for this trace ([Note: a restarted trace learns again])."""
        now = _dynamo.current_attempt()
        return learned_in is None or now is None or learned_in[0] != now[0] or learned_in == now

    def _forget_failed_attempts(self) -> None:
        for signature in [sig for sig, learned_in in self._inlined.items() if not self._visible(learned_in)]:
            del self._inlined[signature]
        for layers in self._read_names.values():
            for learned_in in [attempt for attempt in layers if not self._visible(attempt)]:
                del layers[learned_in]

    def runs_inlined(self, signature: int) -> bool:
        return signature in self._inlined and self._visible(self._inlined[signature])

    def read_names(self, signature: int) -> frozenset[str]:
        layers = self._read_names.get(signature, {})
        return frozenset().union(*(names for attempt, names in layers.items() if self._visible(attempt)))

    def inline(self, signature: int) -> None:
        self._forget_failed_attempts()
        self._inlined.setdefault(signature, _dynamo.current_attempt())

    def add_read_names(self, signature: int, names: set[str]) -> None:
        self._forget_failed_attempts()
        layers = self._read_names.setdefault(signature, {})
        attempt = _dynamo.current_attempt()
        layers[attempt] = layers.get(attempt, frozenset()) | names

    def claim(self, key: int) -> bool:
        """Whether this trace has not run a block with this key yet; from now on it has."""
        trace = _dynamo.current_trace()
        claimed_in, claimed = self._claimed
        if claimed_in is None or claimed_in() is not trace:
            self._claimed = claimed_in, claimed = weakref.ref(trace), set()
        if key in claimed:
            return False
        claimed.add(key)
        return True

    def start_block(self, graph: Any, last_before: Any, versions: dict) -> int:
        """Notes where a first block's forward starts in ``graph``; ``end_block`` takes it back."""
        # An entry of another graph belongs to a forward that a graph break ended before
        # its end: the trace went on in a new graph.
        for stale in [number for number, (other, _, _) in self._block_starts.items() if other is not graph]:
            del self._block_starts[stale]
        start = next(self._start_numbers)
        self._block_starts[start] = (graph, last_before, versions)
        return start

    def block_start(self, start: int) -> tuple[Any, Any, dict]:
        return self._block_starts[start]

    def end_block(self, start: int) -> tuple[Any, Any, dict]:
        return self._block_starts.pop(start)

    def fresh_key(self) -> int:
        """The key of a region traced for one call, never reused."""
        return next(self._fresh_keys)


registry = RegionRegistry()
