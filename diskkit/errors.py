"""The one exception type users see: a single line naming the subject and the rule it broke, and
the exit statuses of both command lines (diskkit and launcher), in one table scripts can rely on."""

import enum


class Exit(enum.IntEnum):
    """Exit statuses of every diskkit and launcher command. With --json a failure also prints
    {"error": {...}} on stdout, its "kind" the lower-case name below."""

    OK = 0
    FAILED = 1
    USAGE = 2
    GUEST_FAILED = 3
    TIMEOUT = 4
    NOT_FOUND = 5
    AUTH = 6
    UNAVAILABLE = 7
    VERIFY_FAILED = 8
    INTERRUPTED = 130


# What each status means, for scripts and for the generated CLI reference.
EXIT_MEANINGS = {
    Exit.OK: "done (also: `launcher stop` of a VM that is not running, `delete --ignore-missing` of a missing tag, `build --skip-if-label` with nothing to do)",
    Exit.FAILED: "any other failure; `inspect` listed problems; `launcher status`: the VM is not running; `launcher test`: the command failed in the guest",
    Exit.USAGE: "a bad option or argument, or an option that takes one value given twice",
    Exit.GUEST_FAILED: "the VM did not boot, or stopped before what was waited for (`launcher run --wait-for`, `launcher test`); `launcher test`: a console line matched `--fail-on`",
    Exit.TIMEOUT: "`--timeout` passed (`launcher run`; `launcher test`: no ssh login, or an `--expect` line missing, in time)",
    Exit.NOT_FOUND: "no such repository, tag, manifest or blob (HTTP 404; `registryCode` NAME_UNKNOWN or MANIFEST_UNKNOWN), image in a layout, or VM",
    Exit.AUTH: "the registry or its token service refused the credentials (HTTP 401 or 403)",
    Exit.UNAVAILABLE: "the registry could not be reached, or answered 5xx, 429 or 408 after every retry: `retryable`, try again later",
    Exit.VERIFY_FAILED: "`verify` found problems, an image failed the signature policy, or a signature does not verify",
    Exit.INTERRUPTED: "Ctrl-C or SIGTERM; what was begun was undone",
}


class DiskkitError(Exception):
    """Printed as `diskkit: <subject>: <rule>`; the process exits with `exit_code`."""

    exit_code = Exit.FAILED

    def __init__(self, subject: object, rule: str | None = None):
        self.subject = str(subject) if rule is not None else None
        self.rule = rule if rule is not None else str(subject)
        super().__init__(self.line())

    def line(self) -> str:
        text = f"{self.subject}: {self.rule}" if self.subject else self.rule
        # One line, always: multi-line tool output would hide the rule.
        return " ".join(text.split())

    def to_json(self) -> dict:
        """What a --json failure prints: the message, its kind and status, and whether trying the same
        command again later may succeed."""
        return {"message": self.line(), "kind": Exit(self.exit_code).name.lower(), "exitCode": int(self.exit_code),
                "retryable": self.exit_code in (Exit.UNAVAILABLE, Exit.TIMEOUT)}


class NotFound(DiskkitError):
    exit_code = Exit.NOT_FOUND


class TimedOut(DiskkitError):
    exit_code = Exit.TIMEOUT


class GuestFailed(DiskkitError):
    exit_code = Exit.GUEST_FAILED


class VerifyFailed(DiskkitError):
    exit_code = Exit.VERIFY_FAILED


class RegistryError(DiskkitError):
    """A registry answered or failed in a way the operation cannot get past: `status` is the HTTP
    status it answered (None: it could not be reached), `code` the distribution API's error code
    (NAME_UNKNOWN, MANIFEST_UNKNOWN...) when its answer named one."""

    def __init__(self, subject: object, rule: str | None = None, *, status: int | None = None, code: str | None = None, unreachable: bool = False):
        super().__init__(subject, rule)
        self.status, self.code, self.unreachable = status, code, unreachable

    @property
    def exit_code(self) -> Exit:
        if self.unreachable or (self.status is not None and (self.status >= 500 or self.status in (408, 429))):
            return Exit.UNAVAILABLE
        if self.status in (401, 403):
            return Exit.AUTH
        if self.status == 404:
            return Exit.NOT_FOUND
        return Exit.FAILED

    def to_json(self) -> dict:
        return {**super().to_json(), "httpStatus": self.status, "registryCode": self.code}


class AuthError(RegistryError):
    @property
    def exit_code(self) -> Exit:
        return Exit.UNAVAILABLE if self.unreachable else Exit.AUTH


class RangesRefused(RegistryError):
    """The registry answered a range request with the whole blob (it ignores Range)."""


class UploadLost(RegistryError):
    """The upload session cannot be resumed; the blob must be sent again from its first byte."""


class NoSpace(DiskkitError):
    """The filesystem being written to is full (or the user's quota is): nothing of the write is kept."""


class ResumeFailed(DiskkitError):
    """A blob resumed from bytes an earlier download kept failed its checks; those bytes are
    gone, and the blob read again from its first byte may pass."""
