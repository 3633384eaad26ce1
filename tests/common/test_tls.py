"""The --tls-* flags: all three or none, env overrides, files read at start-up with errors naming the flag."""

from __future__ import annotations

import argparse

import pytest

from common.config import ConfigError, TlsConfig, add_tls_args, tls_config_from_args
from common.launcher.certs import make_deployment_certs
from common.tls import check_readable, channel_options


def parse(*argv: str) -> TlsConfig:
    parser = argparse.ArgumentParser()
    add_tls_args(parser)
    return tls_config_from_args(parser.parse_args(list(argv)))


def test_tls_is_off_by_default_and_needs_all_three_files(monkeypatch):
    assert not parse().enabled
    with pytest.raises(ConfigError, match="missing --tls-cert-file, --tls-key-file"):
        parse("--tls-ca-file", "ca.crt")
    monkeypatch.setenv("TANDEM_TLS_CA_FILE", "ca.crt")
    monkeypatch.setenv("TANDEM_TLS_CERT_FILE", "tls.crt")
    monkeypatch.setenv("TANDEM_TLS_KEY_FILE", "tls.key")
    config = parse()
    assert config.enabled and (config.tls_ca_file, config.tls_cert_file, config.tls_key_file) == (
        "ca.crt", "tls.crt", "tls.key")


def test_unreadable_files_are_named_at_start_up(tmp_path):
    files = make_deployment_certs(str(tmp_path))
    check_readable(TlsConfig(files.ca_file, files.cert_file, files.key_file))
    with pytest.raises(ConfigError, match="--tls-key-file"):
        check_readable(TlsConfig(files.ca_file, files.cert_file, str(tmp_path / "missing.key")))


def test_server_name_override_only_with_tls():
    assert channel_options(TlsConfig("a", "b", "c", "tandem-internal")) == [
        ("grpc.ssl_target_name_override", "tandem-internal")]
    assert channel_options(TlsConfig(tls_server_name="tandem-internal")) == []
