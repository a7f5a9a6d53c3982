"""Where kernel-log lines come from: /dev/kmsg, a log file that is appended, rotated or truncated, or the journal."""

from __future__ import annotations

import abc
import errno
import logging
import os
import select
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

from nodemedic.checks.base import CheckUnavailable
from nodemedic.checks.tools import ToolExited, follow_tool

log = logging.getLogger(__name__)

_READ_SIZE = 1 << 16
_SAFETY_POLL_S = 1.0  # re-stat a followed file this often even without a file event (missed or coalesced events)


class LineSource(abc.ABC):
    name: str = "source"

    def __str__(self) -> str:
        where = getattr(self, "path", None)
        return f"{self.name} {where}" if where else self.name

    @abc.abstractmethod
    def batches(self, stop: threading.Event, ready: threading.Event | None = None) -> Iterator[list[str]]:
        """Yield the lines that arrive, a batch per read, until `stop` is set; set `ready` once positioned."""

    @abc.abstractmethod
    def existing(self) -> Iterator[str]:
        """Yield the lines already there (this boot's kernel log, or the file) and stop at the end."""

    def lines(self, stop: threading.Event, ready: threading.Event | None = None) -> Iterator[str]:
        for batch in self.batches(stop, ready):
            yield from batch


_KMSG_BURST = 1024  # records read before handing a batch on, so a storm cannot starve the consumer


def _kmsg_messages(chunk: bytes, min_usec: int) -> list[str]:
    """Message texts of /dev/kmsg records ("prio,seq,usec,flags;text" plus " KEY=value" continuation lines)."""
    out = []
    for text in chunk.decode("utf-8", "replace").split("\n"):
        if not text or text[0] == " ":
            continue
        header, sep, message = text.partition(";")
        if not sep:
            out.append(text)
            continue
        if min_usec >= 0:
            fields = header.split(",")
            if len(fields) > 2 and fields[2].isdigit() and int(fields[2]) < min_usec:
                continue
        out.append(message)
    return out


class KmsgSource(LineSource):
    """/dev/kmsg: one record per read(2); starts at the end unless told to look back."""

    name = "kmsg"

    def __init__(self, path: str = "/dev/kmsg", lookback_s: float | None = None):
        self.path = path
        self.lookback_s = lookback_s

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise CheckUnavailable(f"cannot open {self.path}: {exc.strerror}") from exc

    @staticmethod
    def _read_available(fd: int, min_usec: int) -> tuple[list[str], bool]:
        """Records readable now (up to a burst) and whether the end of a regular file was reached."""
        out: list[str] = []
        for _ in range(_KMSG_BURST):
            try:
                chunk = os.read(fd, _READ_SIZE)
            except BlockingIOError:
                return out, False
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    # The ring buffer overwrote records before we read them; the next read continues.
                    log.warning("kernel ring buffer overran: some /dev/kmsg records were lost")
                    continue
                raise
            if not chunk:  # only a regular file or a closed pipe standing in for kmsg
                return out, True
            out += _kmsg_messages(chunk, min_usec)
        return out, False

    def existing(self) -> Iterator[str]:
        fd = self._open()
        try:
            while True:
                batch, eof = self._read_available(fd, -1)
                yield from batch
                if eof or not batch:
                    return
        finally:
            os.close(fd)

    def batches(self, stop: threading.Event, ready: threading.Event | None = None) -> Iterator[list[str]]:
        fd = self._open()
        try:
            min_usec = -1
            try:
                if self.lookback_s is None:
                    os.lseek(fd, 0, os.SEEK_END)
                else:
                    os.lseek(fd, 0, os.SEEK_SET)
                    min_usec = int((time.clock_gettime(time.CLOCK_MONOTONIC) - self.lookback_s) * 1e6)
            except OSError as exc:
                if exc.errno != errno.ESPIPE:  # a pipe standing in for kmsg cannot seek: read what comes
                    raise
            if ready is not None:
                ready.set()
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            while not stop.is_set():
                batch, eof = self._read_available(fd, min_usec)
                if batch:
                    yield batch
                elif eof:
                    stop.wait(0.1)
                else:
                    poller.poll(250)
        finally:
            os.close(fd)


class FileSource(LineSource):
    """Follows a log file like `tail -F`: appends, truncation and rotation (rename or delete + create)."""

    name = "file"

    def __init__(self, path: str | os.PathLike[str], from_start: bool = False):
        self.path = Path(path)
        self.from_start = from_start

    def existing(self) -> Iterator[str]:
        try:
            with open(self.path, "rb") as fh:
                for raw in fh:
                    yield raw.rstrip(b"\n").decode("utf-8", "replace")
        except OSError as exc:
            raise CheckUnavailable(f"cannot read {self.path}: {exc.strerror}") from exc

    def batches(self, stop: threading.Event, ready: threading.Event | None = None) -> Iterator[list[str]]:
        wake = threading.Event()
        observer = self._observe(wake)  # watch before opening, so no change between the two is missed
        try:
            yield from self._follow(stop, wake, ready)
        finally:
            if observer is not None:
                observer.stop()
                observer.join(timeout=2)

    def _observe(self, wake: threading.Event):  # type: ignore[no-untyped-def]
        from watchdog.events import FileSystemEventHandler
        from watchdog.observers import Observer

        target = str(self.path.absolute())

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event):  # type: ignore[no-untyped-def]
                if event.src_path == target or getattr(event, "dest_path", None) == target:
                    wake.set()

        observer = Observer()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            observer.schedule(Handler(), str(self.path.parent.absolute()), recursive=False)
            observer.start()
        except Exception as exc:  # inotify limits, odd filesystems: the periodic stat still follows the file
            log.warning("file events unavailable for %s (%s); following it by polling every %.0fs",
                        self.path, exc, _SAFETY_POLL_S)
            return None
        return observer

    def _follow(self, stop: threading.Event, wake: threading.Event,
                ready: threading.Event | None) -> Iterator[list[str]]:
        fh = None
        inode = None
        partial = b""
        first_open = True
        try:
            while not stop.is_set():
                if fh is None:
                    try:
                        fh = open(self.path, "rb")
                    except FileNotFoundError:
                        if ready is not None:
                            ready.set()  # the file is not there yet: whatever is written to it will be read
                        wake.wait(_SAFETY_POLL_S)
                        wake.clear()
                        first_open = False  # a file created later is read from its start
                        continue
                    st = os.fstat(fh.fileno())
                    inode = (st.st_dev, st.st_ino)
                    if first_open and not self.from_start:
                        fh.seek(0, os.SEEK_END)
                    first_open = False
                    partial = b""
                    if ready is not None:
                        ready.set()
                wake.clear()
                data = fh.read(_READ_SIZE)
                if data:
                    raw_lines = (partial + data).split(b"\n")
                    partial = raw_lines.pop()
                    if raw_lines:
                        yield [raw.decode("utf-8", "replace") for raw in raw_lines]
                    continue
                # At the end: rotated away, truncated, or just quiet?
                try:
                    st = os.stat(self.path)
                    current = (st.st_dev, st.st_ino)
                except FileNotFoundError:
                    current = None
                if current != inode:
                    if partial:
                        yield [partial.decode("utf-8", "replace")]
                    fh.close()
                    fh = None
                    if current is not None:
                        first_open = False
                    continue
                if st.st_size < fh.tell():
                    log.info("%s was truncated; reading it from the start", self.path)
                    fh.seek(0)
                    partial = b""
                    continue
                wake.wait(_SAFETY_POLL_S)
        finally:
            if fh is not None:
                fh.close()


class JournalSource(LineSource):
    """The systemd journal's kernel messages through `journalctl -k -f`."""

    name = "journal"

    def __init__(self, lookback_s: float | None = None, journalctl: str = "journalctl"):
        self.lookback_s = lookback_s
        self.journalctl = journalctl

    def existing(self, timeout_s: float = 60.0) -> Iterator[str]:
        exe = shutil.which(self.journalctl)
        if exe is None:
            raise CheckUnavailable(f"{self.journalctl} not found")
        args = [exe, "-k", "-b", "-o", "cat", "--no-pager", "-q"]
        if self.lookback_s:
            args.append(f"--since=-{int(self.lookback_s)}s")
        try:
            out = subprocess.run(args, capture_output=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise CheckUnavailable(f"journalctl timed out after {timeout_s:g}s") from exc
        if out.returncode != 0:
            raise CheckUnavailable(f"journalctl exited {out.returncode}: "
                                   f"{out.stderr.decode(errors='replace').strip()[:200]}")
        yield from out.stdout.decode("utf-8", "replace").splitlines()

    def batches(self, stop: threading.Event, ready: threading.Event | None = None) -> Iterator[list[str]]:
        args = [self.journalctl, "-k", "-f", "-o", "cat", "--no-pager"]
        args += [f"--since=-{int(self.lookback_s)}s"] if self.lookback_s else ["-n", "0"]
        try:
            for batch in follow_tool(args, stop, on_start=lambda _proc: ready.set() if ready else None):
                if batch:
                    yield batch
        except ToolExited as exc:
            raise RuntimeError(str(exc)) from None


def make_source(kind: str = "auto", path: str | None = None, lookback_s: float | None = None) -> LineSource:
    """The source the config names; `auto` takes kmsg when readable, else the journal, else a kernel log file."""
    if kind == "kmsg":
        return KmsgSource(path or "/dev/kmsg", lookback_s)
    if kind == "journal":
        return JournalSource(lookback_s)
    if kind == "file":
        if not path:
            raise CheckUnavailable("kernel log source 'file' needs checks.kernel_log.path")
        return FileSource(path, from_start=bool(lookback_s))
    if path:
        if path.startswith("/dev/kmsg"):
            return KmsgSource(path, lookback_s)
        return FileSource(path, from_start=bool(lookback_s))
    if os.access("/dev/kmsg", os.R_OK):
        try:
            os.close(os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK))
            return KmsgSource("/dev/kmsg", lookback_s)
        except OSError:
            pass
    if shutil.which("journalctl") and Path("/run/systemd/journal").exists():
        return JournalSource(lookback_s)
    for candidate in ("/var/log/kern.log", "/var/log/messages", "/var/log/syslog"):
        if os.access(candidate, os.R_OK):
            return FileSource(candidate, from_start=bool(lookback_s))
    raise CheckUnavailable("no readable kernel log: /dev/kmsg, the journal and /var/log are all unavailable")
