"""Progress for people on a terminal (rich), silence for CI and pipes.

Bars go to stderr only when it is a terminal and CI is not set, so logs stay clean and stdout
keeps only results (the digest, or --json).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator


class Task:
    def advance(self, amount: float) -> None:
        pass


class Reporter:
    """Quiet: notes go to stderr as single lines, progress is dropped."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr

    @contextlib.contextmanager
    def task(self, description: str, total: float) -> Iterator[Task]:
        yield Task()

    def note(self, text: str) -> None:
        print(f"note: {text}", file=self.stream)


class _RichTask(Task):
    def __init__(self, progress, task_id):
        self._progress = progress
        self._id = task_id

    def advance(self, amount: float) -> None:
        self._progress.update(self._id, advance=amount)


class RichReporter(Reporter):
    @contextlib.contextmanager
    def task(self, description: str, total: float) -> Iterator[Task]:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

        columns = [TextColumn("{task.description}"), BarColumn()]
        if total > 100:
            columns += [DownloadColumn(), TransferSpeedColumn()]
        else:
            columns += [TextColumn("{task.percentage:>5.1f}%")]
        columns.append(TimeRemainingColumn())
        with Progress(*columns, console=Console(file=self.stream), transient=True) as progress:
            yield _RichTask(progress, progress.add_task(description, total=total))


def reporter_for(quiet: bool = False) -> Reporter:
    interactive = sys.stderr.isatty() and not os.environ.get("CI")
    return RichReporter() if interactive and not quiet else Reporter()
