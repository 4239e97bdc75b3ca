"""A throwaway development PKI: one CA and one certificate per identity, as PEM files in one directory.

`make run`, the launcher and the tests make one per stack so the default path always runs mutual TLS.
A production deployment brings its own CA (deploy/k8s gives every pod its own certificate, CN ROLE/POD_NAME,
through cert-manager's csi-driver); nothing here is meant to protect keys at rest beyond file modes.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import re
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLES = ("broker", "prefill", "decode", "gateway", "operator")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_VALID_DAYS = 365


def parse_identity(cn: str) -> tuple[str, str]:
    """'decode/d0' -> ('decode', 'd0'); raises ValueError naming what is wrong."""
    role, sep, name = cn.partition("/")
    if not sep or role not in ROLES or not _NAME.match(name):
        raise ValueError(f"identity {cn!r} is not ROLE/NAME with ROLE one of {', '.join(ROLES)} and NAME "
                         f"matching {_NAME.pattern}")
    return role, name


@dataclass(frozen=True, slots=True)
class CertFiles:
    cert: str
    key: str
    ca: str


def files_for(out_dir: str, identity: str) -> CertFiles:
    stem = identity.replace("/", "-")
    return CertFiles(os.path.join(out_dir, f"{stem}.crt"), os.path.join(out_dir, f"{stem}.key"),
                     os.path.join(out_dir, "ca.crt"))


def _write(path: str, data: bytes, private: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    # an hour back: a host whose clock is a little behind the one that made the files still accepts them
    return builder.not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(
        now + datetime.timedelta(days=_VALID_DAYS))


def _load_or_make_ca(out_dir: str):
    crt, key = os.path.join(out_dir, "ca.crt"), os.path.join(out_dir, "ca.key")
    if os.path.exists(crt) and os.path.exists(key):
        with open(crt, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
        with open(key, "rb") as f:
            return cert, serialization.load_pem_private_key(f.read(), None)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve dev CA")])
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(ca_key.public_key())
               .serial_number(x509.random_serial_number())
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, encipher_only=False,
                                            decipher_only=False), critical=True))
    cert = _validity(builder).sign(ca_key, hashes.SHA256())
    _write(key, _key_pem(ca_key), private=True)
    _write(crt, cert.public_bytes(serialization.Encoding.PEM))
    return cert, ca_key


def issue(out_dir: str, identity: str, extra_dns: tuple[str, ...] = ()) -> CertFiles:
    """Signs one certificate with CN=identity (not checked here, so tests can make malformed ones).
    SANs: localhost and 127.0.0.1 for a local stack, and pdserve-<role>, the Service name a cluster
    dials; a certificate names only its own role's Service, so a decode key cannot pose as the broker."""
    os.makedirs(out_dir, exist_ok=True)
    ca_cert, ca_key = _load_or_make_ca(out_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    role = identity.partition("/")[0]
    dns = ["localhost", *([f"pdserve-{role}"] if role in ROLES else []), *extra_dns]
    sans = [x509.DNSName(d) for d in dict.fromkeys(dns)] + [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity)]))
               .issuer_name(ca_cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.SubjectAlternativeName(sans), critical=False)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                     ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    cert = _validity(builder).sign(ca_key, hashes.SHA256())
    files = files_for(out_dir, identity)
    _write(files.key, _key_pem(key), private=True)
    _write(files.cert, cert.public_bytes(serialization.Encoding.PEM))
    return files


def make_pki(out_dir: str, identities: list[str], extra_dns: tuple[str, ...] = ()) -> dict[str, CertFiles]:
    """A CA (reused when out_dir already has one) and a certificate per identity; identities are checked."""
    for identity in identities:
        parse_identity(identity)
    return {identity: issue(out_dir, identity, extra_dns) for identity in identities}


def common_name(cert_pem: bytes) -> str:
    cert = x509.load_pem_x509_certificate(cert_pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names:
        raise ValueError("certificate has no Common Name (the identity is ROLE/NAME in the CN)")
    return str(names[0].value)
