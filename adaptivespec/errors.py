"""Errors that reach users as one line, without a traceback.

Every error names what was wrong (a key path, an argument, a file), the value given and what was
expected. The CLI prints ``str(error)`` and exits with :attr:`AdaptiveSpecError.exit_code`.
"""

from __future__ import annotations


class AdaptiveSpecError(Exception):
    """Base class of every user-facing error; the CLI prints it as one line and exits 2."""

    exit_code = 2


class ConfigError(AdaptiveSpecError, ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range."""

    def __init__(self, where: str, key: str, message: str) -> None:
        self.where, self.key, self.message = where, key, message
        prefix = f"{where}: " if where else ""
        super().__init__(f"{prefix}{key}: {message}" if key else f"{prefix}{message}")


class UnknownStrategyError(AdaptiveSpecError, KeyError):
    """A policy, verifier, drafter or runtime name that no plugin registered."""

    def __init__(self, kind: str, name: object, known: list[str], failed: list = ()) -> None:
        self.kind, self.name, self.known, self.failed = kind, name, known, list(failed)
        plural = {"policy": "policies"}.get(kind, kind + "s")
        message = f"unknown {kind} {name!r}; registered {plural}: {', '.join(known) or '(none)'}"
        if self.failed:  # the name may belong to a plugin that could not load
            message += "; plugins that failed to load: " + "; ".join(
                f"{f.name!r} from distribution {f.distribution!r} ({f.error})" for f in self.failed)
        super().__init__(message)

    def __str__(self) -> str:  # KeyError would add quotes around the message
        return self.args[0]


class ModelLoadError(AdaptiveSpecError):
    """A target or drafter path, id or checkpoint cannot be loaded."""


class ShapeNotInBankError(AdaptiveSpecError):
    """A policy asked for a tree shape that was not prepared before decoding."""
