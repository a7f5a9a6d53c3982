"""EFA deep checks: fi_info / fi_pingpong parsers on real captures, real tcp loopback runs, and clean failure paths."""

from __future__ import annotations

import shutil
import stat
import sys
import time
from pathlib import Path

import pytest

from nodemedic.checks.active.base import Status
from nodemedic.checks.active.efa import (SLOW, free_port, judge, list_devices, parse_fi_info, parse_pingpong,
                                         parse_size, pingpong_metrics, run_pingpong)

from fakes.processes import existing_children, new_children as children  # noqa: F401 (autouse fixture)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "efa"
HAVE_LIBFABRIC = shutil.which("fi_pingpong") is not None and shutil.which("fi_info") is not None
needs_libfabric = pytest.mark.skipif(not HAVE_LIBFABRIC, reason="libfabric tools not installed")


def sample(name: str) -> str:
    return (FIXTURES / name).read_text()


# -- parsers on real captures -------------------------------------------------------------------------------------

def test_parse_size_suffixes():
    assert [parse_size(s) for s in ("64", "1k", "64k", "1m", "1.2k", "20m")] == [64, 1024, 65536, 1 << 20, 1229,
                                                                               20 << 20]


def test_efa_test_sh_table():
    rows = parse_pingpong(sample("efa_fi_pingpong_01_efa_test_sh_installer154.txt"))
    assert [r.size_bytes for r in rows] == [64, 256, 1024, 4096, 65536, 1 << 20]
    assert (rows[0].sent, rows[0].acked, rows[0].total_bytes, rows[0].time_s) == (10, 10, 1229, 0.02)
    assert (rows[-1].mb_per_s, rows[-1].usec_per_xfer, rows[-1].total_bytes) == (2078.45, 504.50, 20 << 20)
    m = pingpong_metrics(rows)
    assert (m["latency_us"], m["latency_size_bytes"], m["first_row_latency_us"]) == (15.85, 256, 1124.90)
    assert (m["bandwidth_mbps"], m["bandwidth_size_bytes"]) == (2078.45, 1 << 20)
    # Without the warm-up rule the connection setup would be the "latency".
    assert pingpong_metrics(rows, first_row_is_warmup=False)["latency_us"] == 1124.90


def test_server_and_client_logs_pick_the_client_table():
    rows = parse_pingpong(sample("efa_fi_pingpong_02_server_client_logs.txt"))
    assert len(rows) == 6 and rows[0].usec_per_xfer == 803.75 and rows[-1].mb_per_s == 15500.01
    m = pingpong_metrics(rows)
    assert (m["latency_us"], m["bandwidth_mbps"]) == (8.65, 15500.01)


def test_garbage_has_no_rows():
    assert parse_pingpong("") == []
    assert parse_pingpong("[error] util/pingpong.c:568 : ctrl/read: no data or remote connection closed\n") == []
    assert parse_pingpong("64      10      =10      1.2k        0.02s      0.06    1124.90       0.00\n") == []


@pytest.mark.parametrize("name, domains", [
    ("efa_fi_info_01_p4d_legacy_fabric_names.txt",
     ["rdmap16s27-rdm", "rdmap32s27-rdm", "rdmap144s27-rdm", "rdmap160s27-rdm"]),
    ("efa_fi_info_02_efa_direct_v201.txt", ["rdmap47s0-rdm"]),
    ("efa_fi_info_03_rdm_dgrm_v121.txt", ["rdmap0s31-rdm"]),
    ("efa_fi_info_04_mpi_tagged_v116.txt", ["rdmap197s0-rdm"]),
    ("efa_fi_info_05_failure_enodata.txt", []),
])
def test_fi_info_domains(name, domains):
    assert parse_fi_info(sample(name), "efa") == domains


def test_fi_info_all_endpoint_types():
    assert parse_fi_info(sample("efa_fi_info_02_efa_direct_v201.txt"), "efa", None) == ["rdmap47s0-rdm",
                                                                                        "rdmap47s0-dgrm"]
    assert parse_fi_info(sample("efa_fi_info_01_p4d_legacy_fabric_names.txt"), "tcp") == []


def test_judge_thresholds():
    metrics = pingpong_metrics(parse_pingpong(sample("efa_fi_pingpong_01_efa_test_sh_installer154.txt")))
    status, findings, _ = judge(metrics, {"max_latency_us": 20, "min_bandwidth_mbps": 2000}, "efa:rdmap16s27-rdm")
    assert status is Status.PASSED and findings == []
    status, [f], summary = judge(metrics, {"max_latency_us": 10, "min_bandwidth_mbps": 5000}, "efa:rdmap16s27-rdm")
    assert status is Status.FAILED and f.code == SLOW and f.component == "efa:rdmap16s27-rdm"
    assert "latency 15.85 us > 10 us" in summary and "bandwidth 2078.45 MB/s < 5000 MB/s" in summary


# -- real runs over the tcp provider -------------------------------------------------------------------------------

@needs_libfabric
def test_list_devices_tcp_and_absent_efa():
    devices = list_devices("tcp")
    assert "lo" in devices
    if not any(Path("/sys/class/infiniband").glob("*")):
        assert list_devices("efa") == []


@needs_libfabric
def test_real_tcp_loopback():
    result = run_pingpong(provider="tcp", iterations=20, timeout_s=20)
    assert result.status is Status.PASSED, (result.summary, result.evidence)
    m = result.metrics
    assert m["sizes"] == [64, 256, 1024, 4096, 65536, 1 << 20]
    assert m["latency_size_bytes"] == 256 and 0 < m["latency_us"] < 1_000_000
    assert m["bandwidth_size_bytes"] == 1 << 20 and m["bandwidth_mbps"] > 0
    [run] = result.evidence["runs"]
    assert run["server"][1:] == ["-e", "rdm", "-p", "tcp", "-I", "20", "-B", run["server"][-1]]
    assert run["client"][-3:-1] == ["-P", run["server"][-1]] and run["client"][-1] == "localhost"
    assert run["client_rc"] == 0 and run["server_rc"] == 0
    assert children() == []


@needs_libfabric
def test_real_tcp_sizes_port_and_slow_verdict():
    port = free_port()
    result = run_pingpong(provider="tcp", sizes=[4096, 64], iterations=10, port=port, timeout_s=20,
                          thresholds={"max_latency_us": 0.001})
    assert result.status is Status.FAILED
    [f] = result.findings
    assert (f.code, f.component) == (SLOW, "efa:loopback")
    assert result.metrics["sizes"] == [64, 4096] and result.metrics["latency_size_bytes"] == 64
    assert [r["server"][-1] for r in result.evidence["runs"]] == [str(port), str(port)]
    assert children() == []


@needs_libfabric
def test_absent_provider_is_skipped():
    if any(Path("/sys/class/infiniband").glob("*")):
        pytest.skip("an RDMA device is present")
    result = run_pingpong(provider="efa", timeout_s=10)
    assert result.status is Status.SKIPPED and "ENODATA" in result.summary
    assert result.findings == [] and children() == []


@needs_libfabric
def test_client_timeout_reaps_both():
    started = time.monotonic()
    result = run_pingpong(provider="tcp", iterations=10_000_000, timeout_s=1.5)
    assert time.monotonic() - started < 5
    assert result.status is Status.ERROR and "did not finish" in result.summary
    assert result.findings == [] and result.evidence["runs"][0]["outcome"] == "timeout"
    assert children() == []


def test_missing_binary_is_skipped(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    result = run_pingpong(provider="tcp")
    assert result.status is Status.SKIPPED and children() == []


# -- fakes replaying real tables through the whole runner ----------------------------------------------------------

FAKE = """#!{python}
import socket, sys, time
args = sys.argv[1:]
mode = "{mode}"
if "-B" in args:
    if mode == "deaf":
        time.sleep(60)
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(args[args.index("-B") + 1]))); s.listen(1)
    conn, _ = s.accept(); conn.recv(1); sys.exit(0)
c = socket.create_connection(("localhost", int(args[args.index("-P") + 1])))
if mode == "garbage":
    print("Segmentation fault"); sys.exit(0)
if mode == "crash":
    print("[error] util/pingpong.c:1119: cq_readerr: No such file or directory"); sys.exit(1)
sys.stdout.write(open("{table}").read())
"""


def fake_pingpong(tmp_path: Path, monkeypatch, mode: str = "ok",
                  table: str = "efa_fi_pingpong_01_efa_test_sh_installer154.txt") -> None:
    path = tmp_path / "fi_pingpong"
    path.write_text(FAKE.format(python=sys.executable, mode=mode, table=FIXTURES / table))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")


def test_fake_efa_device_replay(tmp_path, monkeypatch):
    fake_pingpong(tmp_path, monkeypatch)
    result = run_pingpong(provider="efa", device="rdmap16s27-rdm", timeout_s=10,
                          thresholds={"max_latency_us": 10, "min_bandwidth_mbps": 1000})
    assert result.status is Status.FAILED
    [f] = result.findings
    assert (f.code, f.component) == (SLOW, "efa:rdmap16s27-rdm")
    assert (result.metrics["latency_us"], result.metrics["bandwidth_mbps"]) == (15.85, 2078.45)
    assert result.evidence["runs"][0]["server"][1:5] == ["-e", "rdm", "-p", "efa"]
    assert "-d" in result.evidence["runs"][0]["client"]
    assert children() == []


@pytest.mark.parametrize("mode, words", [("garbage", "no result table"), ("crash", "client exited 1"),
                                         ("deaf", "not listening")])
def test_fake_failures_are_errors_and_reaped(tmp_path, monkeypatch, mode, words):
    fake_pingpong(tmp_path, monkeypatch, mode)
    result = run_pingpong(provider="tcp", timeout_s=2 if mode == "deaf" else 10)
    assert result.status is Status.ERROR and words in result.summary, result.summary
    assert result.findings == [] and children() == []


@needs_libfabric
def test_cancel_mid_run_reaps_both():
    from nodemedic.checks.tools import Cancelled

    from fakes.processes import cancelled_after

    started = time.monotonic()
    with cancelled_after(0.5), pytest.raises(Cancelled, match="fi_pingpong cancelled"):
        run_pingpong("tcp", iterations=10_000_000, timeout_s=60)
    assert time.monotonic() - started < 10
    assert children() == []
