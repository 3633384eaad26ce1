"""tandem.common.config: engine, worker and KV-transfer flags generated from their dataclasses, with env overrides."""

from __future__ import annotations

import argparse
import os

import pytest

from tandem.common.config import (ConfigError, EngineConfig, TransferFlags, WorkerConfig, add_engine_args, check_exposure,
                                  add_transfer_args, add_worker_args, engine_config_from_args, tls_config_from_args,
                                  worker_config_from_args)
from tandem.common.transfer.messages import transfer_config_from_args


@pytest.fixture(autouse=True)
def _no_tandem_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("TANDEM_"):
            monkeypatch.delenv(name)


def worker_parser(prefill: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    add_transfer_args(parser, prefill=prefill)
    return parser


def test_engine_defaults_are_the_dataclass_defaults(tmp_path):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--model", str(tmp_path)])) == \
        EngineConfig(model_path=str(tmp_path))


@pytest.mark.parametrize("flag", ["--model", "--model-path"])
def test_model_path_aliases(tmp_path, flag):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([flag, str(tmp_path)]).model_path == str(tmp_path)


@pytest.mark.parametrize("flag", ["--max-context-len", "--max-model-len", "--context-length"])
def test_context_length_aliases(flag):
    parser = argparse.ArgumentParser()
    add_engine_args(parser, require_model=False)
    assert parser.parse_args([flag, "2048"]).max_context_len == 2048


def test_model_is_required_unless_its_env_is_set(monkeypatch, tmp_path):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([])
    monkeypatch.setenv("TANDEM_MODEL", str(tmp_path))
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).model_path == str(tmp_path)


def test_engine_env_overrides(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_PAGE_SIZE", "32")
    monkeypatch.setenv("TANDEM_MEM_FRACTION", "0.5")
    monkeypatch.setenv("TANDEM_DISABLE_RADIX_CACHE", "true")
    monkeypatch.setenv("TANDEM_MAX_CONTEXT_LEN", "4096")
    monkeypatch.setenv("TANDEM_EVENT_LOOP", "normal")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--model", str(tmp_path)]))
    assert (config.page_size, config.mem_fraction, config.disable_radix_cache) == (32, 0.5, True)
    assert (config.max_context_len, config.event_loop) == (4096, "normal")


def test_engine_bad_env_names_the_variable(monkeypatch):
    monkeypatch.setenv("TANDEM_MAX_TOTAL_TOKENS", "lots")
    with pytest.raises(ConfigError, match="TANDEM_MAX_TOTAL_TOKENS='lots'"):
        add_engine_args(argparse.ArgumentParser())


def test_engine_validation_still_names_the_flag(tmp_path):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(ConfigError, match="--page-size must be >= 1"):
        engine_config_from_args(parser.parse_args(["--model", str(tmp_path), "--page-size", "0"]))


def test_worker_defaults_and_flags(tmp_path):
    args = worker_parser().parse_args(["--model", str(tmp_path)])
    assert worker_config_from_args(args) == WorkerConfig()
    assert WorkerConfig() == WorkerConfig(host="127.0.0.1", port=30000, served_model_name=None,
                                          drain_timeout=30.0, metrics_port=None)
    args = worker_parser().parse_args(["--model", str(tmp_path), "--host", "0.0.0.0", "--port", "0",
                                       "--served-model-name", "m", "--drain-timeout", "5", "--metrics-port", "9100"])
    assert worker_config_from_args(args) == WorkerConfig("0.0.0.0", 0, "m", 5.0, 9100)


def test_worker_drain_default_matches_the_server():
    from tandem.common.rpc.server import DEFAULT_DRAIN_TIMEOUT_S

    assert WorkerConfig().drain_timeout == DEFAULT_DRAIN_TIMEOUT_S


def test_worker_env_overrides(monkeypatch, tmp_path):
    for name, value in {"HOST": "0.0.0.0", "PORT": "31000", "SERVED_MODEL_NAME": "llama", "DRAIN_TIMEOUT": "9",
                        "METRICS_PORT": "9400"}.items():
        monkeypatch.setenv(f"TANDEM_{name}", value)
    config = worker_config_from_args(worker_parser().parse_args(["--model", str(tmp_path)]))
    assert config == WorkerConfig("0.0.0.0", 31000, "llama", 9.0, 9400)


def test_worker_bad_metrics_port(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_METRICS_PORT", "nine")
    with pytest.raises(ConfigError, match="TANDEM_METRICS_PORT"):
        worker_parser()
    monkeypatch.delenv("TANDEM_METRICS_PORT")
    with pytest.raises(ConfigError, match="--metrics-port"):
        worker_config_from_args(worker_parser().parse_args(["--model", str(tmp_path), "--metrics-port", "70000"]))


def test_transfer_flags_to_transfer_config(tmp_path):
    args = worker_parser().parse_args(["--model", str(tmp_path), "--host", "10.0.0.5", "--port", "30001",
                                       "--bootstrap-timeout", "60", "--transfer-timeout", "300.5",
                                       "--heartbeat-interval", "2", "--heartbeat-max-missed", "5"])
    config = transfer_config_from_args(args, bootstrap_port=8998)
    assert (config.bootstrap_host, config.bootstrap_port) == ("10.0.0.5", 8998)
    assert (config.bootstrap_timeout_s, config.transfer_timeout_s) == (60.0, 300.5)
    assert (config.heartbeat_interval_s, config.heartbeat_max_missed) == (2.0, 5)
    assert config.engine_id.endswith(":30001")


def test_transfer_defaults_match_the_old_flags(tmp_path):
    args = worker_parser().parse_args(["--model", str(tmp_path)])
    config = transfer_config_from_args(args)
    assert (config.bootstrap_timeout_s, config.transfer_timeout_s) == (30.0, 120.0)
    assert (config.heartbeat_interval_s, config.heartbeat_max_missed, config.bootstrap_port) == (1.0, 3, 0)


def test_engine_id_flag_env_and_random_with_port_zero(monkeypatch, tmp_path):
    args = worker_parser().parse_args(["--model", str(tmp_path), "--port", "0"])
    first, second = transfer_config_from_args(args), transfer_config_from_args(args)
    assert first.engine_id != second.engine_id  # port 0 does not tell two workers on one host apart
    args = worker_parser().parse_args(["--model", str(tmp_path), "--engine-id", "p0"])
    assert transfer_config_from_args(args).engine_id == "p0"
    monkeypatch.setenv("TANDEM_ENGINE_ID", "from-env")
    assert transfer_config_from_args(worker_parser().parse_args(["--model", str(tmp_path)])).engine_id == "from-env"


def test_bootstrap_port_only_for_prefill(monkeypatch, tmp_path):
    assert not hasattr(worker_parser().parse_args(["--model", str(tmp_path)]), "bootstrap_port")
    assert worker_parser(prefill=True).parse_args(["--model", str(tmp_path)]).bootstrap_port == 8998
    monkeypatch.setenv("TANDEM_BOOTSTRAP_PORT", "9000")
    monkeypatch.setenv("TANDEM_HEARTBEAT_MAX_MISSED", "7")
    args = worker_parser(prefill=True).parse_args(["--model", str(tmp_path)])
    assert (args.bootstrap_port, args.heartbeat_max_missed) == (9000, 7)
    assert TransferFlags().bootstrap_port == 8998


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_a_loopback_worker_needs_neither_tls_nor_insecure(host):
    assert check_exposure(WorkerConfig(host=host), None) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "", "10.1.2.3", "::", "worker-0.tandem.svc"])
def test_a_plaintext_worker_beyond_loopback_is_refused_unless_insecure(tmp_path, host):
    args = worker_parser(prefill=True).parse_args(["--model", str(tmp_path), "--host", host])
    with pytest.raises(ConfigError, match="--insecure") as refused:
        check_exposure(worker_config_from_args(args), tls_config_from_args(args))
    assert "NIXL metadata" in str(refused.value)
    args = worker_parser(prefill=True).parse_args(["--model", str(tmp_path), "--host", host, "--insecure"])
    warning = check_exposure(worker_config_from_args(args), tls_config_from_args(args))
    assert "--insecure" in warning and "engine id" in warning


def test_a_worker_beyond_loopback_with_mutual_tls_starts(tmp_path):
    files = [str(tmp_path / name) for name in ("ca.crt", "tls.crt", "tls.key")]
    args = worker_parser().parse_args(["--model", str(tmp_path), "--host", "0.0.0.0", "--tls-ca-file", files[0],
                                       "--tls-cert-file", files[1], "--tls-key-file", files[2]])
    assert check_exposure(worker_config_from_args(args), tls_config_from_args(args)) is None


def test_serve_role_refuses_before_loading_anything(tmp_path):
    from types import SimpleNamespace

    from tandem.common.roles import Role
    from tandem.common.rpc.startup import serve_role

    served = []
    engine = SimpleNamespace(node_rank=0, dp_size=1)
    with pytest.raises(ConfigError, match="beyond loopback"):
        serve_role(None, Role.DECODE, engine, WorkerConfig(host="0.0.0.0"), None, lambda: served.append(1))
    assert served == []
    assert serve_role(None, Role.DECODE, engine, WorkerConfig(host="0.0.0.0", insecure=True), None,
                      lambda: served.append(1) or 0) == 0 and served == [1]


def test_prefill_chunk_defaults_by_device_and_the_flag_wins(tmp_path):
    assert EngineConfig(model_path=str(tmp_path)).prefill_chunk == 1024
    assert EngineConfig(model_path=str(tmp_path), device="cuda:1").prefill_chunk == 4096
    assert EngineConfig(model_path=str(tmp_path), chunked_prefill_size=300).prefill_chunk == 300
    assert EngineConfig(model_path=str(tmp_path), chunked_prefill_size=0).validate().prefill_chunk == 0
    with pytest.raises(ConfigError, match=r"--chunked-prefill-size \(8\) must be >= --page-size \(16\)"):
        EngineConfig(model_path=str(tmp_path), chunked_prefill_size=8).validate()
