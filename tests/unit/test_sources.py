"""Kernel-log sources: a followed file (appends, truncation, rotation), /dev/kmsg, the journal."""

from __future__ import annotations

import os
import queue
import threading
import time
import uuid
from pathlib import Path

import pytest

from nodemedic.checks.base import CheckUnavailable
from nodemedic.checks.kernel_log.sources import FileSource, JournalSource, KmsgSource, make_source


class Follower:
    """Runs a source's `lines` in a thread and collects what it yields."""

    def __init__(self, source):
        self.stop = threading.Event()
        self.q: queue.Queue[str] = queue.Queue()
        self.error: list[BaseException] = []
        self.t = threading.Thread(target=self._run, args=(source,), daemon=True)
        self.t.start()

    def _run(self, source):
        try:
            for line in source.lines(self.stop):
                self.q.put(line)
        except BaseException as exc:
            self.error.append(exc)

    def expect(self, *lines: str, timeout: float = 5.0) -> None:
        for want in lines:
            got = self.q.get(timeout=timeout)
            assert got == want

    def nothing(self, wait: float = 0.3) -> None:
        with pytest.raises(queue.Empty):
            self.q.get(timeout=wait)

    def close(self):
        self.stop.set()
        self.t.join(5)
        assert not self.t.is_alive()


def append(path: Path, text: str) -> None:
    with open(path, "a") as fh:
        fh.write(text)


def test_file_starts_at_end_and_follows_appends(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("old line\n")
    f = Follower(FileSource(log))
    time.sleep(0.3)
    append(log, "new one\nnew two\n")
    f.expect("new one", "new two")
    append(log, "half")
    f.nothing()
    append(log, " done\n")
    f.expect("half done")
    f.close()


def test_file_from_start(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("a\nb\n")
    f = Follower(FileSource(log, from_start=True))
    f.expect("a", "b")
    f.close()


def test_file_truncation(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("x" * 1000 + "\n")
    f = Follower(FileSource(log))
    time.sleep(0.3)
    with open(log, "w") as fh:  # copytruncate
        fh.write("")
    time.sleep(0.3)
    append(log, "after truncate\n")
    f.expect("after truncate")
    f.close()


def test_file_rotation_by_rename(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("")
    f = Follower(FileSource(log))
    time.sleep(0.3)
    append(log, "before rotate\n")
    f.expect("before rotate")
    append(log, "last words of old file\n")
    os.rename(log, tmp_path / "kern.log.1")
    log.write_text("first of new file\n")
    f.expect("last words of old file", "first of new file")
    append(log, "more\n")
    f.expect("more")
    f.close()


def test_file_deleted_then_recreated(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("")
    f = Follower(FileSource(log))
    time.sleep(0.3)
    log.unlink()
    time.sleep(0.3)
    log.write_text("reborn\n")
    f.expect("reborn")
    f.close()


def test_file_that_does_not_exist_yet(tmp_path):
    log = tmp_path / "later" / "kern.log"
    f = Follower(FileSource(log))
    time.sleep(0.3)
    log.write_text("hello\n")
    f.expect("hello")
    f.close()


def test_file_existing_reads_whole_file(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("a\nb\n")
    assert list(FileSource(log).existing()) == ["a", "b"]
    with pytest.raises(CheckUnavailable):
        list(FileSource(tmp_path / "missing").existing())


def test_kmsg_record_framing_over_a_pipe(tmp_path):
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    f = Follower(KmsgSource(str(fifo)))
    wfd = os.open(fifo, os.O_WRONLY)
    try:
        os.write(wfd, b"4,100,5000,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n"
                      b" SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n")
        f.expect("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.")
    finally:
        os.close(wfd)
    f.close()


def _kmsg_writable() -> bool:
    return os.access("/dev/kmsg", os.R_OK | os.W_OK) and os.geteuid() == 0


@pytest.mark.skipif(not _kmsg_writable(), reason="needs root and /dev/kmsg")
def test_real_dev_kmsg_follow_and_lookback():
    """The real kernel ring buffer: a harmless marker record written to /dev/kmsg comes back out."""
    marker = f"nodemedic-selftest {uuid.uuid4()}"
    f = Follower(KmsgSource("/dev/kmsg"))
    time.sleep(0.3)
    with open("/dev/kmsg", "w") as k:
        k.write(f"<6>{marker}\n")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if f.q.get(timeout=5).endswith(marker):
            break
    else:
        pytest.fail("marker not seen")
    f.close()
    assert any(line.endswith(marker) for line in KmsgSource("/dev/kmsg").existing())


def test_kmsg_missing_device_is_unavailable(tmp_path):
    with pytest.raises(CheckUnavailable):
        list(KmsgSource(str(tmp_path / "nope")).lines(threading.Event()))


def test_journal_missing_binary_is_unavailable():
    src = JournalSource(journalctl="definitely-not-journalctl")
    with pytest.raises(CheckUnavailable):
        list(src.lines(threading.Event()))
    with pytest.raises(CheckUnavailable):
        list(src.existing())


def test_make_source_choices(tmp_path):
    assert isinstance(make_source("file", str(tmp_path / "x")), FileSource)
    assert isinstance(make_source("kmsg"), KmsgSource)
    assert isinstance(make_source("journal"), JournalSource)
    assert isinstance(make_source("auto", str(tmp_path / "x")), FileSource)
    assert isinstance(make_source("auto", "/dev/kmsg"), KmsgSource)
    with pytest.raises(CheckUnavailable, match="needs checks.kernel_log.path"):
        make_source("file", None)
