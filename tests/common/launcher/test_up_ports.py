"""`tandem up` checks every port it will bind before it creates or loads anything, and names the flag to change."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tandem.common.launcher.ports import PlannedPort, check_ports
from tandem.common.launcher.up import UpConfig
from tests.common.rpc.helpers import REPO_ROOT


@pytest.fixture
def held_port():
    """A port something listens on for the test's duration."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def tandem_up(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    """`tandem up` without --model: the built-in model would be created under TANDEM_CACHE_DIR=tmp_path."""
    env = {**os.environ, "TANDEM_CACHE_DIR": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "tandem.common.cli", "up", *flags], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.e2e
def test_a_busy_router_port_is_refused_before_the_model_is_created(tmp_path, held_port):
    done = tandem_up(tmp_path, "--port", str(held_port))
    assert done.returncode == 2
    assert f"port {held_port} (router HTTP) is already in use on 127.0.0.1" in done.stderr
    assert "choose another with --port" in done.stderr
    assert os.listdir(tmp_path) == []  # nothing created, nothing started
    assert "started" not in done.stderr


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def held_port_after_a_free_one():
    """A port something listens on for the test's duration, the port below it free when the test starts (a port
    the OS hands out at random can sit just above one another process holds: try again then)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            if _bindable(port - 1):
                yield port
                return
    pytest.fail("no listening port with a free one below it in 50 tries")


def test_a_busy_metrics_port_names_the_worker_and_the_flag(held_port_after_a_free_one):
    held_port = held_port_after_a_free_one
    config = UpConfig(port=0, unified=2, metrics_port=held_port - 1).validate()
    with pytest.raises(ValueError) as refused:
        check_ports(config.planned_ports())
    assert f"port {held_port} (metrics of worker-1) is already in use" in str(refused.value)
    assert "--metrics-port (the first of 2 consecutive ports)" in str(refused.value)


def test_a_port_asked_for_twice_is_refused():
    config = UpConfig(port=18123, grpc_port=18123).validate()
    with pytest.raises(ValueError, match=r"port 18123 is asked for twice: router HTTP \(--port\) and router gRPC "
                                         r"API \(--grpc-port\)"):
        check_ports(config.planned_ports())


def test_metrics_ports_follow_the_start_order():
    pd = UpConfig(prefill=2, decode=1, metrics_port=9100).validate()
    assert pd.metrics_ports() == {"prefill-0": 9100, "prefill-1": 9101, "decode-0": 9102}
    unified = UpConfig(unified=2, metrics_port=9200, port=0).validate()
    planned = unified.planned_ports()
    assert [(p.port, p.what) for p in planned] == [(0, "router HTTP"), (9200, "metrics of worker-0"),
                                                   (9201, "metrics of worker-1")]
    assert UpConfig().metrics_ports() == {}
    with pytest.raises(ValueError, match="--metrics-port must leave room for 2"):
        UpConfig(prefill=1, decode=1, metrics_port=65535).validate()


def test_port_zero_is_never_checked_and_out_of_range_is_refused():
    check_ports([PlannedPort(0, "127.0.0.1", "router HTTP", "--port")] * 2)
    with pytest.raises(ValueError, match="port 70000 .* change --grpc-port"):
        check_ports([PlannedPort(70000, "127.0.0.1", "router gRPC API", "--grpc-port")])
