"""Exceptions raised by dynamix_byteps.

Each one derives from the built-in exception a caller would already catch for the same
problem (``ImportError`` for a missing engine, ``ValueError`` for bad configuration, ...),
so code written against BytePS keeps working, and from :class:`DynamixError`, so code that
wants to catch everything from this package can.
"""

from collections.abc import Callable


class DynamixError(Exception):
    """Base class of every error raised on purpose by dynamix_byteps."""


class NotInitializedError(DynamixError, ValueError):
    """An API that needs a running engine was called before ``init()`` or after ``shutdown()``."""


class ConfigurationError(DynamixError, ValueError):
    """A flag or environment variable is missing or invalid; the message names it and the fix."""


class UsageError(ConfigurationError):
    """Bad command-line flags (or the launcher's environment variables); the command prints it
    argparse-style and exits 2."""


class InvalidAssignmentError(ConfigurationError):
    """A batch-size assignment broke a rule (sizes, bounds, step, version); the message names the
    rule, and the previous assignment stays in force."""


class EngineUnavailableError(DynamixError, ImportError):
    """The selected communication engine cannot be imported or started on this machine."""


class TensorMismatchError(DynamixError, RuntimeError):
    """Workers submitted different names, shapes or dtypes to the same collective round."""


class GradientReductionError(DynamixError, RuntimeError):
    """This worker's reduction of a step's gradients was disturbed: a gradient was changed or
    replaced while in flight, or the backward pass that started the reduction raised before its end."""


_communication_failed = False  # see CommunicationError
_on_communication_failure: Callable[[], None] | None = None


class CommunicationError(DynamixError, RuntimeError):
    """A collective failed: a peer died, the connection broke, or the operation timed out.

    The first one a process raises calls the callback of :func:`on_communication_failure` (a
    worker of bpslaunch tells its launcher at once: if it fails, its failure is not its own, see
    :mod:`dynamix_byteps.engine`).
    """

    def __init__(self, *args):
        global _communication_failed
        super().__init__(*args)
        if not _communication_failed:
            _communication_failed = True
            if _on_communication_failure is not None:
                _on_communication_failure()


def on_communication_failure(callback: Callable[[], None]) -> None:
    """Call ``callback()`` when this process raises its first :class:`CommunicationError` (now, if
    it already has); it replaces the previous callback."""
    global _on_communication_failure
    _on_communication_failure = callback
    if _communication_failed:
        callback()


class DatasetNotFoundError(DynamixError, FileNotFoundError):
    """A dataset's files are not where the loader looked; the message names the install command."""
