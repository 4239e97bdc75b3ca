"""API keys and the tenants they name. `--api-keys-file PATH` maps each key to a tenant; `--api-key KEY` (or env
PDSERVE_API_KEY) is one key of the tenant `default`; neither: no key, and every request is of the tenant ''.

The file, one key a line: `TENANT: KEY`. Blank lines and lines starting with `#` are skipped; spaces around the
tenant and the key are ignored. A tenant is 1-64 of [A-Za-z0-9._-] (it names the prefix cache scope and appears in
logs); a key is 8-512 printable ASCII characters without spaces (it travels as `Bearer KEY`). A tenant may have
several keys (rotation); a key given twice is refused, even under the same tenant, so that no edit of the file can
leave a key meaning two things. Keys are never logged: a refusal names the line, not the key.
"""
from __future__ import annotations

import hashlib
import hmac
import re

DEFAULT_TENANT = "default"  # the tenant of the one --api-key / PDSERVE_API_KEY
NO_KEYS_TENANT = ""  # no key configured: one tenant for every caller
TENANT_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
KEY_RE = re.compile(r"[\x21-\x7e]{8,512}")


class KeysFileError(ValueError):
    pass


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class ApiKeys:
    """Who a `Bearer KEY` is. Looked up by the key's SHA-256, then compared in constant time: a dict lookup's
    timing depends only on a digest the caller cannot steer towards a real key, so it teaches nothing about one."""

    def __init__(self, tenants_by_key: dict[str, str]):
        if not tenants_by_key:
            raise ValueError("an empty set of API keys would let no caller in; configure none to need no key")
        self._by_digest: dict[bytes, tuple[bytes, str]] = {}
        for key, tenant in tenants_by_key.items():
            if not key:
                raise ValueError("an empty API key would let every caller in")
            expected = b"Bearer " + key.encode()
            self._by_digest[_digest(expected)] = (expected, tenant)
        self.tenants = sorted(set(tenants_by_key.values()))

    @classmethod
    def single(cls, key: str) -> "ApiKeys":
        return cls({key: DEFAULT_TENANT})

    @classmethod
    def from_file(cls, path: str) -> "ApiKeys":
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise KeysFileError(f"{path}: cannot read the API keys file: {e.strerror or e}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise KeysFileError(f"{path}: not UTF-8 (byte {e.start})") from None
        return cls(parse_keys(text, path))

    def tenant_of(self, authorization: bytes | str | None) -> str | None:
        """The tenant of one `authorization` value (`Bearer KEY`), or None for anything else."""
        if authorization is None:
            return None
        value = authorization if isinstance(authorization, bytes) else authorization.encode()
        hit = self._by_digest.get(_digest(value))
        if hit is None or not hmac.compare_digest(hit[0], value):
            return None
        return hit[1]

    def tenant_of_metadata(self, metadata) -> str | None:
        """Exactly one `authorization` entry, and it names a key: two entries could make a proxy and this check read
        different ones."""
        given = [value for key, value in metadata or () if key == "authorization"]
        return self.tenant_of(given[0]) if len(given) == 1 else None


def parse_keys(text: str, path: str = "<keys>") -> dict[str, str]:
    """key -> tenant from the file's text; every refusal names the file and the line."""
    out: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        tenant, sep, key = line.partition(":")
        tenant, key = tenant.strip(), key.strip()
        where = f"{path}:{n}"
        if not sep:
            raise KeysFileError(f"{where}: expected `TENANT: KEY`, found no ':'")
        if not TENANT_RE.fullmatch(tenant):
            raise KeysFileError(f"{where}: tenant {tenant[:80]!r} must be 1-64 characters of A-Z a-z 0-9 . _ -"
                                if tenant else f"{where}: empty tenant")
        if not key:
            raise KeysFileError(f"{where}: empty key for tenant {tenant!r}")
        if not KEY_RE.fullmatch(key):
            # the key itself is not shown: a near-miss of a real key is still a secret
            raise KeysFileError(f"{where}: the key of tenant {tenant!r} must be 8-512 printable ASCII characters "
                                f"without spaces; it has {len(key)} characters")
        if key in out:
            raise KeysFileError(f"{where}: the key of tenant {tenant!r} is the key of line {first_line[key]} "
                                f"(tenant {out[key]!r}) again; each key names one tenant")
        out[key] = tenant
        first_line[key] = n
    if not out:
        raise KeysFileError(f"{path}: no keys (expected lines `TENANT: KEY`); an empty file would let no one in")
    return out
