from __future__ import annotations

import io
import json
import logging

from prometheus_client import generate_latest

from nodemedic.model import check_failed
from nodemedic.telemetry.logs import DETECTION_MARKER, DetectionLog, setup_logging
from nodemedic.telemetry.metrics import Metrics

from conftest import finding


def test_detection_event_is_one_json_line_with_the_marker(policy, state, clock):
    buf = io.StringIO()
    setup_logging("info", buf)
    try:
        d = policy.observe(state, finding("XID_79", "gpu:0000:3b:00.0", evidence={"line": "NVRM: Xid ..."}),
                           clock())
        DetectionLog("node-1", "p5.48xlarge").emit(d)
        logging.getLogger("other").info("plain message")
    finally:
        setup_logging("warning")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2
    event = json.loads(lines[0])
    assert event[DETECTION_MARKER] == "activated"
    assert event["node"] == "node-1" and event["instance_type"] == "p5.48xlarge"
    assert event["component"] == "gpu:0000:3b:00.0" and event["code"] == "XID_79"
    assert event["action"] == "reboot" and event["health"] == "UnschedulablePendingReboot"
    assert event["evidence"]["line"] == "NVRM: Xid ..." and event["level"] == "warning"
    assert DETECTION_MARKER not in json.loads(lines[1])


def test_metrics_exposition(policy, state, clock):
    m = Metrics("node-1", None)
    f = finding("XID_79")
    m.finding(f)
    m.finding(check_failed("dcgm", "missing"))
    d = policy.observe(state, f, clock())
    m.decision(d)
    m.verdict(state.verdict, {"reboot": 1})
    m.check_duration.labels("kernel_log").observe(0.01)
    text = generate_latest(m.registry).decode()
    assert 'nodemedic_findings_total{check="kernel_log",code="XID_79",healthy="false"} 1.0' in text
    assert 'nodemedic_node_health{status="UnschedulablePendingReboot"} 1.0' in text
    assert 'nodemedic_node_health{status="Schedulable"} 0.0' in text
    assert 'nodemedic_check_failures_total{check="dcgm"} 1.0' in text
    assert 'nodemedic_check_up{check="dcgm"} 0.0' in text
    assert 'nodemedic_decisions_total{action="reboot",code="XID_79",outcome="activated"} 1.0' in text
    assert "nodemedic_check_duration_seconds_bucket" in text
    assert 'nodemedic_active_faults{action="reboot"} 1.0' in text
