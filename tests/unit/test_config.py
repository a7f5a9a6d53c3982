from __future__ import annotations

import socket
from pathlib import Path

import pytest

from nodemedic.config import ConfigError, load_config
from nodemedic.policy import CheckMode


def test_defaults_need_no_file(tmp_path):
    cfg = load_config(env={}, path=None) if not Path("/etc/nodemedic/nodemedic.yaml").exists() else None
    if cfg is None:
        pytest.skip("a host config exists")
    assert cfg.node_name == socket.gethostname()
    assert cfg.state_dir == Path("/var/lib/nodemedic")
    assert cfg.checks.kernel_log.enabled and cfg.checks.kernel_log.source == "auto"
    assert cfg.actions.backend == "auto" and cfg.profile == "default"


def test_file_then_env_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("node_name: from-file\nmetrics: {port: 1234}\nchecks:\n  kernel_log: {path: /var/log/kern.log}\n")
    env = {"NODEMEDIC_METRICS__PORT": "4321", "NODEMEDIC_METRICS__ENABLED": "false",
           "NODEMEDIC_CHECKS__KERNEL_LOG__MODE": "observe", "NODEMEDIC_INSTANCE_TYPE": "p5.48xlarge"}
    cfg = load_config(f, env=env, overrides={"state_dir": str(tmp_path / "s")})
    assert cfg.node_name == "from-file"
    assert cfg.metrics.port == 4321 and cfg.metrics.enabled is False
    assert cfg.checks.kernel_log.path == "/var/log/kern.log"
    assert cfg.checks.kernel_log.mode is CheckMode.OBSERVE
    assert cfg.policy_config().check_modes["kernel_log"] is CheckMode.OBSERVE
    assert cfg.instance_type == "p5.48xlarge"
    assert cfg.state_dir == tmp_path / "s"


def test_config_path_from_env_and_node_name_from_downward_api(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("log_level: debug\n")
    cfg = load_config(env={"NODEMEDIC_CONFIG": str(f), "NODE_NAME": "ip-10-0-0-1"})
    assert cfg.log_level == "debug" and cfg.node_name == "ip-10-0-0-1"


@pytest.mark.parametrize("text,key", [
    ("metrics: {port: seventy}\n", "metrics.port"),
    ("metrics: {port: 70000}\n", "metrics.port"),
    ("checks: {kernel_log: {sourse: file}}\n", "checks.kernel_log.sourse"),
    ("policy: {dedup_window_s: -1}\n", "policy.dedup_window_s"),
    ("profile: fancy\n", "profile"),
    ("catalog: {XID_79: {action: explode}}\n", "XID_79"),
])
def test_errors_name_the_offending_key_and_file(tmp_path, text, key):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(f, env={})
    assert key in str(exc.value) and str(f) in str(exc.value)


def test_env_errors_name_the_variable(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path / "none.yaml" if False else None, env={"NODEMEDIC_CONFIG": "",
                                                                   "NODEMEDIC_METRICS__PORT": "abc"})
    assert "metrics.port" in str(exc.value) and "NODEMEDIC_METRICS__PORT" in str(exc.value)


@pytest.mark.parametrize("text,words", [("a: [1,\n", "not valid YAML"), ("- 1\n- 2\n", "must be a mapping")])
def test_malformed_files(tmp_path, text, words):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=words):
        load_config(f, env={})


def test_explicit_missing_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml", env={})


def test_the_shipped_example_config_loads():
    from conftest import REPO
    cfg = load_config(REPO / "deploy" / "nodemedic.example.yaml", env={})
    assert cfg.catalog["XID_109"]["action"] == "watch"
    assert cfg.actions.kubernetes.circuit_breaker.max_fraction == 0.10
