"""Progress for people on a terminal (rich), silence for CI and pipes, JSON event lines for machines.

Bars go to stderr only when it is a terminal and CI is not set, so logs stay clean and stdout
keeps only results (the digest, or --json).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from typing import Iterator


class Task:
    def advance(self, amount: float) -> None:
        pass


class Reporter:
    """Quiet: notes go to stderr as single lines, progress and events are dropped."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr

    @contextlib.contextmanager
    def task(self, description: str, total: float) -> Iterator[Task]:
        yield Task()

    def note(self, text: str) -> None:
        print(f"note: {text}", file=self.stream)

    def event(self, data: dict) -> None:
        pass


class NoteReporter(Reporter):
    """Quiet, each note handed to `tell`: a caller that collects notes, or says them its own way."""

    def __init__(self, tell):
        super().__init__()
        self.tell = tell

    def note(self, text: str) -> None:
        self.tell(text)


class JsonReporter(Reporter):
    """One JSON object per line on stderr for each event and note, for CI logs and scripts."""

    def __init__(self, stream=None):
        super().__init__(stream)
        self._lock = threading.Lock()

    def note(self, text: str) -> None:
        self.event({"event": "note", "message": text})

    def event(self, data: dict) -> None:
        with self._lock:
            print(json.dumps(data, sort_keys=True), file=self.stream, flush=True)


class _RichTask(Task):
    def __init__(self, progress, task_id):
        self._progress = progress
        self._id = task_id

    def advance(self, amount: float) -> None:
        self._progress.update(self._id, advance=amount)


class RichReporter(Reporter):
    """One live display shared by all tasks, so concurrent blob transfers each get a bar."""

    def __init__(self, stream=None):
        super().__init__(stream)
        self._lock = threading.Lock()
        self._progress = None
        self._active = 0

    @contextlib.contextmanager
    def task(self, description: str, total: float) -> Iterator[Task]:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        with self._lock:
            if self._progress is None:
                self._progress = Progress(
                    TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                    console=Console(file=self.stream), transient=True,
                )
                self._progress.start()
            self._active += 1
            task_id = self._progress.add_task(description, total=total)
            progress = self._progress
        try:
            yield _RichTask(progress, task_id)
        finally:
            with self._lock:
                progress.remove_task(task_id)
                self._active -= 1
                if self._active == 0:
                    progress.stop()
                    self._progress = None

    def note(self, text: str) -> None:
        with self._lock:
            if self._progress is not None:
                self._progress.console.print(f"note: {text}")
                return
        super().note(text)


def reporter_for(as_json: bool = False) -> Reporter:
    if as_json:
        return JsonReporter()
    interactive = sys.stderr.isatty() and not os.environ.get("CI")
    return RichReporter() if interactive else Reporter()
