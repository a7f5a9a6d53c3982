"""Persisted node state: the policy's memory, written atomically so a restart resumes exactly where it was."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Iterator

from pydantic import ValidationError

from nodemedic.policy import PolicyState

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
LOCK_FILE = "state.lock"
AGENT_LOCK = "agent.lock"


class StateStore:
    """One JSON file under the state dir; readers never see a half-written file."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.dir = Path(directory)
        self.path = self.dir / STATE_FILE

    def ensure_dir(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o750)

    def load(self) -> PolicyState:
        """The saved state, or a clean one when there is none; a corrupt file is moved aside, never fatal."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return PolicyState()
        except OSError as exc:
            self._quarantine(f"cannot read it: {exc}")
            return PolicyState()
        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise ValueError("top level is not an object")
            if int(data.get("version", 1)) > PolicyState().version:
                raise ValueError(f"written by a newer nodemedic (state version {data.get('version')})")
            return PolicyState.model_validate(data)
        except (ValueError, ValidationError, TypeError) as exc:
            self._quarantine(_one_line(exc))
            return PolicyState()

    def save(self, state: PolicyState) -> None:
        """Write temp file, fsync, rename, fsync the directory: a crash leaves the old or the new file whole."""
        self.ensure_dir()
        payload = state.model_dump_json().encode()
        fd, tmp = tempfile.mkstemp(prefix=".state-", suffix=".tmp", dir=self.dir)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(payload)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Serialise read-modify-write cycles across processes (the daemon and the CLI)."""
        self.ensure_dir()
        with open(self.dir / LOCK_FILE, "a+") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[PolicyState]:
        """Load, let the caller change, save — all under the lock."""
        with self.locked():
            state = self.load()
            yield state
            self.save(state)

    def _quarantine(self, why: str) -> None:
        aside = self.path.with_name(f"{STATE_FILE}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
        try:
            os.replace(self.path, aside)
            log.error("state file %s is unusable (%s); moved aside to %s, starting with a clean state",
                      self.path, why, aside)
        except OSError as exc:
            log.error("state file %s is unusable (%s) and could not be moved aside (%s); starting with a clean "
                      "state", self.path, why, exc)


class AgentLock:
    """Held by the running daemon so the CLI knows whether to hand it a command or act on the state itself."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.path = Path(directory) / AGENT_LOCK
        self._fh = None

    def acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "a+")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            return False
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        self._fh = fh
        return True

    def release(self) -> None:
        if self._fh is not None:
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None

    def held_by_other(self) -> bool:
        """True when another process (a running daemon) holds the lock."""
        if not self.path.exists():
            return False
        with open(self.path, "a+") as fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
            return False


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]
