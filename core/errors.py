"""Errors raised by journeyman.

Every error journeyman raises on purpose derives from one root, so ``except jm.JourneymanError``
catches them all. Messages say what is wrong, why, and what to do about it::

    JourneymanError
    ├── ConfigError                 a setting, argument or config value is not acceptable
    │   └── MissingDependencyError  an optional extra is not installed (names the pip command)
    ├── InvalidDataError            a trajectory, group, message or record does not follow the schema
    ├── StorageError                the project folder cannot be read or written (permissions, disk full)
    ├── ModelPreparationError       a base model cannot be found or converted
    ├── ExportError                 a trained step cannot be written out in the asked format
    ├── BackendError                serving or training infrastructure failed
    │   ├── ServerStartError        a server process did not become healthy (quotes its log)
    │   ├── AdapterError            a LoRA adapter could not be deployed or removed
    │   └── ModelUnavailableError   a model name is known but its weights are not served
    ├── RolloutError                user code (agent, tool, reward function) raised inside a rollout
    └── JudgeError                  an LLM judge could not produce valid scores after its retries
        └── JudgeCallError          one judge call failed in a way a later call may not (retried)

Plain ``ValueError``/``TypeError`` from pydantic are wrapped into :class:`InvalidDataError` at the
public entry points, keeping pydantic's field paths in the message.
"""

from __future__ import annotations

__all__ = [
    "AdapterError",
    "BackendError",
    "ConfigError",
    "ExportError",
    "InvalidDataError",
    "JourneymanError",
    "JudgeCallError",
    "JudgeError",
    "MissingDependencyError",
    "ModelPreparationError",
    "ModelUnavailableError",
    "RolloutError",
    "ServerStartError",
    "StorageError",
]


class JourneymanError(Exception):
    """Root of every error journeyman raises on purpose."""


class ConfigError(JourneymanError):
    """A setting, argument or config value is not acceptable."""


class MissingDependencyError(ConfigError, ImportError):
    """An optional dependency is missing; the message names the extra that provides it."""

    def __init__(self, package: str, extra: str, feature: str | None = None) -> None:
        self.package = package
        self.extra = extra
        what = feature or "this part of journeyman"
        super().__init__(
            f"{what} needs the '{package}' package, which is not installed. "
            f"Install journeyman's '{extra}' extra: pip install \"./journeyman[{extra}]\" beside your clone "
            f'of journeyman, or pip install -e ".[{extra}]" inside it'
        )


class InvalidDataError(JourneymanError, ValueError):
    """A trajectory, group, message or record does not follow the schema."""


class StorageError(JourneymanError, OSError):
    """The project folder cannot be read or written."""


class ModelPreparationError(JourneymanError):
    """A base model cannot be found or converted into a Hugging Face folder."""


class ExportError(JourneymanError):
    """A trained step cannot be exported in the asked format, or its export does not load back."""


class BackendError(JourneymanError):
    """Serving or training infrastructure failed."""


class ServerStartError(BackendError):
    """A server process did not become healthy in time; the message quotes the end of its log."""


class AdapterError(BackendError):
    """A LoRA adapter could not be deployed to, or removed from, the inference server."""


class ModelUnavailableError(BackendError):
    """A model name is known but its weights are not served (a merged server serves one model's
    weights at a time: see ``Router.unavailable``)."""


class RolloutError(JourneymanError):
    """User code (an agent, tool or reward function) raised inside a rollout."""


class JudgeError(JourneymanError):
    """An LLM judge did not produce valid scores after its retries."""


class JudgeCallError(JudgeError):
    """One judge call failed in a way that a later call may not (timeout, 5xx, lost connection)."""
