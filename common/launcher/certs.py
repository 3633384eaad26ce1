"""Throwaway certificates for mutual TLS: a CA and one certificate it signs, for `tandem up --tls` and the tests.
Never for production: the CA's key is written next to the certificates and lives as long as the directory."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from typing import Iterable, Optional

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_NAMES = ("127.0.0.1", "localhost")  # what `tandem up` dials


@dataclass(frozen=True)
class CertFiles:
    ca_file: str
    cert_file: str
    key_file: str

    def flags(self) -> list[str]:
        """The --tls-* flags every Tandem process of a deployment gets."""
        return ["--tls-ca-file", self.ca_file, "--tls-cert-file", self.cert_file, "--tls-key-file", self.key_file]


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(names: Iterable[str]) -> x509.SubjectAlternativeName:
    entries = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _certificate(subject: str, key, issuer: Optional[tuple], names: Iterable[str], days: int) -> x509.Certificate:
    """Self-signed CA when `issuer` is None, else a leaf signed by issuer = (ca certificate, ca key)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days)))
    if issuer is None:
        builder = (builder.issuer_name(name)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                content_commitment=False, key_encipherment=False,
                                                data_encipherment=False, key_agreement=False, encipher_only=False,
                                                decipher_only=False), critical=True))
        return builder.sign(key, hashes.SHA256())
    ca_cert, ca_key = issuer
    builder = (builder.issuer_name(ca_cert.subject)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(_san(names), critical=False)
               # One certificate per process serves as server (its gRPC port) and as client (its calls).
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                              critical=False))
    return builder.sign(ca_key, hashes.SHA256())


def _write(path: str, data: bytes, private: bool = False) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def make_ca(directory: str, prefix: str = "ca", days: int = 7) -> tuple[str, x509.Certificate, object]:
    """A CA certificate at DIR/PREFIX.crt (its key at DIR/PREFIX.key); returns (path, certificate, key)."""
    key = _key()
    cert = _certificate(f"tandem {prefix}", key, None, (), days)
    _write(os.path.join(directory, f"{prefix}.key"), _pem_key(key), private=True)
    return _write(os.path.join(directory, f"{prefix}.crt"), cert.public_bytes(serialization.Encoding.PEM)), cert, key


def make_leaf(directory: str, name: str, ca: tuple, names: Iterable[str] = DEFAULT_NAMES, days: int = 7) -> tuple[str, str]:
    """DIR/NAME.crt and DIR/NAME.key, signed by ca = (certificate, key), valid for `names` (IPs or DNS names)."""
    key = _key()
    cert = _certificate(f"tandem {name}", key, ca, names, days)
    return (_write(os.path.join(directory, f"{name}.crt"), cert.public_bytes(serialization.Encoding.PEM)),
            _write(os.path.join(directory, f"{name}.key"), _pem_key(key), private=True))


def make_self_signed(directory: str, name: str, names: Iterable[str] = DEFAULT_NAMES) -> tuple[str, str]:
    """A certificate no Tandem CA signed (its own CA): what an impostor server would hold."""
    _, cert, key = make_ca(directory, prefix=f"{name}-ca")
    return make_leaf(directory, name, (cert, key), names)


def make_deployment_certs(directory: str, names: Iterable[str] = DEFAULT_NAMES, days: int = 7) -> CertFiles:
    """A CA and one certificate for every process of a deployment (tls.crt/tls.key, as the chart's Secret)."""
    os.makedirs(directory, exist_ok=True)
    ca_file, ca_cert, ca_key = make_ca(directory, days=days)
    cert_file, key_file = make_leaf(directory, "tls", (ca_cert, ca_key), names, days)
    return CertFiles(ca_file, cert_file, key_file)
