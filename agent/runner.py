"""Runs checks in isolation: one that raises, hangs or lacks its tool becomes a CHECK_FAILED finding."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from nodemedic.checks.base import Check, CheckUnavailable, Emit, Poller, Watcher
from nodemedic.model import Finding, check_failed, check_recovered

log = logging.getLogger(__name__)

STABLE_AFTER_S = 5.0      # a restarted watcher that has run this long counts as recovered
MAX_BACKOFF_S = 60.0


def _reason(exc: BaseException) -> str:
    if isinstance(exc, CheckUnavailable):
        return str(exc)
    return f"crashed: {type(exc).__name__}: {exc}"


class CheckRunner:
    def __init__(self, emit: Emit, observe_duration: Callable[[str, float], None] | None = None):
        self.emit = emit
        self._observe_duration = observe_duration
        self._busy: dict[str, threading.Thread] = {}

    # -- watchers ------------------------------------------------------------------------------------------------
    def start_watcher(self, watcher: Watcher, stop: threading.Event) -> threading.Thread:
        t = threading.Thread(target=self._supervise, args=(watcher, stop), name=f"watch-{watcher.name}", daemon=True)
        t.start()
        return t

    def _supervise(self, watcher: Watcher, stop: threading.Event) -> None:
        backoff = 1.0
        failing = False
        while not stop.is_set():
            started = time.monotonic()
            timer = None
            if failing:
                timer = threading.Timer(STABLE_AFTER_S, lambda: self.emit(check_recovered(watcher.name)))
                timer.daemon = True
                timer.start()
            try:
                watcher.watch(self.emit, stop)
                if stop.is_set():
                    return
                reason = "watcher stopped unexpectedly"
            except Exception as exc:
                reason = _reason(exc)
                if not isinstance(exc, CheckUnavailable):
                    log.exception("watcher %s crashed", watcher.name)
            finally:
                if timer is not None:
                    timer.cancel()
            if time.monotonic() - started >= STABLE_AFTER_S:
                backoff = 1.0
            log.warning("watcher %s failed (%s); restarting in %.0fs", watcher.name, reason, backoff)
            self.emit(check_failed(watcher.name, reason))
            failing = True
            stop.wait(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    # -- one pass ------------------------------------------------------------------------------------------------
    def run_once(self, check: Check) -> list[Finding]:
        """Run a poller (or a watcher's scan) with its timeout; failures come back as findings, never raise."""
        running = self._busy.get(check.name)
        if running is not None and running.is_alive():
            return [check_failed(check.name, f"previous run still hung past {check.timeout_s:g}s")]
        result: list[Finding] = []
        error: list[BaseException] = []

        def target() -> None:
            try:
                if isinstance(check, Poller):
                    result.extend(check.run())
                elif isinstance(check, Watcher):
                    result.extend(check.scan())
            except BaseException as exc:  # noqa: BLE001 - isolation is the point
                error.append(exc)

        started = time.monotonic()
        t = threading.Thread(target=target, name=f"run-{check.name}", daemon=True)
        t.start()
        t.join(check.timeout_s)
        elapsed = time.monotonic() - started
        if self._observe_duration is not None:
            self._observe_duration(check.name, elapsed)
        if t.is_alive():
            self._busy[check.name] = t  # Python cannot kill the thread; never start a second one beside it
            return [check_failed(check.name, f"timed out after {check.timeout_s:g}s")]
        if error:
            exc = error[0]
            if not isinstance(exc, CheckUnavailable):
                log.error("check %s crashed: %r", check.name, exc)
            return [check_failed(check.name, _reason(exc))]
        return result + [check_recovered(check.name)]
