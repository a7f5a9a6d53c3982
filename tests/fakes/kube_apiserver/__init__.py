"""In-process fake Kubernetes API server for driving the official `kubernetes` client in tests."""

from .errors import ApiError
from .faults import Fault
from .server import FakeKubeApiServer
from .transport import RequestRecord

__all__ = ["ApiError", "Fault", "FakeKubeApiServer", "RequestRecord"]
