"""The --tls-* flags: all three or none, env overrides, files read at start-up with errors naming the flag."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from tandem.common.config import ConfigError, TlsConfig, add_tls_args, tls_config_from_args
from tandem.common.launcher.certs import make_deployment_certs
from tandem.common.tls import check_readable, channel_options


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


@pytest.mark.e2e
def test_the_deployment_docs_openssl_recipe_makes_a_usable_ca_and_certificate(tmp_path):
    """The certificate commands docs/deployment.md's Security section tells a reader to run, run as written."""
    readme = (Path(__file__).resolve().parents[2] / "docs" / "deployment.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "openssl req -x509" in b)
    recipe = "\n".join(line for line in block.splitlines() if not line.startswith("tandem "))
    subprocess.run(["bash", "-ec", recipe], cwd=tmp_path, check=True, capture_output=True, timeout=60)
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    cert = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "tandem-internal" in names.get_values_for_type(x509.DNSName)
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usages)
    config = parse("--tls-ca-file", str(tmp_path / "ca.crt"), "--tls-cert-file", str(tmp_path / "tls.crt"),
                   "--tls-key-file", str(tmp_path / "tls.key"), "--tls-server-name", "tandem-internal")
    check_readable(config)
