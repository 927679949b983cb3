"""A recording stand-in of a BytePS frontend module (``byteps.torch``, ``byteps.tensorflow``) for the
byteps engine tests: real BytePS needs CUDA and NCCL, which cannot exist on this machine."""

import sys
import types


class RecordingBytePSFrontend(types.ModuleType):
    """``byteps.<frontend>`` for one worker of a 1-worker job, recording each call in ``calls``; a
    subclass adds the frontend's collectives."""

    def __init__(self, frontend: str):
        super().__init__(f"byteps.{frontend}")
        self.frontend = frontend
        self.calls = []

    def init(self):
        self.calls.append(("init",))

    def shutdown(self):
        self.calls.append(("shutdown",))

    def rank(self):
        return 0

    local_rank = rank

    def size(self):
        return 1

    local_size = size

    def install(self, monkeypatch) -> None:
        """Make ``import byteps.<frontend>`` give this module until the test ends."""
        package = types.ModuleType("byteps")
        setattr(package, self.frontend, self)
        monkeypatch.setitem(sys.modules, "byteps", package)
        monkeypatch.setitem(sys.modules, self.__name__, self)
