"""The command lines the chart renders parse with the real `tandem` CLI parsers and build valid configs, so the
chart and the code cannot drift apart."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's engine) is not installed")

from tests.helm.chart import CASES, NAMESPACE, RenderedContainer, find, one, tandem_containers  # noqa: E402


def tandem_parser() -> argparse.ArgumentParser:
    """The full `tandem` parser."""
    from tandem.common.cli import build_parser

    return build_parser()


def parse(container: RenderedContainer) -> argparse.Namespace:
    argv = container.argv
    assert argv[0] == "tandem", argv
    try:
        return tandem_parser().parse_args(argv[1:])
    except SystemExit as exit_:  # argparse already printed which flag it rejects
        pytest.fail(f"`{' '.join(argv)}` does not parse with the tandem CLI (exit {exit_.code})")


def port_of(container: RenderedContainer, name: str) -> int:
    return next(p["containerPort"] for p in container.container["ports"] if p["name"] == name)


def check_worker(container: RenderedContainer, args: argparse.Namespace, tmp_path) -> None:
    from tandem.common.config import (check_exposure, engine_config_from_args, tls_config_from_args,
                                      worker_config_from_args)
    from tandem.common.transfer.messages import transfer_config_from_args

    assert args.host == "0.0.0.0" and args.port == port_of(container, "grpc")
    if args.command == "prefill":
        assert args.bootstrap_port == port_of(container, "bootstrap")
    assert args.model_path.startswith("/")
    # The engine validates enums and ranges; point it at a real directory (the pod's volume is not here).
    args.model_path = str(tmp_path)
    engine_config_from_args(args)
    if args.command in ("prefill", "decode"):
        transfer_config_from_args(args, bootstrap_port=getattr(args, "bootstrap_port", 0))
    # Listening on 0.0.0.0: TLS, or --insecure said out loud (else the worker refuses to start).
    check_exposure(worker_config_from_args(args), tls_config_from_args(args))
    if getattr(args, "metrics_port", None) is not None:
        assert args.metrics_port == port_of(container, "metrics")
    if args.health_port is not None:
        assert args.health_port == port_of(container, "health")
    if args.command == "decode" and args.allowed_bootstrap is not None:
        from tandem.common.config import TransferFlags
        from tandem.common.flags import from_flags

        from_flags(TransferFlags, args)  # --allowed-bootstrap entries parse


def check_router(case: str, container: RenderedContainer, args: argparse.Namespace, tmp_path):
    from tandem.services.router.config import config_from_args

    assert args.port == port_of(container, "http")
    if args.model_path is not None:
        (tmp_path / "tokenizer.json").write_text("{}")
        args.model_path = str(tmp_path)
    config = config_from_args(args)  # parses the DNS targets and validates everything
    assert config.dns_targets, "the router must discover workers through DNS"
    assert config.tls.enabled == (CASES[case].get("tls", {}).get("enabled", True))
    services = {s["metadata"]["name"]: s for s in find(case, "Service")}
    for target in config.dns_targets:
        service_name, namespace = target.name.split(".")[:2]
        assert namespace == NAMESPACE
        service = services[service_name]  # the headless Service the name points at is rendered
        assert service["spec"]["clusterIP"] == "None"
        ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
        assert ports["grpc"] == target.port
        assert service["metadata"]["labels"]["app.kubernetes.io/component"] == target.role.replace("unified", "worker")
        if target.role == "prefill":
            assert ports["bootstrap"] == target.bootstrap_port
    return config


def check_planner(case: str, container: RenderedContainer, args: argparse.Namespace) -> None:
    from tandem.common.flags import from_flags
    from tandem.common.planner.config import PlannerConfig

    config = from_flags(PlannerConfig, args).validate()
    assert config.metrics_port == port_of(container, "http")
    router = one(case, "Service", "router")
    assert config.router_url == f"http://{router['metadata']['name']}:{router['spec']['ports'][0]['port']}"


@pytest.mark.parametrize("case", CASES)
def test_rendered_command_lines_parse_with_the_tandem_cli(case, tmp_path):
    containers = list(tandem_containers(case))
    assert {c.workload for c in containers} >= {"router"}
    for container in containers:
        args = parse(container)
        assert args.command == container.workload, (args.command, container.workload)
        if args.command == "router":
            check_router(case, container, args, tmp_path)
        elif args.command == "planner":
            check_planner(case, container, args)
        else:
            check_worker(container, args, tmp_path)


def _args(case: str, workload: str) -> argparse.Namespace:
    (container,) = [c for c in tandem_containers(case) if c.workload == workload]
    return parse(container)


def test_values_reach_the_flags_they_name():
    prefill = _args("gpu-rdma-pvc", "prefill")
    assert (prefill.dtype, prefill.device, prefill.mem_fraction) == ("bfloat16", "cuda", 0.85)
    assert prefill.max_total_tokens == 1_000_000  # a float64 in Helm; must not render as 1e+06
    assert (prefill.page_size, prefill.chunked_prefill_size, prefill.schedule_policy) == (64, 8192, "lpm")
    assert (prefill.bootstrap_timeout, prefill.transfer_timeout, prefill.heartbeat_max_missed) == (60.0, 300.5, 5)
    assert prefill.heartbeat_interval == 2.0  # extraArgs come last and win
    assert prefill.model_path == "/models/Llama-3-70B-Instruct" and prefill.served_model_name == "llama-3-70b"
    assert prefill.disable_radix_cache is False
    decode = _args("gpu-rdma-pvc", "decode")
    assert decode.disable_radix_cache is True and decode.max_running_requests == 512
    assert decode.drain_timeout == 120.0 and decode.chunked_prefill_size is None  # prefill's override stays there
    router = _args("gpu-rdma-pvc", "router")
    assert (router.prefill_policy, router.decode_policy) == ("cache_aware", "least_load")
    assert (router.max_running_requests, router.request_timeout_s) == (2048, 900.0)
    assert router.model_path == "/models/Llama-3-70B-Instruct" and router.grpc_port == 50051

    worker = _args("unified-cpu", "worker")
    assert (worker.device, worker.dtype, worker.num_threads, worker.event_loop) == ("cpu", "float32", 8, "normal")
    assert worker.max_total_tokens == 65536 and worker.model_path == "/opt/models/tiny-llama"
    router = _args("unified-cpu", "router")
    assert router.policy == "round_robin" and router.grpc_port is None and router.worker_dns
    assert router.model_path == "/opt/models/tiny-llama"

    decode = _args("pd-moe-ep", "decode")
    assert (decode.tp_size, decode.ep_size) == (4, 2)

    default_prefill = _args("default", "prefill")
    assert default_prefill.device == "cuda" and default_prefill.model_path == "/models"


def test_metrics_port_flag_matches_the_exposed_port():
    for workload in ("prefill", "decode"):
        assert _args("worker-metrics", workload).metrics_port == 9100
