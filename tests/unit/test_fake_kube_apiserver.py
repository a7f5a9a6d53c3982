"""The fake Kubernetes API server, driven by the official `kubernetes` client the agent uses."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime, timezone

import pytest

kubernetes = pytest.importorskip("kubernetes")

import urllib3  # noqa: E402
from kubernetes import client, watch  # noqa: E402
from kubernetes.client.rest import ApiException  # noqa: E402

from tests.fakes.kube_apiserver import FakeKubeApiServer  # noqa: E402

MERGE = "application/merge-patch+json"


@pytest.fixture
def fake():
    with FakeKubeApiServer() as server:
        yield server


def _api_client(fake: FakeKubeApiServer, retries: int | None = None) -> client.ApiClient:
    config = client.Configuration(host=fake.url)
    config.retries = retries
    return client.ApiClient(config)


@pytest.fixture
def core(fake) -> client.CoreV1Api:
    return client.CoreV1Api(_api_client(fake))


def _status(exc: ApiException) -> dict:
    return json.loads(exc.body)


def _taints(node) -> list[tuple[str, str]]:
    return [(t.key, t.effect) for t in node.spec.taints or []]


# -- reads and discovery -----------------------------------------------------------------------------------------


def test_discovery_endpoints_are_valid_for_the_client(fake):
    api_client = _api_client(fake)
    assert client.VersionApi(api_client).get_code().git_version.startswith("v1.")
    assert client.CoreApi(api_client).get_api_versions().versions == ["v1"]
    groups = {g.name for g in client.ApisApi(api_client).get_api_versions().groups}
    assert {"events.k8s.io", "policy"} <= groups
    resources = {r.name for r in client.CoreV1Api(api_client).get_api_resources().resources}
    assert {"nodes", "nodes/status", "pods", "pods/eviction", "events"} <= resources


def test_read_node_deserialises_into_v1node(fake, core):
    fake.add_node("gpu-1", labels={"nvidia.com/gpu.present": "true"}, annotations={"a": "1"},
                  taints=[{"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}],
                  capacity={"nvidia.com/gpu": "8"})

    node = core.read_node("gpu-1")

    assert isinstance(node, client.V1Node)
    assert (node.kind, node.api_version) == ("Node", "v1")
    assert node.metadata.uid and node.metadata.resource_version and node.metadata.creation_timestamp
    assert node.metadata.labels["nvidia.com/gpu.present"] == "true"
    assert _taints(node) == [("dedicated", "NoSchedule")]
    assert node.status.allocatable["nvidia.com/gpu"] == "8"
    assert {c.type: c.status for c in node.status.conditions}["Ready"] == "True"


def test_missing_node_is_a_404_status(core):
    with pytest.raises(ApiException) as err:
        core.read_node("nope")
    assert err.value.status == 404
    body = _status(err.value)
    assert (body["kind"], body["reason"], body["code"]) == ("Status", "NotFound", 404)
    assert body["details"] == {"name": "nope", "kind": "nodes"}


# -- patch flavours ----------------------------------------------------------------------------------------------


def test_dict_patch_is_sent_as_strategic_merge_and_merges_maps(fake, core):
    fake.add_node("n1", labels={"keep": "yes", "drop": "yes"})

    node = core.patch_node("n1", {"metadata": {"labels": {"new": "1", "drop": None}}})

    assert fake.writes()[-1].content_type == "application/strategic-merge-patch+json"
    assert node.metadata.labels["keep"] == "yes" and node.metadata.labels["new"] == "1"
    assert "drop" not in node.metadata.labels


def test_strategic_merge_replaces_taints_because_the_list_is_atomic(fake, core):
    # NodeSpec.Taints carries no patchMergeKey on a real server, so SMP replaces the list wholesale.
    fake.add_node("n1", taints=[{"key": "a", "effect": "NoSchedule"}, {"key": "b", "effect": "NoExecute"}])

    node = core.patch_node("n1", {"spec": {"taints": [{"key": "c", "effect": "NoSchedule"}]}})

    assert _taints(node) == [("c", "NoSchedule")]


def test_patch_delete_directive_does_not_remove_one_taint(fake, core):
    fake.add_node("n1", taints=[{"key": "a", "effect": "NoSchedule"}, {"key": "b", "effect": "NoExecute"}])

    # The directive is kept verbatim in the replacing list, then dropped as an unknown field.
    node = core.patch_node("n1", {"spec": {"taints": [{"$patch": "delete", "key": "a", "effect": "NoSchedule"}]}})
    assert _taints(node) == [("a", "NoSchedule")]

    with pytest.raises(ApiException) as err:
        core.patch_node("n1", {"spec": {"taints": [{"$patch": "delete", "key": "a"}]}})
    assert err.value.status == 422
    assert _status(err.value)["details"]["causes"][0]["field"] == "spec.taints[0].effect"


def test_status_conditions_merge_by_type_on_the_status_subresource(fake, core):
    fake.add_node("n1")
    gpu = {"type": "GpuHealthy", "status": "False", "reason": "XidError",
           "lastTransitionTime": "2024-05-01T12:00:00Z", "lastHeartbeatTime": "2024-05-01T12:00:00.5+00:00"}

    node = core.patch_node_status("n1", {"status": {"conditions": [gpu]}})

    conditions = {c.type: c for c in node.status.conditions}
    assert {"Ready", "MemoryPressure", "GpuHealthy"} <= set(conditions)
    assert conditions["GpuHealthy"].reason == "XidError"
    assert fake.node("n1")["status"]["conditions"][-1]["lastHeartbeatTime"] == "2024-05-01T12:00:00Z"

    node = core.patch_node_status("n1", {"status": {"conditions": [{"type": "GpuHealthy", "status": "True"}]}})
    assert {c.type: c.status for c in node.status.conditions}["GpuHealthy"] == "True"
    assert {c.type: c.reason for c in node.status.conditions}["GpuHealthy"] == "XidError"

    node = core.patch_node_status("n1", {"status": {"conditions": [{"$patch": "delete", "type": "GpuHealthy"}]}})
    assert "GpuHealthy" not in {c.type for c in node.status.conditions}


def test_main_resource_ignores_status_and_status_subresource_ignores_spec(fake, core):
    before = fake.add_node("n1")
    patch = {"status": {"conditions": [{"type": "GpuHealthy", "status": "False"}]}}

    node = core.patch_node("n1", patch)
    assert "GpuHealthy" not in {c.type for c in node.status.conditions}
    assert node.metadata.resource_version == before["metadata"]["resourceVersion"]  # a no-op write

    node = core.patch_node_status("n1", {"spec": {"unschedulable": True}})
    assert not node.spec.unschedulable


def test_merge_patch_replaces_lists_and_nulls_delete(fake, core):
    fake.add_node("n1", labels={"x": "1"}, taints=[{"key": "a", "effect": "NoSchedule"}])

    node = core.patch_node("n1", {"metadata": {"labels": {"x": None}}, "spec": {"taints": None}},
                           _content_type=MERGE)

    assert fake.writes()[-1].content_type == MERGE
    assert "x" not in node.metadata.labels and node.spec.taints is None
    assert "taints" not in fake.node("n1")["spec"]


def test_json_patch_operations_and_failed_test_is_422(fake, core):
    fake.add_node("n1", labels={"x": "1"}, taints=[{"key": "a", "effect": "NoSchedule"}])

    node = core.patch_node("n1", [
        {"op": "test", "path": "/metadata/labels/x", "value": "1"},
        {"op": "replace", "path": "/metadata/labels/x", "value": "2"},
        {"op": "add", "path": "/metadata/labels/nodemedic~1state", "value": "quarantined"},
        {"op": "add", "path": "/spec/taints/-", "value": {"key": "b", "effect": "NoExecute"}},
        {"op": "remove", "path": "/spec/taints/0"},
    ])

    assert fake.writes()[-1].content_type == "application/json-patch+json"
    assert node.metadata.labels["x"] == "2" and node.metadata.labels["nodemedic/state"] == "quarantined"
    assert _taints(node) == [("b", "NoExecute")]
    rv = node.metadata.resource_version

    with pytest.raises(ApiException) as err:
        core.patch_node("n1", [{"op": "test", "path": "/metadata/labels/x", "value": "1"},
                               {"op": "remove", "path": "/spec/taints"}])
    assert err.value.status == 422
    assert fake.node("n1")["metadata"]["resourceVersion"] == rv


def test_unsupported_patch_content_type_is_415(fake, core):
    fake.add_node("n1")
    with pytest.raises(ApiException) as err:
        core.patch_node("n1", {"metadata": {"labels": {"a": "b"}}}, _content_type="application/json")
    assert err.value.status == 415
    assert _status(err.value)["reason"] == "UnsupportedMediaType"


def test_invalid_label_value_is_422(fake, core):
    fake.add_node("n1")
    with pytest.raises(ApiException) as err:
        core.patch_node("n1", {"metadata": {"labels": {"bad": "has spaces"}}})
    assert err.value.status == 422 and _status(err.value)["reason"] == "Invalid"


# -- optimistic concurrency --------------------------------------------------------------------------------------


def test_put_with_stale_resource_version_is_a_conflict(fake, core):
    fake.add_node("n1")
    node = core.read_node("n1")
    fake.set_node_labels("n1", {"someone": "else"})

    node.metadata.labels["mine"] = "1"
    with pytest.raises(ApiException) as err:
        core.replace_node("n1", node)
    assert err.value.status == 409
    body = _status(err.value)
    assert body["reason"] == "Conflict" and "the object has been modified" in body["message"]

    fresh = core.read_node("n1")
    fresh.metadata.labels["mine"] = "1"
    replaced = core.replace_node("n1", fresh)
    assert replaced.metadata.labels["mine"] == "1" and replaced.metadata.labels["someone"] == "else"


@pytest.mark.parametrize("content_type", [None, MERGE])
def test_patch_carrying_stale_resource_version_is_a_conflict(fake, core, content_type):
    stale = fake.add_node("n1")["metadata"]["resourceVersion"]
    fake.set_node_taints("n1", [{"key": "other", "effect": "NoSchedule"}])
    patch = {"metadata": {"resourceVersion": stale}, "spec": {"taints": [{"key": "mine", "effect": "NoSchedule"}]}}
    kwargs = {"_content_type": content_type} if content_type else {}

    with pytest.raises(ApiException) as err:
        core.patch_node("n1", patch, **kwargs)
    assert err.value.status == 409
    assert fake.node("n1")["spec"]["taints"] == [{"key": "other", "effect": "NoSchedule"}]

    patch["metadata"]["resourceVersion"] = fake.node("n1")["metadata"]["resourceVersion"]
    assert _taints(core.patch_node("n1", patch, **kwargs)) == [("mine", "NoSchedule")]


def test_writes_bump_a_global_resource_version(fake, core):
    first = int(fake.add_node("n1")["metadata"]["resourceVersion"])
    second = int(fake.add_node("n2")["metadata"]["resourceVersion"])
    patched = core.patch_node("n1", {"metadata": {"labels": {"a": "b"}}})

    assert first < second < int(patched.metadata.resource_version)
    assert fake.resource_version == patched.metadata.resource_version


# -- selectors and pagination ------------------------------------------------------------------------------------


def test_label_selectors(fake, core):
    fake.add_node("a", labels={"pool": "gpu", "health": "ok"})
    fake.add_node("b", labels={"pool": "gpu", "health": "bad"})
    fake.add_node("c", labels={"pool": "cpu"})

    def names(selector: str) -> list[str]:
        return [n.metadata.name for n in core.list_node(label_selector=selector).items]

    assert names("pool=gpu") == ["a", "b"]
    assert names("pool==gpu,health!=bad") == ["a"]
    assert names("health!=bad") == ["a", "c"]  # a missing label satisfies !=
    assert names("health in (ok, bad)") == ["a", "b"]
    assert names("health notin (bad)") == ["a", "c"]
    assert names("health") == ["a", "b"]
    assert names("!health") == ["c"]
    with pytest.raises(ApiException) as err:
        core.list_node(label_selector="health in ok")
    assert err.value.status == 400


def test_field_selectors_on_nodes(fake, core):
    fake.add_node("a")
    fake.add_node("b", unschedulable=True)

    assert [n.metadata.name for n in core.list_node(field_selector="metadata.name=b").items] == ["b"]
    assert [n.metadata.name for n in core.list_node(field_selector="spec.unschedulable=false").items] == ["a"]
    with pytest.raises(ApiException) as err:
        core.list_node(field_selector="status.phase=Running")
    assert err.value.status == 400 and "field label not supported" in _status(err.value)["message"]


def test_limit_and_continue_page_over_a_consistent_snapshot(fake, core):
    for i in range(100):
        fake.add_node(f"node-{i:03d}", labels={"parity": "even" if i % 2 == 0 else "odd"})

    page = core.list_node(limit=30)
    list_rv = page.metadata.resource_version
    seen = [n.metadata.name for n in page.items]
    remaining = [page.metadata.remaining_item_count]
    fake.add_node("node-050a")  # created after the first page: not part of the snapshot
    while page.metadata._continue:
        page = core.list_node(limit=30, _continue=page.metadata._continue)
        assert page.metadata.resource_version == list_rv
        seen += [n.metadata.name for n in page.items]
        remaining.append(page.metadata.remaining_item_count)

    assert seen == [f"node-{i:03d}" for i in range(100)]
    assert remaining == [70, 40, 10, None]
    assert len(core.list_node().items) == 101

    filtered = core.list_node(limit=10, label_selector="parity=odd")
    assert len(filtered.items) == 10 and filtered.metadata._continue
    assert filtered.metadata.remaining_item_count is None  # never set when a selector filters


def test_continue_token_is_rejected_after_compaction(fake, core):
    for i in range(5):
        fake.add_node(f"n{i}")
    page = core.list_node(limit=2)
    fake.add_node("late")
    fake.compact()

    with pytest.raises(ApiException) as err:
        core.list_node(limit=2, _continue=page.metadata._continue)
    assert err.value.status == 410 and _status(err.value)["reason"] == "Expired"


def test_pod_lists_by_node_and_phase_across_namespaces(fake, core):
    fake.add_pod("train-0", "ml", "gpu-1", containers=[{"resources": {"limits": {"nvidia.com/gpu": "8"}}}])
    fake.add_pod("done", "ml", "gpu-1", phase="Succeeded")
    fake.add_pod("dcgm", "kube-system", "gpu-1", labels={"app": "dcgm"})
    fake.add_pod("elsewhere", "ml", "gpu-2")

    active = core.list_pod_for_all_namespaces(
        field_selector="spec.nodeName=gpu-1,status.phase!=Succeeded,status.phase!=Failed")
    assert [(p.metadata.namespace, p.metadata.name) for p in active.items] == [("kube-system", "dcgm"), ("ml", "train-0")]
    train = active.items[1]
    assert train.spec.containers[0].resources.limits == {"nvidia.com/gpu": "8"}
    assert train.spec.containers[0].resources.requests == {"nvidia.com/gpu": "8"}
    # The client percent-encodes '=', ',' and '!' in selectors; the server decodes them.
    assert "fieldSelector=spec.nodeName%3Dgpu-1%2Cstatus.phase%21%3DSucceeded" in fake.requests[-1].target
    assert fake.requests[-1].query["fieldSelector"].startswith("spec.nodeName=gpu-1,status.phase!=")

    in_ml = core.list_namespaced_pod("ml", field_selector="spec.nodeName=gpu-1")
    assert [p.metadata.name for p in in_ml.items] == ["done", "train-0"]
    assert [p.metadata.name for p in core.list_pod_for_all_namespaces(label_selector="app=dcgm").items] == ["dcgm"]


# -- watch -------------------------------------------------------------------------------------------------------


def test_watch_replays_modified_event_after_resource_version(fake, core):
    rv = fake.add_node("n1")["metadata"]["resourceVersion"]
    fake.add_node("n2")
    core.patch_node("n1", {"metadata": {"labels": {"nodemedic/state": "quarantined"}}})

    stream = watch.Watch().stream(core.list_node, field_selector="metadata.name=n1",
                                  resource_version=rv, timeout_seconds=2)
    event = next(stream)
    stream.close()

    assert event["type"] == "MODIFIED"
    assert isinstance(event["object"], client.V1Node)
    assert event["object"].metadata.labels["nodemedic/state"] == "quarantined"
    assert fake.requests[-1].query["watch"] == "true"


def test_watch_receives_live_event_and_times_out(fake, core):
    fake.add_node("n1")
    rv = core.list_node().metadata.resource_version
    events: list[dict] = []

    def consume() -> None:
        for event in watch.Watch().stream(core.list_node, resource_version=rv, timeout_seconds=1):
            events.append(event)

    consumer = threading.Thread(target=consume)
    started = time.monotonic()
    consumer.start()
    _wait_for(lambda: any(r.query.get("watch") for r in fake.requests))
    fake.set_node_condition("n1", "Ready", "False", reason="KubeletNotReady")
    consumer.join(timeout=5)

    assert not consumer.is_alive() and 0.9 < time.monotonic() - started < 3
    assert [e["type"] for e in events] == ["MODIFIED"]
    ready = {c.type: c.status for c in events[0]["object"].status.conditions}["Ready"]
    assert ready == "False"


def test_watch_without_resource_version_starts_with_synthetic_adds(fake, core):
    fake.add_node("a", labels={"pool": "gpu"})
    fake.add_node("b", labels={"pool": "cpu"})

    stream = watch.Watch().stream(core.list_node, label_selector="pool=gpu", timeout_seconds=2)
    first = next(stream)
    fake.set_node_labels("a", {"pool": None})
    second = next(stream)
    stream.close()

    assert (first["type"], first["object"].metadata.name) == ("ADDED", "a")
    assert (second["type"], second["object"].metadata.name) == ("DELETED", "a")  # left the selector


def test_watch_from_compacted_resource_version_raises_410(fake, core):
    rv = fake.add_node("n1")["metadata"]["resourceVersion"]
    fake.set_node_labels("n1", {"x": "y"})
    fake.compact()

    with pytest.raises(ApiException) as err:
        list(watch.Watch().stream(core.list_node, resource_version=rv, timeout_seconds=1))
    assert err.value.status == 410


# -- faults ------------------------------------------------------------------------------------------------------


def test_injected_429_and_500_raise_api_exception(fake, core):
    fake.add_node("n1")
    fake.fail_next(429, retry_after=2, methods=["PATCH"])
    with pytest.raises(ApiException) as err:
        core.patch_node("n1", {"metadata": {"labels": {"a": "b"}}})
    assert err.value.status == 429
    assert err.value.headers["Retry-After"] == "2"
    assert _status(err.value)["details"]["retryAfterSeconds"] == 2

    fake.fail_next(500, path_contains="/nodes/n1")
    with pytest.raises(ApiException) as err:
        core.read_node("n1")
    assert err.value.status == 500 and _status(err.value)["reason"] == "InternalError"
    assert core.read_node("n1").metadata.name == "n1"  # the fault was consumed
    assert [r.status for r in fake.requests[-3:]] == [429, 500, 200]


def test_urllib3_retries_gets_on_429_with_retry_after(fake, core):
    # With the default Configuration, urllib3 re-sends idempotent requests that got a Retry-After.
    fake.add_node("n1")
    fake.fail_next(429, count=1, retry_after=0)
    assert core.read_node("n1").metadata.name == "n1"
    assert [r.status for r in fake.requests] == [429, 200]

    fake.reset_requests()
    no_retries = client.CoreV1Api(_api_client(fake, retries=0))
    fake.fail_next(429, count=1, retry_after=0)
    with pytest.raises((ApiException, urllib3.exceptions.MaxRetryError)):
        no_retries.read_node("n1")


def test_down_refuses_connections_until_up(fake):
    core = client.CoreV1Api(_api_client(fake, retries=0))
    fake.add_node("n1")
    assert core.read_node("n1").metadata.name == "n1"  # leaves a pooled keep-alive connection

    fake.down()
    with pytest.raises(urllib3.exceptions.MaxRetryError):
        core.read_node("n1")
    fake.up()

    assert core.read_node("n1").metadata.name == "n1"


def test_down_cuts_an_open_watch(fake, core):
    fake.add_node("n1")
    outcome: list[object] = []

    def consume() -> None:
        try:
            for _ in watch.Watch().stream(core.list_node, resource_version=fake.resource_version, timeout_seconds=5):
                pass
            outcome.append("ended")
        except Exception as exc:  # noqa: BLE001 - any transport error is acceptable here
            outcome.append(exc)

    consumer = threading.Thread(target=consume)
    consumer.start()
    _wait_for(lambda: any(r.query.get("watch") for r in fake.requests))
    fake.down()
    consumer.join(timeout=3)
    fake.up()

    assert not consumer.is_alive() and outcome


def test_latency_is_added_per_request(fake, core):
    fake.add_node("n1")
    fake.latency_s = 0.2
    started = time.monotonic()
    core.read_node("n1")
    assert time.monotonic() - started >= 0.2


# -- pods, eviction, events --------------------------------------------------------------------------------------


def test_eviction_removes_the_pod_unless_a_budget_blocks_it(fake, core):
    fake.add_pod("free", "ml", "gpu-1")
    fake.add_pod("guarded", "ml", "gpu-1", eviction_blocked=True)

    def evict(name: str):
        body = client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace="ml"),
                                 delete_options=client.V1DeleteOptions(grace_period_seconds=10))
        return core.create_namespaced_pod_eviction(name, "ml", body)

    evict("free")
    assert not fake.has_pod("ml", "free")
    assert fake.writes()[-1].status == 201
    # The client sends no apiVersion/kind for a bare V1Eviction; the server defaults them from the URL.
    assert fake.writes()[-1].body == {"metadata": {"name": "free", "namespace": "ml"},
                                      "deleteOptions": {"gracePeriodSeconds": 10}}

    with pytest.raises(ApiException) as err:
        evict("guarded")
    assert err.value.status == 429
    assert _status(err.value)["details"]["causes"][0]["reason"] == "DisruptionBudget"
    assert fake.has_pod("ml", "guarded")

    with pytest.raises(ApiException) as err:
        evict("missing")
    assert err.value.status == 404


def test_delete_pod_is_graceful_then_finalised(fake, core):
    fake.add_pod("p", "ml", "gpu-1")
    fake.kubelet_finalizes_deletions = False

    pod = core.delete_namespaced_pod("p", "ml")
    assert pod.metadata.deletion_timestamp is not None and fake.has_pod("ml", "p")

    fake.remove_pod("ml", "p")
    assert not fake.has_pod("ml", "p")


def test_core_v1_event_for_a_node_must_live_in_default(fake, core):
    fake.add_node("n1")
    stamp = datetime(2024, 5, 1, 12, 0, tzinfo=timezone.utc)

    def event(namespace: str) -> client.CoreV1Event:
        return client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name="n1.", namespace=namespace),
            involved_object=client.V1ObjectReference(kind="Node", name="n1", uid=fake.node("n1")["metadata"]["uid"]),
            reason="GpuXid", message="Xid 79 on GPU 3", type="Warning", count=1,
            source=client.V1EventSource(component="nodemedic", host="n1"),
            first_timestamp=stamp, last_timestamp=stamp)

    created = core.create_namespaced_event("default", event("default"))
    assert created.metadata.name.startswith("n1.") and created.reason == "GpuXid"
    with pytest.raises(ApiException) as err:
        core.create_namespaced_event("kube-system", event("kube-system"))
    assert err.value.status == 422

    assert [e["reason"] for e in fake.events] == ["GpuXid"]
    assert fake.events[0]["firstTimestamp"] == "2024-05-01T12:00:00Z"


def test_events_v1_event_requires_reporting_fields_and_an_aware_time(fake):
    events = client.EventsV1Api(_api_client(fake))

    def event(event_time: datetime) -> client.EventsV1Event:
        return client.EventsV1Event(
            metadata=client.V1ObjectMeta(generate_name="n1."), event_time=event_time,
            reporting_controller="nodemedic.io/agent", reporting_instance="nodemedic-n1",
            action="Quarantine", reason="GpuUnhealthy", note="tainted after Xid 79", type="Warning",
            regarding=client.V1ObjectReference(kind="Node", name="n1"))

    created = events.create_namespaced_event("default", event(datetime(2024, 5, 1, 12, 0, 0, 123456, timezone.utc)))
    assert created.reporting_controller == "nodemedic.io/agent"
    assert fake.events[-1]["apiVersion"] == "events.k8s.io/v1"
    assert fake.events[-1]["eventTime"] == "2024-05-01T12:00:00.123456Z"

    with pytest.raises(ApiException) as err:  # a naive datetime serialises without a zone: not RFC 3339
        events.create_namespaced_event("default", event(datetime(2024, 5, 1, 12, 0)))
    assert err.value.status == 400

    bare = client.EventsV1Event(metadata=client.V1ObjectMeta(name="x"), type="Warning",
                                event_time=datetime(2024, 5, 1, tzinfo=timezone.utc))
    with pytest.raises(ApiException) as err:  # no reportingController/reportingInstance/action/reason
        events.create_namespaced_event("default", bare)
    assert err.value.status == 422
    assert len(_status(err.value)["details"]["causes"]) == 4


def test_request_log_records_writes(fake, core):
    fake.add_node("n1")
    fake.reset_requests()
    core.list_node(label_selector="a=b")
    core.patch_node("n1", {"metadata": {"annotations": {"k": "v"}}})

    assert [(r.method, r.path, r.status) for r in fake.requests] == [
        ("GET", "/api/v1/nodes", 200), ("PATCH", "/api/v1/nodes/n1", 200)]
    assert fake.requests[0].query == {"labelSelector": "a=b"}
    [write] = fake.writes()
    assert write.body == {"metadata": {"annotations": {"k": "v"}}}


def _wait_for(predicate, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)
