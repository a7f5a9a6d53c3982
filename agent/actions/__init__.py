"""Action backends turn a verdict into their platform's words; the dispatcher keeps them off the detection path."""

from __future__ import annotations

import abc
import logging
import random
import threading

from nodemedic.model import NodeVerdict

log = logging.getLogger(__name__)


class RetryLater(Exception):
    """Not an error: the backend applied what it could and wants to be called again after `delay_s`."""

    def __init__(self, delay_s: float, why: str):
        super().__init__(why)
        self.delay_s = delay_s


class ActionBackend(abc.ABC):
    name: str = "backend"

    def start(self) -> None:
        """Begin any background work (watches); called once before the first apply."""

    @abc.abstractmethod
    def apply(self, verdict: NodeVerdict) -> None:
        """Make the platform show `verdict`. Idempotent: applying the same verdict twice changes nothing."""

    def close(self) -> None:
        pass


class ActionDispatcher:
    """Applies the latest desired verdict in its own thread, retrying with jittered backoff.

    Only the newest verdict is kept: a slow or unreachable platform never builds a backlog of stale states, and
    detection never waits on it.
    """

    def __init__(self, backends: list[ActionBackend], on_error=None, max_backoff_s: float = 60.0):  # type: ignore[no-untyped-def]
        self.backends = backends
        self._on_error = on_error
        self._max_backoff_s = max_backoff_s
        self._desired: NodeVerdict | None = None
        self._applied: dict[str, int] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="nodemedic-actions", daemon=True)

    def start(self) -> None:
        for b in self.backends:
            b.start()
        self._thread.start()

    def submit(self, verdict: NodeVerdict) -> None:
        with self._cond:
            self._desired = verdict.model_copy(deep=True)
            self._cond.notify()

    def wait_idle(self, timeout: float) -> bool:
        """True once every backend has applied the latest verdict (tests and orderly shutdown)."""
        with self._cond:
            return self._cond.wait_for(self._idle, timeout=timeout)

    def _idle(self) -> bool:
        return self._desired is None or all(
            self._applied.get(b.name) == self._desired.generation for b in self.backends)

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for b in self.backends:
            try:
                b.close()
            except Exception:
                log.exception("closing action backend %s failed", b.name)

    def _run(self) -> None:
        attempt = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or not self._idle())
                if self._stop:
                    return
                verdict = self._desired
            assert verdict is not None
            failed = False
            later: float | None = None
            for backend in self.backends:
                if self._applied.get(backend.name) == verdict.generation:
                    continue
                try:
                    backend.apply(verdict)
                except RetryLater as wait:
                    log.info("action backend %s: %s", backend.name, wait)
                    later = wait.delay_s if later is None else min(later, wait.delay_s)
                    continue
                except Exception as exc:
                    failed = True
                    log.warning("action backend %s could not apply verdict %s: %s", backend.name,
                                verdict.health.value, exc)
                    if self._on_error is not None:
                        self._on_error(backend.name, exc)
                    continue
                with self._cond:
                    self._applied[backend.name] = verdict.generation
                    self._cond.notify_all()
            if failed:
                attempt += 1
                delay = min(self._max_backoff_s, 0.5 * 2 ** min(attempt, 10)) * random.uniform(0.5, 1.0)
            else:
                attempt = 0
                delay = later
            if delay is not None:
                # Wake early for a newer verdict, which supersedes the one being retried.
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or self._desired is not verdict, timeout=delay)
