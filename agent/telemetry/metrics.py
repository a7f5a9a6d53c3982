"""Prometheus metrics: findings, decisions, node health, check durations and failures."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from nodemedic import __version__
from nodemedic.model import CHECK_FAILED, Finding, Health, NodeVerdict
from nodemedic.policy import Decision

_DURATION_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600)


class Metrics:
    def __init__(self, node: str, instance_type: str | None = None, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.findings = Counter("nodemedic_findings", "Findings produced by checks",
                                ["check", "code", "healthy"], registry=r)
        self.decisions = Counter("nodemedic_decisions", "Policy decisions", ["outcome", "code", "action"],
                                 registry=r)
        self.suppressed = Counter("nodemedic_suppressed_findings", "Repeats folded into an active fault", registry=r)
        self.health = Gauge("nodemedic_node_health", "1 for the node's current health status", ["status"],
                            registry=r)
        self.active_faults = Gauge("nodemedic_active_faults", "Active faults by action", ["action"], registry=r)
        self.generation = Gauge("nodemedic_verdict_generation", "Increments whenever the verdict changes",
                                registry=r)
        self.check_duration = Histogram("nodemedic_check_duration_seconds", "Duration of check runs", ["check"],
                                        buckets=_DURATION_BUCKETS, registry=r)
        self.check_failures = Counter("nodemedic_check_failures", "Checks that could not run", ["check"],
                                      registry=r)
        self.check_up = Gauge("nodemedic_check_up", "1 while a check runs normally", ["check"], registry=r)
        self.action_errors = Counter("nodemedic_action_errors", "Failed attempts to apply a verdict",
                                     ["backend"], registry=r)
        self.quarantine_refused = Counter("nodemedic_quarantine_refused", "Quarantines the cluster-wide circuit "
                                          "breaker held back (retried later)", registry=r)
        self.deep_results = Counter("nodemedic_deep_check_results", "Deep-check test outcomes",
                                    ["check", "status"], registry=r)
        self.deep_duration = Gauge("nodemedic_deep_check_duration_seconds", "Duration of the last run of each "
                                   "deep-check test", ["check"], registry=r)
        self.deep_runs = Counter("nodemedic_deep_check_runs", "Deep-check runs by published status", ["status"],
                                 registry=r)
        self.deep_last_run = Gauge("nodemedic_deep_check_last_run_timestamp_seconds", "When the last deep-check "
                                   "run ended", registry=r)
        self.info = Gauge("nodemedic_info", "Agent build and node", ["version", "node", "instance_type"],
                          registry=r)
        self.info.labels(__version__, node, instance_type or "unknown").set(1)
        for status in Health:
            self.health.labels(status.value).set(0)
        self._server = None
        self._finding_children: dict[tuple[str, str, bool], Any] = {}

    def finding(self, f: Finding) -> None:
        key = (f.check, f.code, f.healthy)
        child = self._finding_children.get(key)
        if child is None:  # labels() costs microseconds: keep the children of the counter at hand
            child = self._finding_children[key] = self.findings.labels(f.check, f.code, "true" if f.healthy else "false")
        child.inc(f.repeats)
        if f.code == CHECK_FAILED:
            if f.healthy:
                self.check_up.labels(f.check).set(1)
            else:
                self.check_failures.labels(f.check).inc()
                self.check_up.labels(f.check).set(0)

    def deep_result(self, result: Any) -> None:
        self.deep_results.labels(result.name, str(result.status)).inc()
        self.deep_duration.labels(result.name).set(result.duration_s)

    def deep_run(self, run: Any) -> None:
        self.deep_runs.labels(run.status).inc()
        self.deep_last_run.set(run.finished)

    def decision(self, d: Decision) -> None:
        self.decisions.labels(str(d.outcome), d.code, str(d.action)).inc()

    def verdict(self, v: NodeVerdict, actions: dict[str, int]) -> None:
        for status in Health:
            self.health.labels(status.value).set(1 if v.health is status else 0)
        for action, count in actions.items():
            self.active_faults.labels(action).set(count)
        self.generation.set(v.generation)

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint; returns the port actually bound (port 0 picks a free one)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return int(server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
