"""The commands' log on stderr: progress records (`jaxserve.core.progress`) as a live bar in a terminal, as
plain timestamped lines otherwise (a file, a pipe, a service manager's journal)."""

from __future__ import annotations

import logging
import sys

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from jaxserve.core.progress import progress_of

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class ProgressHandler(RichHandler):
    """Rich log lines, with one live bar for the task that progress records are reporting on."""

    def __init__(self, console: Console) -> None:
        super().__init__(console=console, show_path=False, rich_tracebacks=False)
        self.bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), console=console, transient=True)
        self.task: tuple[str, TaskID] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        step = progress_of(record)
        if step is None:
            self.finish()
            super().emit(record)
            return
        if self.task is None or self.task[0] != step.task:
            self.finish()
            self.bars.start()
            self.task = (step.task, self.bars.add_task(step.task, total=step.total))
        self.bars.update(self.task[1], completed=step.done, total=step.total,
                         description=f"{step.task}: {record.getMessage().rsplit(': ', 1)[-1]}")
        self.bars.refresh()  # each record is a moment worth drawing (the timer may not come before the next)
        if step.done >= step.total:
            self.finish()
            super().emit(record)

    def finish(self) -> None:
        """Take the current bar down (its last line stays in the log as an ordinary record)."""
        if self.task is not None:
            self.bars.remove_task(self.task[1])
            self.bars.stop()
            self.task = None


def setup_logging(level: int = logging.INFO, *, terminal: bool | None = None) -> logging.Handler:
    """Route jaxserve's log (at `level`, others' at WARNING) to stderr; a live bar when stderr is a terminal
    (`terminal` overrides the check). Replaces handlers installed before (e.g. by an imported library)."""
    terminal = sys.stderr.isatty() if terminal is None else terminal
    if terminal:
        handler: logging.Handler = ProgressHandler(Console(stderr=True))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(PLAIN_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("jaxserve").setLevel(level)
    return handler


class JobProgress:
    """n of m parts of a job (requests of a benchmark): a live bar in a terminal, a line at each tenth otherwise.
    Use as a context manager; call `update(done)` from the thread that runs the job."""

    def __init__(self, task: str, total: int, *, terminal: bool | None = None) -> None:
        self.task, self.total = task, total
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=Console(stderr=True), transient=True) if self.terminal else None
        self.shown = 0  # tenths already printed (plain lines)

    def __enter__(self) -> JobProgress:
        if self.bar is not None:
            self.bar.start()
            self.id = self.bar.add_task(self.task, total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(self.id, completed=done)
            return
        tenths = done * 10 // max(self.total, 1)
        if tenths > self.shown:
            self.shown = tenths
            print(f"{self.task}: {done} of {self.total}", file=sys.stderr, flush=True)
