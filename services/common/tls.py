"""Mutual TLS between the internal services: flags, credentials, and the one way to open a channel.

Every internal server demands a client certificate signed by the CA (require_client_auth), and every
internal client presents its own; the certificate's Common Name is the caller's identity (ROLE/NAME,
see pki.py), which authz.py checks per method. Without certificates a service refuses to start unless
--insecure is given, and then it says so loudly: there is no identity, so no authorisation either.
"""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, field

import grpc

from .pki import common_name, parse_identity

log = logging.getLogger(__name__)

ENV = {"cert": "PDSERVE_TLS_CERT", "key": "PDSERVE_TLS_KEY", "ca": "PDSERVE_TLS_CA"}


@dataclass(slots=True)
class TlsConfig:
    cert_path: str
    key_path: str
    ca_path: str
    cert: bytes = field(init=False, repr=False)
    key: bytes = field(init=False, repr=False)
    ca: bytes = field(init=False, repr=False)
    identity: str = field(init=False)
    role: str = field(init=False)

    def __post_init__(self):
        def read(path: str, what: str) -> bytes:
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as e:
                raise ValueError(f"cannot read TLS {what} {path!r}: {e.strerror}") from None
        self.cert, self.key, self.ca = read(self.cert_path, "cert"), read(self.key_path, "key"), read(self.ca_path, "CA")
        self.identity = common_name(self.cert)
        self.role = self.identity.partition("/")[0]  # checked by tls_from_args: tests present malformed ones

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def secure_channel(target: str, tls: TlsConfig | None, options=None, aio: bool = True,
                   server_name: str | None = None):
    """A channel to an internal service, presenting this process's certificate. tls=None only ever
    comes from an explicit --insecure (logged at start-up), never from missing files. server_name: the
    name the server's certificate must carry when target is an address (a pod IP found by discovery
    carries none of its own; the certificate names the role's Service)."""
    grpc_mod = grpc.aio if aio else grpc
    if tls is None:
        return grpc_mod.insecure_channel(target, options=options)
    if server_name:
        options = [*(options or []), ("grpc.ssl_target_name_override", server_name)]
    return grpc_mod.secure_channel(target, tls.channel_credentials(), options=options)


def add_tls_args(p: argparse.ArgumentParser, what: str = "this service's server and its client channels") -> None:
    g = p.add_argument_group("mutual TLS", f"certificates for {what}; `pdserve make-certs` writes a dev set")
    g.add_argument("--tls-cert", default=os.environ.get(ENV["cert"]),
                   help=f"PEM certificate whose CN is ROLE/NAME (env {ENV['cert']})")
    g.add_argument("--tls-key", default=os.environ.get(ENV["key"]), help=f"PEM private key (env {ENV['key']})")
    g.add_argument("--tls-ca", default=os.environ.get(ENV["ca"]), help=f"PEM CA certificate (env {ENV['ca']})")
    g.add_argument("--insecure", action="store_true",
                   help="UNSAFE: plaintext, no peer identity and no authorisation; any pod can Revoke, Grant, "
                        "BeginWrite. Only for debugging on a closed host")


def tls_from_args(args: argparse.Namespace, service: str, role: str) -> TlsConfig | None:
    """The service's TLS config, or None under --insecure; exits with a clear message otherwise."""
    given = [v for v in (args.tls_cert, args.tls_key, args.tls_ca) if v]
    if args.insecure:
        if given:
            raise SystemExit(f"{service}: --insecure together with --tls-* (or {', '.join(ENV.values())} in the "
                             "environment): choose one")
        # unsafe mode: insecure
        log.error("%s: INSECURE MODE (--insecure): plaintext gRPC, no peer identity, NO AUTHORISATION; any "
                  "process that can reach this port may call every method. Never use this in a deployment.",
                  service)
        return None
    if len(given) != 3:
        missing = [f"--tls-{k} (or {v})" for k, v in ENV.items() if not getattr(args, f"tls_{k}")]
        raise SystemExit(f"{service}: mutual TLS needs a certificate, key and CA; missing {', '.join(missing)}. "
                         "Make a dev set with `pdserve make-certs --out DIR`, or pass --insecure --allow-unsafe insecure "
                         "(unsafe: no authentication, no authorisation)")
    try:
        tls = TlsConfig(args.tls_cert, args.tls_key, args.tls_ca)
        parse_identity(tls.identity)
    except ValueError as e:
        raise SystemExit(f"{service}: {e}") from None
    if tls.role != role:
        raise SystemExit(f"{service}: certificate identity {tls.identity!r} has role {tls.role!r}; a {service} "
                         f"needs a {role}/NAME certificate")
    log.info("%s: mutual TLS as %s", service, tls.identity)
    return tls


def own_identity(tls: TlsConfig | None, role: str) -> str:
    """The prefix of every pool or writer id this process names: ROLE/NAME from its certificate, or
    ROLE/insecure when it runs without one (the broker checks nothing then)."""
    return tls.identity if tls is not None else f"{role}/insecure"
