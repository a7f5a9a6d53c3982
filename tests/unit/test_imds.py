from __future__ import annotations

import socket
import time

from nodemedic.checks.platform.imds import Imds, resolve_instance_type

from fakes.imds import FakeImds


def test_instance_type_over_imdsv2():
    with FakeImds({"meta-data/instance-type": "p5.48xlarge"}) as fake:
        imds = Imds(fake.endpoint, timeout_s=2)
        assert imds.instance_type() == "p5.48xlarge"
        assert imds.get("meta-data/nothing") is None
        put = [r for r in fake.requests if r[0] == "PUT"]
        assert len(put) == 1 and put[0][2]["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"


def test_expired_token_is_refreshed():
    with FakeImds({"meta-data/instance-type": "trn1.32xlarge"}) as fake:
        imds = Imds(fake.endpoint, timeout_s=2)
        assert imds.instance_type() == "trn1.32xlarge"
        fake.token = "rotated"
        assert imds.instance_type() is None  # 401 drops the token
        assert imds.instance_type() == "trn1.32xlarge"


def test_absent_imds_is_quiet_and_quick():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    started = time.monotonic()
    assert Imds(f"http://127.0.0.1:{port}", timeout_s=0.3).instance_type() is None
    assert time.monotonic() - started < 2


def test_config_wins_over_imds():
    assert resolve_instance_type("p4d.24xlarge", None) == "p4d.24xlarge"
    assert resolve_instance_type(None, None) is None
