"""RouterConfig from `tandem router` command lines and TANDEM_ROUTER_* env: every flag, alias and worker list."""

from __future__ import annotations

import argparse
import os

import pytest

from tandem.common.flags import ConfigError
from tandem.services.router.config import DnsTarget, RouterConfig, WorkerEndpoint, add_router_args, config_from_args


@pytest.fixture(autouse=True)
def _no_router_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("TANDEM_ROUTER_"):
            monkeypatch.delenv(name)


def router_config(argv: list[str]) -> RouterConfig:
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    return config_from_args(parser.parse_args(argv))


def test_unified_workers_and_policy():
    config = router_config(["--worker", "grpc://10.0.0.1:30000", "--worker", "10.0.0.2:30001",
                            "--policy", "round_robin"])
    assert config == RouterConfig(workers=[WorkerEndpoint("unified", "10.0.0.1", 30000),
                                           WorkerEndpoint("unified", "10.0.0.2", 30001)], policy="round_robin")


def test_pd_pairs_and_every_serving_flag():
    config = router_config([
        "--prefill", "grpc://p0:30000,8998", "--prefill", "grpc://[::1]:30002,8999", "--decode", "grpc://d0:30001",
        "--prefill-policy", "random", "--decode-policy", "least_load", "--max-running-requests", "2048",
        "--request-timeout-s", "900", "--grpc-port", "50051", "--no-kv-events", "--host", "0.0.0.0", "--port", "0",
        "--api-key", "k", "--served-model-name", "llama", "--tokenizer-cache-dir", "/tmp/tok"])
    assert config == RouterConfig(
        host="0.0.0.0", port=0, grpc_port=50051, api_key="k", served_model_name="llama",
        tokenizer_cache_dir="/tmp/tok",
        prefill=[WorkerEndpoint("prefill", "p0", 30000, 8998), WorkerEndpoint("prefill", "::1", 30002, 8999)],
        decode=[WorkerEndpoint("decode", "d0", 30001)], prefill_policy="random", decode_policy="least_load",
        max_running_requests=2048, request_timeout_s=900.0, kv_events=False)


def test_dns_targets_and_tuning_flags():
    config = router_config([
        "--prefill-dns", "p.llm.svc:30000:8998", "--decode-dns", "d.llm.svc:30001", "--worker-dns", "w.llm:1",
        "--dns-refresh-s", "5", "--balance-abs-threshold", "4", "--balance-rel-threshold", "2.5",
        "--health-check-interval-s", "1", "--health-check-timeout-s", "3", "--load-poll-interval-s", "0.5",
        "--breaker-failure-threshold", "5", "--breaker-cooldown-s", "7", "--max-retries", "0",
        "--max-queued-requests", "10", "--max-request-body-bytes", "1048576", "--tokenize-threads", "2"])
    assert config.dns_targets == [DnsTarget("prefill", "p.llm.svc", 30000, 8998),
                                  DnsTarget("decode", "d.llm.svc", 30001), DnsTarget("unified", "w.llm", 1)]
    assert config == RouterConfig(
        prefill_dns=[DnsTarget("prefill", "p.llm.svc", 30000, 8998)],
        decode_dns=[DnsTarget("decode", "d.llm.svc", 30001)], worker_dns=[DnsTarget("unified", "w.llm", 1)],
        dns_refresh_s=5.0, balance_abs_threshold=4, balance_rel_threshold=2.5, health_check_interval_s=1.0,
        max_request_body_bytes=1048576, tokenize_threads=2,
        health_check_timeout_s=3.0, load_poll_interval_s=0.5, breaker_failure_threshold=5, breaker_cooldown_s=7.0,
        max_retries=0, max_queued_requests=10)


@pytest.mark.parametrize("flag", ["--model-path", "--model"])
def test_model_path_and_its_alias(tmp_path, flag):
    (tmp_path / "tokenizer.json").write_text("{}")
    assert router_config(["--worker", "h:1", flag, str(tmp_path)]).model_path == str(tmp_path)


def test_env_overrides_with_whitespace_separated_worker_lists(monkeypatch):
    monkeypatch.setenv("TANDEM_ROUTER_PREFILL", "grpc://a:1,2  grpc://b:3,4")
    monkeypatch.setenv("TANDEM_ROUTER_DECODE", "c:5")
    monkeypatch.setenv("TANDEM_ROUTER_POLICY", "random")
    monkeypatch.setenv("TANDEM_ROUTER_MAX_RETRIES", "5")
    monkeypatch.setenv("TANDEM_ROUTER_PORT", "9000")
    monkeypatch.setenv("TANDEM_ROUTER_REQUEST_TIMEOUT_S", "60")
    monkeypatch.setenv("TANDEM_ROUTER_API_KEY", "secret")
    monkeypatch.setenv("TANDEM_ROUTER_NO_KV_EVENTS", "1")
    config = router_config(["--decode", "grpc://e:6"])  # adds to the env's list, as before
    assert config.prefill == [WorkerEndpoint("prefill", "a", 1, 2), WorkerEndpoint("prefill", "b", 3, 4)]
    assert config.decode == [WorkerEndpoint("decode", "c", 5), WorkerEndpoint("decode", "e", 6)]
    assert (config.policy, config.max_retries, config.port, config.request_timeout_s) == ("random", 5, 9000, 60.0)
    assert config.api_key == "secret" and config.kv_events is False


def test_dns_env(monkeypatch):
    monkeypatch.setenv("TANDEM_ROUTER_WORKER_DNS", "w.llm.svc:30000")
    monkeypatch.setenv("TANDEM_ROUTER_DNS_REFRESH_S", "2.5")
    config = router_config([])
    assert config.dns_targets == [DnsTarget("unified", "w.llm.svc", 30000)] and config.dns_refresh_s == 2.5


@pytest.mark.parametrize("env, value", [("TANDEM_ROUTER_PORT", "http"), ("TANDEM_ROUTER_DECODE_POLICY", "best"),
                                        ("TANDEM_ROUTER_NO_KV_EVENTS", "sometimes")])
def test_bad_env_value_names_the_variable(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigError, match=env):
        add_router_args(argparse.ArgumentParser())


@pytest.mark.parametrize("argv, words", [
    (["--prefill", "grpc://p:1", "--decode", "d:2"], "name the bootstrap port"),
    (["--worker", "http://h:1"], "expected grpc://HOST:PORT"),
    (["--prefill-dns", "p:1", "--decode-dns", "d:2"], "NAME:PORT:BOOTSTRAP_PORT"),
    ([], "no workers"),
])
def test_bad_worker_flags_say_what_to_fix(argv, words):
    with pytest.raises(ValueError, match=words):
        router_config(argv)


@pytest.mark.parametrize("argv, words", [
    (["--max-request-body-bytes", "100"], "--max-request-body-bytes must be >= 1024"),
    (["--tokenize-threads", "0"], "--tokenize-threads must be >= 1"),
])
def test_body_limit_and_tokenize_threads_are_validated(argv, words):
    with pytest.raises(ConfigError, match=words):
        router_config(["--worker", "grpc://h:1", *argv])


def test_defaults_unchanged():
    config = RouterConfig()
    assert (config.host, config.port, config.grpc_port, config.dns_refresh_s) == ("127.0.0.1", 8000, None, 10.0)
    assert (config.policy, config.prefill_policy, config.decode_policy) == \
        ("cache_aware", "cache_aware", "power_of_two")
    assert (config.balance_abs_threshold, config.balance_rel_threshold, config.kv_events) == (8, 1.5, True)
    assert (config.health_check_interval_s, config.health_check_timeout_s, config.load_poll_interval_s) == \
        (2.0, 5.0, 1.0)
    assert (config.breaker_failure_threshold, config.breaker_cooldown_s, config.max_retries) == (3, 5.0, 2)
    assert (config.max_running_requests, config.max_queued_requests, config.request_timeout_s) == (1024, 1024, 600.0)
    assert config.model_path is config.served_model_name is config.api_key is None
    assert config.max_request_body_bytes is None and config.tokenize_threads == 4  # None: from the context
    assert config.tokenizer_cache_dir.endswith(os.path.join(".cache", "tandem", "tokenizers"))


def test_chat_template_and_output_parsers(monkeypatch, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    config = router_config(["--worker", "a:1", "--chat-template", str(template), "--tool-call-parser", "hermes"])
    assert (config.chat_template, config.tool_call_parser, config.reasoning_parser) == (str(template), "hermes", None)
    # `tandem up` starts the router as a child: the env names reach it (docs/api.md)
    monkeypatch.setenv("TANDEM_ROUTER_TOOL_CALL_PARSER", "llama3_json")
    monkeypatch.setenv("TANDEM_ROUTER_REASONING_PARSER", "deepseek_r1")
    config = router_config(["--worker", "a:1"])
    assert (config.tool_call_parser, config.reasoning_parser) == ("llama3_json", "deepseek_r1")
    monkeypatch.setenv("TANDEM_ROUTER_REASONING_PARSER", "nope")
    with pytest.raises(ConfigError, match="TANDEM_ROUTER_REASONING_PARSER"):
        router_config(["--worker", "a:1"])
    monkeypatch.delenv("TANDEM_ROUTER_REASONING_PARSER")
    with pytest.raises((ConfigError, SystemExit)):
        router_config(["--worker", "a:1", "--chat-template", str(tmp_path / "missing.jinja")])


def test_max_migrations_flag_env_default_and_check(monkeypatch):
    assert RouterConfig().max_migrations == 2
    assert router_config(["--worker", "grpc://h:1", "--max-migrations", "0"]).max_migrations == 0
    monkeypatch.setenv("TANDEM_ROUTER_MAX_MIGRATIONS", "5")
    assert router_config(["--worker", "grpc://h:1"]).max_migrations == 5
    with pytest.raises(ConfigError, match="--max-migrations must be >= 0"):
        router_config(["--worker", "grpc://h:1", "--max-migrations", "-1"])


def test_admission_reserve_and_http_timeouts():
    config = router_config(["--worker", "h:1"])
    assert (config.admission_reserve, config.admission_min_ratio) == ("estimate", 0.1)
    assert (config.http_keepalive_timeout_s, config.http_header_timeout_s) == (75.0, 10.0)
    config = router_config(["--worker", "h:1", "--admission-reserve", "full", "--admission-min-ratio", "0.25",
                            "--http-keepalive-timeout-s", "5", "--http-header-timeout-s", "2"])
    assert (config.admission_reserve, config.admission_min_ratio) == ("full", 0.25)
    assert (config.http_keepalive_timeout_s, config.http_header_timeout_s) == (5.0, 2.0)
    with pytest.raises(ConfigError, match="--admission-min-ratio must be in"):
        router_config(["--worker", "h:1", "--admission-min-ratio", "0"])
    with pytest.raises(SystemExit):  # argparse names the choices
        router_config(["--worker", "h:1", "--admission-reserve", "optimistic"])
