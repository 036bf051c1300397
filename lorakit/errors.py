"""Errors lorakit shows to people: one line saying what was wrong, plus a hint.

Exit codes: 2 for bad input (config, paths, datasets, files), 1 for failures while working.
"""

from __future__ import annotations


class LorakitError(Exception):
    """An error with a one-line message and an optional hint for what to do."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"

    def to_dict(self) -> dict:
        return {"error": type(self).__name__, "message": self.message, "hint": self.hint}


class InputError(LorakitError):
    """Something the user gave us is wrong (exit code 2)."""

    exit_code = 2


class ConfigError(InputError):
    """One or more config problems, all reported at once."""

    def __init__(self, problems: list[str], source: str | None = None, hint: str | None = None):
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        if len(self.problems) == 1:
            msg = f"config{where}: {self.problems[0]}"
        else:
            msg = f"config{where}: {len(self.problems)} problems: " + "; ".join(self.problems)
        super().__init__(msg, hint)

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["problems"] = self.problems
        return d


class UnknownNameError(InputError):
    """A name (family, profile, backend) that is not one of the valid ones."""

    def __init__(self, what: str, got: str, valid: list[str]):
        import difflib

        close = difflib.get_close_matches(got, valid, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        hint += "valid: " + ", ".join(valid)
        super().__init__(f"unknown {what} {got!r}", hint)
        self.valid = valid


class FileFormatError(InputError):
    """A file on disk is malformed or not what it claims to be."""


class NotAvailableError(LorakitError):
    """A capability this build or this machine does not have."""
