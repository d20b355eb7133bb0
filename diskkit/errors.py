"""The one exception type users see: a single line naming the subject and the rule it broke."""


class DiskkitError(Exception):
    """Printed as `diskkit: <subject>: <rule>`; the process exits with `exit_code`."""

    exit_code = 1

    def __init__(self, subject: object, rule: str | None = None):
        self.subject = str(subject) if rule is not None else None
        self.rule = rule if rule is not None else str(subject)
        super().__init__(self.line())

    def line(self) -> str:
        text = f"{self.subject}: {self.rule}" if self.subject else self.rule
        # One line, always: multi-line tool output would hide the rule.
        return " ".join(text.split())


class RegistryError(DiskkitError):
    """A registry answered or failed in a way the operation cannot get past."""


class AuthError(RegistryError):
    pass


class UploadLost(RegistryError):
    """The upload session cannot be resumed; the blob must be sent again from its first byte."""


class NoSpace(DiskkitError):
    """The filesystem being written to is full (or the user's quota is): nothing of the write is kept."""


class ResumeFailed(DiskkitError):
    """A blob resumed from bytes an earlier download kept failed its checks; those bytes are
    gone, and the blob read again from its first byte may pass."""
