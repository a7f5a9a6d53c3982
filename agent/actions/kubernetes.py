"""The Kubernetes backend: the verdict as labels, a taint, an annotation, a node condition and Events on its own Node.

Writes are read-modify-write with the Node's resourceVersion as a precondition (a conflict re-reads and re-applies),
one patch per transition and none while nothing changes. The agent records what it placed in an ownership
annotation and only ever removes that. Before a reboot or replacement is handed on (the health label that recovery
tooling keys on), accelerator pods are allowed to finish; before a node is quarantined, a cluster-wide circuit
breaker counts the nodes this agent already holds out.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from nodemedic.actions import ActionBackend, RetryLater
from nodemedic.model import DEEP_IN_PROGRESS, Health, NodeVerdict

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
CONFLICT_RETRIES = 5
PREFIXES = {"default": "nodemedic.io/", "hyperpod": "sagemaker.amazonaws.com/"}
ACCELERATOR_RESOURCES = ("nvidia.com/gpu", "aws.amazon.com/neuron", "aws.amazon.com/neuroncore",
                         "aws.amazon.com/neurondevice", "vpc.amazonaws.com/efa")
_LABEL_OK = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_BAD_CHARS = re.compile(r"[^-A-Za-z0-9_.]")
UNHEALTHY = (Health.UNSCHEDULABLE, Health.PENDING_REBOOT, Health.PENDING_REPLACEMENT)
HANDED_ON = (Health.PENDING_REBOOT, Health.PENDING_REPLACEMENT)


class DrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["wait", "evict", "immediate"] = Field(
        default="wait", description="before handing on a reboot/replace: wait for accelerator pods, evict them "
                                    "after timeout_s, or hand on at once")
    timeout_s: float = Field(default=3600, ge=0, description="evict mode: how long running jobs get to finish")
    poll_s: float = Field(default=15, gt=0)
    resources: list[str] = Field(default_factory=lambda: list(ACCELERATOR_RESOURCES))


class BreakerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_fraction: float = Field(default=0.10, ge=0, le=1, description="of all nodes held out by this agent")
    max_nodes: int | None = Field(default=None, ge=0, description="absolute cap; the stricter of the two wins")
    retry_s: float = Field(default=60, gt=0)


class KubernetesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefix: str | None = Field(default=None, description="label prefix; default from the profile")
    kubeconfig: str | None = Field(default=None, description="default: in-cluster service account")
    api_url: str | None = Field(default=None, description="talk to this API server without credentials (tests)")
    request_timeout_s: float = Field(default=10, gt=0)
    taint: bool = True
    cordon: bool = False
    condition_type: str = "AcceleratedHardwareReady"
    events: bool = True
    events_namespace: str = "default"
    watch_intent: bool = True
    drain: DrainConfig = DrainConfig()
    circuit_breaker: BreakerConfig = BreakerConfig()


def label_value(items: list[str], limit: int = 63) -> str:
    """Items as one valid label value: sorted, '.'-joined, cut deterministically with a count of what was left out."""
    clean = sorted({v for v in (_LABEL_BAD_CHARS.sub("-", i).strip("-_.") for i in items) if v})
    joined = ".".join(clean)
    if len(joined) <= limit:
        return joined
    for keep in range(len(clean) - 1, 0, -1):
        value = ".".join([*clean[:keep], f"{len(clean) - keep}more"])
        if len(value) <= limit:
            return value
    return f"{len(clean)}more"


def _now_iso(ts: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if ts is None else ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Owned:
    """What this agent placed on the node, kept in an annotation so a restarted agent knows what it may remove."""

    labels: list[str] = field(default_factory=list)
    annotations: list[str] = field(default_factory=list)
    taints: list[str] = field(default_factory=list)
    cordon: bool = False
    health: str | None = None  # the health label value this agent wrote: anything else there is a person's

    @classmethod
    def parse(cls, text: str | None) -> Owned:
        if not text:
            return cls()
        try:
            data = json.loads(text)
            return cls(labels=list(data.get("labels", [])), annotations=list(data.get("annotations", [])),
                       taints=list(data.get("taints", [])), cordon=bool(data.get("cordon", False)),
                       health=data.get("health"))
        except (ValueError, AttributeError, TypeError):
            log.warning("ignoring unreadable ownership annotation %r", text[:200])
            return cls()

    def dump(self) -> str:
        return json.dumps({"labels": sorted(self.labels), "annotations": sorted(self.annotations),
                           "taints": sorted(self.taints), "cordon": self.cordon, "health": self.health},
                          separators=(",", ":"))


@dataclass
class Desired:
    health: Health
    labels: dict[str, str]
    annotations: dict[str, str]
    taint: bool
    cordon: bool


def _why(verdict: NodeVerdict) -> str:
    """The node's fault codes, or what holds it when no fault does."""
    if verdict.fault_reasons:
        return ", ".join(verdict.fault_reasons)
    return f"deep health check {DEEP_IN_PROGRESS}" if held_for_deep_checks(verdict) else ""


def held_for_deep_checks(verdict: NodeVerdict) -> bool:
    """Out of scheduling only while deep checks run: a bounded, requested hold, not a quarantine decision, so the
    circuit breaker (there to stop a false alarm taking out the fleet) does not count it."""
    return verdict.deep_check == DEEP_IN_PROGRESS and not verdict.fault_reasons and \
        verdict.health is Health.UNSCHEDULABLE


class KubernetesBackend(ActionBackend):
    name = "kubernetes"

    def __init__(self, node_name: str, config: KubernetesConfig, profile: str = "default", api: Any = None,
                 dry_run: bool = False, on_intent: Callable[[Health], None] | None = None,
                 on_refused: Callable[[str], None] | None = None, clock: Callable[[], float] = time.time):
        self.node_name = node_name
        self.config = config
        self.prefix = config.prefix or PREFIXES.get(profile, PREFIXES["default"])
        self._api = api  # built on first use: a missing kubeconfig is a retried action error, not a crash
        self.dry_run = dry_run
        self.on_intent = on_intent
        self.on_refused = on_refused
        self.clock = clock
        self.health_key = f"{self.prefix}node-health-status"
        self.owned_key = f"{self.prefix}owned"
        self._drain_started: dict[int, float] = {}
        self._requested: str | None = None  # the last operator request passed on, so one edit is one request
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._watch: Any = None

    @property
    def api(self) -> Any:
        if self._api is None:
            self._api = make_api(self.config)
        return self._api

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.config.watch_intent and self.on_intent is not None:
            self._watcher = threading.Thread(target=self._watch_intent, name="kube-intent", daemon=True)
            self._watcher.start()

    def close(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()  # closes the streaming response, so the watch thread ends now
        if self._watcher is not None:
            self._watcher.join(timeout=5)

    # -- applying a verdict ----------------------------------------------------------------------------------------
    def apply(self, verdict: NodeVerdict) -> None:
        for attempt in range(CONFLICT_RETRIES):
            node = self._read_node()
            current = node.get("metadata", {}).get("labels", {}).get(self.health_key)
            health = self._gate(verdict, node, current)
            desired = self._desired(verdict, health)
            patch, owned = self._diff(node, desired)
            try:
                if patch is not None:
                    self._patch_node(patch, node)
                break
            except _Conflict:
                log.info("node %s changed under us (attempt %d); re-reading", self.node_name, attempt + 1)
        else:
            raise RuntimeError(f"node {self.node_name} kept changing: gave up after {CONFLICT_RETRIES} conflicts")
        if self._condition_reason(node) != desired.health.value:
            self._set_condition(desired.health, verdict)
        if current != desired.health.value:
            self._event(node, current, desired.health, verdict)
        if desired.health is not verdict.health:
            # Held back (jobs still running): the dispatcher calls again later with the same verdict.
            raise RetryLater(self.config.drain.poll_s, f"waiting for accelerator pods before {verdict.health.value}")

    def _desired(self, verdict: NodeVerdict, health: Health) -> Desired:
        p = self.prefix
        labels = {self.health_key: health.value}
        annotations: dict[str, str] = {}
        if health in UNHEALTHY:
            if verdict.fault_types:
                labels[f"{p}fault-types"] = label_value(verdict.fault_types)
            if verdict.fault_reasons:
                labels[f"{p}fault-reasons"] = label_value(verdict.fault_reasons)
        if verdict.faults:
            details = [{"time": _now_iso(f.time), "component": f.component, "code": f.code, "message": f.message,
                        "action": f.action} for f in verdict.faults[:20]]
            annotations[f"{p}fault-details"] = json.dumps(details, separators=(",", ":"))
        if verdict.deep_check:
            labels[f"{p}deep-health-check-status"] = verdict.deep_check
        unhealthy = health in UNHEALTHY
        return Desired(health, labels, annotations, taint=unhealthy and self.config.taint,
                       cordon=unhealthy and self.config.cordon)

    def _diff(self, node: dict[str, Any], want: Desired) -> tuple[dict[str, Any] | None, Owned]:
        """The one merge patch that takes the node from what it shows to what is wanted, touching only our keys."""
        meta = node.get("metadata", {})
        labels = meta.get("labels") or {}
        annotations = meta.get("annotations") or {}
        spec = node.get("spec") or {}
        owned = Owned.parse(annotations.get(self.owned_key))
        new_owned = Owned(cordon=owned.cordon and bool(spec.get("unschedulable")))
        label_patch = _map_patch(labels, want.labels, owned.labels)
        ann_patch = _map_patch(annotations, want.annotations, owned.annotations)
        new_owned.labels, new_owned.annotations = list(want.labels), list(want.annotations)

        taints = list(spec.get("taints") or [])
        others = [t for t in taints if t.get("key") != self.health_key]
        present = len(others) != len(taints)
        correct = any(t.get("key") == self.health_key and t.get("value") == "Unschedulable"
                      and t.get("effect") == "NoSchedule" for t in taints)
        new_taints = None
        if want.taint:
            if not correct:
                new_taints = [*others, {"key": self.health_key, "value": "Unschedulable", "effect": "NoSchedule"}]
            if not correct or self.health_key in owned.taints:
                new_owned.taints = [self.health_key]  # a matching taint someone else placed stays theirs
        elif present and self.health_key in owned.taints:
            new_taints = others

        cordon_patch = None
        cordoned = bool(spec.get("unschedulable"))
        if want.cordon:
            if not cordoned:
                cordon_patch, new_owned.cordon = True, True
        else:
            if cordoned and owned.cordon:
                cordon_patch = False
            new_owned.cordon = False  # a cordon someone else placed is never ours to lift
        new_owned.health = want.health.value

        owned_text = new_owned.dump()
        if annotations.get(self.owned_key) != owned_text:
            ann_patch[self.owned_key] = owned_text
        if not (label_patch or ann_patch or new_taints is not None or cordon_patch is not None):
            return None, new_owned
        patch: dict[str, Any] = {"metadata": {"resourceVersion": meta.get("resourceVersion")}}
        if label_patch:
            patch["metadata"]["labels"] = label_patch
        if ann_patch:
            patch["metadata"]["annotations"] = ann_patch
        if new_taints is not None or cordon_patch is not None:
            patch["spec"] = {}
            if new_taints is not None:
                patch["spec"]["taints"] = new_taints  # an atomic list: the whole list, guarded by resourceVersion
            if cordon_patch is not None:
                patch["spec"]["unschedulable"] = cordon_patch
        return patch, new_owned

    # -- gates: job awareness and the circuit breaker --------------------------------------------------------------
    def _gate(self, verdict: NodeVerdict, node: dict[str, Any], current: str | None) -> Health:
        health = verdict.health
        already_out = current in {h.value for h in UNHEALTHY}
        if health in UNHEALTHY and not already_out and not held_for_deep_checks(verdict):
            self._circuit_breaker()
        if health in HANDED_ON and current != health.value and self.config.drain.mode != "immediate":
            busy = self._accelerator_pods()
            if busy:
                started = self._drain_started.setdefault(verdict.generation, self.clock())
                waited = self.clock() - started
                if self.config.drain.mode == "evict" and waited >= self.config.drain.timeout_s:
                    self._evict(busy)
                log.info("holding %s on %s: %d accelerator pod(s) still running (%s)", health.value,
                         self.node_name, len(busy), ", ".join(f"{p['namespace']}/{p['name']}" for p in busy[:5]))
                return Health.UNSCHEDULABLE  # out of scheduling now; recovery is handed on once they are done
        self._drain_started.pop(verdict.generation, None)
        return health

    def _circuit_breaker(self) -> None:
        selector = f"{self.health_key} in ({','.join(h.value for h in UNHEALTHY)})"
        held = self._count_held(selector)
        total = self._count_all()
        cfg = self.config.circuit_breaker
        allowed = max(1, math.floor(total * cfg.max_fraction))
        if cfg.max_nodes is not None:
            allowed = min(allowed, cfg.max_nodes)
        if held >= allowed:
            why = (f"circuit breaker: {held} of {total} nodes already held out by nodemedic (limit {allowed}); "
                   f"not quarantining {self.node_name} now, retrying in {cfg.retry_s:g}s")
            log.error(why)
            if self.on_refused is not None:
                self.on_refused(why)
            raise RetryLater(cfg.retry_s, why)

    def _count_all(self) -> int:
        """All nodes, from a one-item page: the item plus the server's remainingItemCount."""
        resp = self.api.list_node(limit=1, _request_timeout=self.config.request_timeout_s)
        remaining = resp.metadata.remaining_item_count if resp.metadata is not None else None
        return len(resp.items) + int(remaining or 0)

    def _count_held(self, selector: str) -> int:
        """Nodes matching the selector; the server leaves remainingItemCount unset for selected lists, so page."""
        count, token = 0, None
        while True:
            resp = self.api.list_node(label_selector=selector, limit=500, _continue=token,
                                      _request_timeout=self.config.request_timeout_s)
            count += len(resp.items)
            token = resp.metadata._continue if resp.metadata is not None else None
            if not token:
                return count

    def _accelerator_pods(self) -> list[dict[str, str]]:
        resp = self.api.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node_name},status.phase!=Succeeded,status.phase!=Failed",
            _request_timeout=self.config.request_timeout_s)
        busy = []
        for pod in resp.items:
            if _uses(pod, self.config.drain.resources):
                busy.append({"namespace": pod.metadata.namespace, "name": pod.metadata.name})
        return busy

    def _evict(self, pods: list[dict[str, str]]) -> None:
        for pod in pods:
            body = {"apiVersion": "policy/v1", "kind": "Eviction",
                    "metadata": {"name": pod["name"], "namespace": pod["namespace"]}}
            if self.dry_run:
                log.warning("dry run: would evict %s/%s", pod["namespace"], pod["name"])
                continue
            try:
                self.api.create_namespaced_pod_eviction(pod["name"], pod["namespace"], body,
                                                        _request_timeout=self.config.request_timeout_s)
                log.warning("evicted %s/%s from %s after the drain timeout", pod["namespace"], pod["name"],
                            self.node_name)
            except Exception as exc:  # a PodDisruptionBudget may refuse: try again on the next round
                log.warning("could not evict %s/%s: %s", pod["namespace"], pod["name"], exc)

    # -- writes ------------------------------------------------------------------------------------------------------
    def _read_node(self) -> dict[str, Any]:
        node = self.api.read_node(self.node_name, _request_timeout=self.config.request_timeout_s)
        return self.api.api_client.sanitize_for_serialization(node)

    def _patch_node(self, patch: dict[str, Any], node: dict[str, Any]) -> None:
        if self.dry_run:
            log.warning("dry run: would PATCH node %s (%s): %s", self.node_name, MERGE_PATCH,
                        json.dumps(patch, sort_keys=True))
            return
        try:
            self.api.patch_node(self.node_name, patch, _content_type=MERGE_PATCH,
                                _request_timeout=self.config.request_timeout_s)
        except Exception as exc:
            if getattr(exc, "status", None) == 409:
                raise _Conflict() from exc
            raise

    def _condition_reason(self, node: dict[str, Any]) -> str | None:
        for c in (node.get("status") or {}).get("conditions") or []:
            if c.get("type") == self.config.condition_type:
                return c.get("reason")
        return None

    def _set_condition(self, health: Health, verdict: NodeVerdict) -> None:
        ok = health is Health.SCHEDULABLE
        now = _now_iso(self.clock())
        reasons = _why(verdict) or "no faults"
        condition = {"type": self.config.condition_type, "status": "True" if ok else "False",
                     "reason": health.value, "message": f"nodemedic: {health.value} ({reasons})"[:1024],
                     "lastHeartbeatTime": now, "lastTransitionTime": now}
        patch = {"status": {"conditions": [condition]}}
        if self.dry_run:
            log.warning("dry run: would PATCH node %s status (%s): %s", self.node_name, STRATEGIC_PATCH,
                        json.dumps(patch, sort_keys=True))
            return
        self.api.patch_node_status(self.node_name, patch, _content_type=STRATEGIC_PATCH,
                                   _request_timeout=self.config.request_timeout_s)

    def _event(self, node: dict[str, Any], before: str | None, health: Health, verdict: NodeVerdict) -> None:
        if not self.config.events:
            return
        now = _now_iso(self.clock())
        meta = node.get("metadata", {})
        reasons = _why(verdict)
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{self.node_name}.{uuid.uuid4().hex[:16]}",
                         "namespace": self.config.events_namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": meta.get("uid")},
            "reason": health.value,
            "message": f"nodemedic: {before or 'unknown'} -> {health.value}" + (f" ({reasons})" if reasons else ""),
            "type": "Normal" if health is Health.SCHEDULABLE else "Warning",
            "source": {"component": "nodemedic", "host": self.node_name},
            "reportingComponent": "nodemedic", "reportingInstance": self.node_name,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        if self.dry_run:
            log.warning("dry run: would create Event %s", json.dumps(body, sort_keys=True))
            return
        try:
            self.api.create_namespaced_event(self.config.events_namespace, body,
                                             _request_timeout=self.config.request_timeout_s)
        except Exception as exc:  # an Event is a courtesy: losing one must not fail the verdict
            log.warning("could not create Event for %s: %s", self.node_name, exc)

    # -- operator intent ---------------------------------------------------------------------------------------------
    def _watch_intent(self) -> None:
        """Watch the own Node: a person setting the health label to a pending reboot/replacement is a request."""
        from kubernetes import watch

        backoff = 1.0
        while not self._stop.is_set():
            w = self._watch = watch.Watch()
            try:
                for event in w.stream(self.api.list_node, field_selector=f"metadata.name={self.node_name}",
                                      timeout_seconds=60, _request_timeout=90):
                    if self._stop.is_set():
                        w.stop()
                        break
                    backoff = 1.0
                    meta = getattr(event.get("object"), "metadata", None)
                    labels = getattr(meta, "labels", None) or {}
                    value = labels.get(self.health_key)
                    ours = Owned.parse((getattr(meta, "annotations", None) or {}).get(self.owned_key)).health
                    if value in (Health.PENDING_REBOOT.value, Health.PENDING_REPLACEMENT.value) and value != ours \
                            and value != self._requested and self.on_intent is not None:
                        log.warning("operator request on node %s: %s", self.node_name, value)
                        self._requested = value
                        self.on_intent(Health(value))
            except Exception as exc:
                log.info("node watch ended (%s); reconnecting in %.0fs", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 60)


def _map_patch(current: dict[str, str], want: dict[str, str], owned: list[str]) -> dict[str, str | None]:
    """Merge-patch entries for one map: what is wanted and differs, and None for our keys no longer wanted."""
    patch: dict[str, str | None] = {k: v for k, v in want.items() if current.get(k) != v}
    patch.update({k: None for k in owned if k not in want and k in current})
    return patch


class _Conflict(Exception):
    pass


def _uses(pod: Any, resources: list[str]) -> bool:
    for c in (pod.spec.containers or []) + (pod.spec.init_containers or []):
        req = c.resources
        if req is None:
            continue
        for amounts in (req.limits or {}, req.requests or {}):
            for name, qty in amounts.items():
                if name in resources and str(qty) not in ("0", ""):
                    return True
    return False


def make_api(config: KubernetesConfig) -> Any:
    """A CoreV1Api for the cluster: in-cluster credentials, a kubeconfig, or a bare URL (tests)."""
    from kubernetes import client, config as kube_config

    if config.api_url:
        conf = client.Configuration(host=config.api_url)
        conf.retries = 0  # the dispatcher owns retries, with backoff and latest-state-only semantics
        return client.CoreV1Api(client.ApiClient(conf))
    if config.kubeconfig:
        kube_config.load_kube_config(config_file=config.kubeconfig)
    else:
        kube_config.load_incluster_config()
    return client.CoreV1Api()
