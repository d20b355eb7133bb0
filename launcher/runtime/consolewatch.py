"""Console patterns for a boot test: lines that must appear (`--expect`) and lines that fail the test
at once (`--fail-on`, e.g. "Kernel panic", "Call Trace"), checked on the serial console as it streams.

`Matcher` is pure (bytes in, matches out); `Watch` is the thread that feeds it from the console log
libvirt writes and stops the VM on the first failing line."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Callable

from diskkit.errors import DiskkitError
from launcher.runtime.console import POLL, ConsoleLog

# A line longer than this is matched on its first LINE_MAX bytes: a guest printing without newlines
# cannot grow our memory.
LINE_MAX = 1 << 16


def compile_patterns(option: str, patterns: tuple[str, ...]) -> list[re.Pattern]:
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as exc:
            raise DiskkitError(f"{option} {pattern}", f"is not a regular expression ({exc})") from None
    return compiled


@dataclass
class Matcher:
    """Each console line against the patterns: the first line each --expect pattern matched, and the
    first line that matched a --fail-on pattern (then nothing more is looked at)."""

    expect: list[re.Pattern]
    fail_on: list[re.Pattern]
    seen: dict[str, str | None] = field(init=False)
    failed: tuple[str, str] | None = field(default=None, init=False)  # (pattern, line)
    _partial: bytes = field(default=b"", init=False)

    def __post_init__(self):
        self.seen = {p.pattern: None for p in self.expect}

    def feed(self, data: bytes) -> None:
        *lines, self._partial = (self._partial + data).split(b"\n")
        self._partial = self._partial[:LINE_MAX]
        for line in lines:
            self._line(line)

    def end(self) -> None:
        """The console is closed: its last line counts even without a newline."""
        if self._partial:
            self._line(self._partial)
            self._partial = b""

    def _line(self, raw: bytes) -> None:
        if self.failed is not None:
            return
        line = raw[:LINE_MAX].decode("utf-8", "replace").rstrip("\r")
        for pattern in self.fail_on:
            if pattern.search(line):
                self.failed = (pattern.pattern, line)
                return
        for pattern in self.expect:
            if self.seen[pattern.pattern] is None and pattern.search(line):
                self.seen[pattern.pattern] = line

    @property
    def missing(self) -> list[str]:
        return [p for p, line in self.seen.items() if line is None]


class Watch(threading.Thread):
    """Feed the console log to `matcher` until `done` is set; on a --fail-on line call `on_fail` once."""

    def __init__(self, log: ConsoleLog, matcher: Matcher, on_fail: Callable[[], None], changed: threading.Event):
        super().__init__(daemon=True)
        self.log, self.matcher, self.on_fail = log, matcher, on_fail
        self.done = threading.Event()
        self.changed = changed  # set after each read that brought new lines
        self.error: DiskkitError | None = None

    def run(self) -> None:
        try:
            while True:
                finishing = self.done.is_set()
                data = self.log.read()
                if data:
                    self.matcher.feed(data)
                    self.changed.set()
                    if self.matcher.failed is not None:
                        self.on_fail()
                        return
                elif finishing:
                    self.matcher.end()
                    if self.matcher.failed is not None:
                        self.on_fail()
                    return
                else:
                    self.done.wait(POLL)
        except DiskkitError as err:
            self.error = err
        finally:
            self.changed.set()
            self.log.close()
