"""What a command says when its capability has not landed in this build yet."""

from __future__ import annotations

from lorakit.errors import NotAvailableError


def not_in_this_build(what: str, issue: int, instead: str) -> NotAvailableError:
    """An honest refusal: names the tracking issue and what works today."""
    return NotAvailableError(f"{what} is not in lorakit {_version()} yet (tracked as issue #{issue})",
                             hint=instead)


def _version() -> str:
    from lorakit import __version__

    return __version__
