"""Progress of long start-up work (kernel builds, measurements, compiles) as ordinary log records.

Code that works through n of m things logs one INFO record per thing with `extra=step(task, done, total)`, that
is `extra={"progress": (task, done, total)}` (a plain tuple, so a package below this one can write it too); the
command line's handler (`jaxserve.cli.log_setup`) draws those records as a live bar in a terminal and prints
them as plain lines otherwise. Without that handler they are plain log lines.
"""

from __future__ import annotations

import logging
from typing import NamedTuple


class Step(NamedTuple):
    """`done` of `total` parts of `task` (e.g. "compiling the forward", 3, 9) are finished."""

    task: str
    done: int
    total: int


def step(task: str, done: int, total: int) -> dict[str, Step]:
    """The `extra` of a progress record: `logger.info(msg, extra=step("compiling", 3, 9))`."""
    return {"progress": Step(task, done, total)}


def progress_of(record: logging.LogRecord) -> Step | None:
    """The Step a record carries, or None for an ordinary record."""
    value = getattr(record, "progress", None)
    if isinstance(value, tuple) and len(value) == 3:
        return Step(*value)
    return None
