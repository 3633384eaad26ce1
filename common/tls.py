"""Mutual TLS for Tandem's internal gRPC hops: TlsConfig (common/config.py) as gRPC server and channel credentials,
and the client-facing TLS of the router's HTTP and gRPC APIs."""

from __future__ import annotations

import os
import ssl
from typing import Optional

import grpc

from tandem.common.config import ConfigError, TlsConfig


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"{flag} {path!r}: cannot read it ({e.strerror})") from None


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """A server that demands a client certificate signed by the CA: nothing without one reaches a servicer."""
    return grpc.ssl_server_credentials(
        [(_read(tls.tls_key_file, "--tls-key-file"), _read(tls.tls_cert_file, "--tls-cert-file"))],
        root_certificates=_read(tls.tls_ca_file, "--tls-ca-file"), require_client_auth=True)


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """A client that trusts only servers the CA signed and presents its own certificate."""
    return grpc.ssl_channel_credentials(root_certificates=_read(tls.tls_ca_file, "--tls-ca-file"),
                                        private_key=_read(tls.tls_key_file, "--tls-key-file"),
                                        certificate_chain=_read(tls.tls_cert_file, "--tls-cert-file"))


def check_readable(tls: Optional[TlsConfig]) -> None:
    """Read every file now (ConfigError naming the flag), before a worker spends minutes loading its model."""
    if tls is not None and tls.enabled:
        server_credentials(tls)
        channel_credentials(tls)


def channel_options(tls: Optional[TlsConfig]) -> list[tuple[str, str]]:
    """gRPC verifies the server's name against the host dialed; --tls-server-name names it instead (pods are
    dialed by IP, one certificate carries a DNS name)."""
    if tls is not None and tls.enabled and tls.tls_server_name:
        return [("grpc.ssl_target_name_override", tls.tls_server_name)]
    return []


def add_port(server, address: str, tls: Optional[TlsConfig]) -> int:
    """Bind `address` on a grpc (or grpc.aio) server, with mutual TLS when `tls` is on; the bound port, 0 if
    none."""
    if tls is not None and tls.enabled:
        return server.add_secure_port(address, server_credentials(tls))
    return server.add_insecure_port(address)


def blocking_channel(address: str, tls: Optional[TlsConfig], options: Optional[list] = None) -> grpc.Channel:
    """A blocking channel: mutual TLS when `tls` is on, plaintext otherwise."""
    options = list(options or []) + channel_options(tls)
    if tls is not None and tls.enabled:
        return grpc.secure_channel(address, channel_credentials(tls), options=options)
    return grpc.insecure_channel(address, options=options)


def aio_channel(address: str, tls: Optional[TlsConfig], options: Optional[list] = None) -> grpc.aio.Channel:
    """An asyncio channel: mutual TLS when `tls` is on, plaintext otherwise."""
    options = list(options or []) + channel_options(tls)
    if tls is not None and tls.enabled:
        return grpc.aio.secure_channel(address, channel_credentials(tls), options=options)
    return grpc.aio.insecure_channel(address, options=options)


# ---- client-facing (the router's HTTP and gRPC APIs): the server proves itself, clients use the API key ----

def https_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    for path, flag in ((certfile, "--ssl-certfile"), (keyfile, "--ssl-keyfile")):
        if not os.path.isfile(path):
            raise ConfigError(f"{flag} {path!r} is not a file")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile, keyfile)
    return context


def public_server_credentials(certfile: str, keyfile: str) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(_read(keyfile, "--ssl-keyfile"), _read(certfile, "--ssl-certfile"))])
