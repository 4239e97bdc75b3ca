"""The dev PKI and the start-up TLS flags: what a certificate says, who may read a key, when a service refuses."""
import argparse
import os
import stat

import pytest
from cryptography import x509

from pdserve.common.pki import common_name, files_for, make_pki
from pdserve.common.tls import add_tls_args, tls_from_args


def _sans(path: str) -> set[str]:
    with open(path, "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(v) for v in ext.get_values_for_type(x509.DNSName)} | \
        {str(v) for v in ext.get_values_for_type(x509.IPAddress)}


def test_each_identity_gets_its_cn_its_roles_name_and_private_keys(tmp_path):
    files = make_pki(str(tmp_path), ["decode/d0", "broker/b0"], extra_dns=("pdserve-decode.ns.svc",))
    with open(files["decode/d0"].cert, "rb") as f:
        assert common_name(f.read()) == "decode/d0"
    assert _sans(files["decode/d0"].cert) == {"localhost", "pdserve-decode", "pdserve-decode.ns.svc", "127.0.0.1"}
    assert "pdserve-broker" not in _sans(files["decode/d0"].cert)  # a decode key cannot pose as the broker
    for path in (files["decode/d0"].key, str(tmp_path / "ca.key")):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_second_run_reuses_the_ca(tmp_path):
    make_pki(str(tmp_path), ["decode/d0"])
    ca = (tmp_path / "ca.crt").read_bytes()
    later = make_pki(str(tmp_path), ["prefill/p0"])["prefill/p0"]
    assert (tmp_path / "ca.crt").read_bytes() == ca and later.ca == str(tmp_path / "ca.crt")


def test_make_pki_refuses_a_malformed_identity(tmp_path):
    with pytest.raises(ValueError, match="ROLE/NAME"):
        make_pki(str(tmp_path), ["admin"])
    assert not os.path.exists(files_for(str(tmp_path), "admin").cert)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_tls_args(p)
    return p.parse_args(argv)


def test_flags_missing_insecure_wrong_role_and_ok(tmp_path, monkeypatch):
    for var in ("PDSERVE_TLS_CERT", "PDSERVE_TLS_KEY", "PDSERVE_TLS_CA"):
        monkeypatch.delenv(var, raising=False)
    f = make_pki(str(tmp_path), ["prefill/p0"])["prefill/p0"]
    with pytest.raises(SystemExit, match="missing --tls-key .*--tls-ca .*--insecure"):
        tls_from_args(_args("--tls-cert", f.cert), "prefill", "prefill")
    assert tls_from_args(_args("--insecure"), "prefill", "prefill") is None
    with pytest.raises(SystemExit, match="choose one"):
        tls_from_args(_args("--insecure", "--tls-cert", f.cert), "prefill", "prefill")
    full = ("--tls-cert", f.cert, "--tls-key", f.key, "--tls-ca", f.ca)
    with pytest.raises(SystemExit, match="'prefill/p0' has role 'prefill'; a decode needs a decode/NAME"):
        tls_from_args(_args(*full), "decode", "decode")
    assert tls_from_args(_args(*full), "prefill", "prefill").identity == "prefill/p0"
    with pytest.raises(SystemExit, match="cannot read TLS key"):
        tls_from_args(_args("--tls-cert", f.cert, "--tls-key", str(tmp_path / "nope"), "--tls-ca", f.ca),
                      "prefill", "prefill")


def test_environment_supplies_the_defaults(tmp_path, monkeypatch):
    f = make_pki(str(tmp_path), ["gateway/g0"])["gateway/g0"]
    monkeypatch.setenv("PDSERVE_TLS_CERT", f.cert)
    monkeypatch.setenv("PDSERVE_TLS_KEY", f.key)
    monkeypatch.setenv("PDSERVE_TLS_CA", f.ca)
    assert tls_from_args(_args(), "gateway", "gateway").identity == "gateway/g0"
