"""Certificates for tests of worlds keyed by certificates (``RPCX_TLS_*``).

:func:`make_site` writes a CA and certificates it signs into a directory, as a site's
PKI would hand them out; tests take a second site for "a certificate from another CA".
Needs the ``cryptography`` package (the ``encrypt`` extra).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Site", "make_site"]


@dataclass(frozen=True)
class Site:
    """A CA's certificate and the certificates it issued, as PEM files in ``directory``."""

    directory: Path
    ca: Path

    def worker(self, name: str) -> dict[str, str]:
        """The ``RPCX_TLS_*`` variables of worker ``name`` (issued by :func:`make_site`)."""
        return {"RPCX_TLS_CA": str(self.ca),
                "RPCX_TLS_CERT": str(self.directory / f"{name}.crt"),
                "RPCX_TLS_KEY": str(self.directory / f"{name}.key")}


def make_site(directory: str | os.PathLike[str], names: list[str], ca_name: str = "rpcx test CA",
              parent: Site | None = None) -> Site:
    """A new CA in ``directory`` and a certificate it signs for each of ``names`` (EC
    P-256 keys; valid from a day ago for a day). ``parent``: the CA is an intermediate
    that ``parent``'s CA signs (each worker's certificate file then holds the chain up
    to it, as sites hand them out)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    signer_key: Any = ca_key
    issuer = ca_subject
    if parent is not None:
        signer_key = serialization.load_pem_private_key(
            (parent.directory / "ca.key").read_bytes(), None)
        issuer = x509.load_pem_x509_certificate(parent.ca.read_bytes()).subject
    ca = (x509.CertificateBuilder()
          .subject_name(ca_subject).issuer_name(issuer)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None if parent is None
                                               else 0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                       crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False,
                                       decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(signer_key, hashes.SHA256()))
    ca_path = root / "ca.crt"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (root / "ca.key").write_bytes(ca_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    (root / "ca.key").chmod(0o600)
    chain = ca.public_bytes(serialization.Encoding.PEM) if parent is not None else b""
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        certificate = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
        (root / f"{name}.crt").write_bytes(
            certificate.public_bytes(serialization.Encoding.PEM) + chain)
        key_path = root / f"{name}.key"
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        key_path.chmod(0o600)
    return Site(directory=root, ca=ca_path)
