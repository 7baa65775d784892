"""Python run when each outermost compile starts and ends, through Dynamo's ``callback_handler``."""

from __future__ import annotations

from collections.abc import Callable

from torch._dynamo.callback import callback_handler


def call_around_each_compile(start: Callable[[object], None], end: Callable[[object], None]) -> bool:
    """Registers ``start`` and ``end`` unless registered already; True where it did.

    ``torch._dynamo.reset()`` removes the callbacks: a caller registers again in each
    trace, which costs a membership test once they are there.
    """
    if start in callback_handler.start_callbacks:
        return False
    callback_handler.register_start_callback(start)
    callback_handler.register_end_callback(end)
    return True
