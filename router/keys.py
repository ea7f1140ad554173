"""Client API keys and the identity they authenticate: every key has an id (given by the
operator, or the key's fingerprint) and a cache namespace (its id, unless the operator names
keys that share one). Rate limits and any other per-client state are keyed on the id, never on
header text; the namespace salts the request's KV (``tenant_salt``), so one key's cached
prefixes are invisible to another's, in the cache map, the engines and the KV pool alike.

The secret itself never leaves this module: not in a salt, a log line or a metric."""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# a key id, a namespace: a short name (they end up in cache salts and metric labels)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_NAME = re.compile(NAME_PATTERN)
# a namespaced cache salt: this prefix, the namespace, then ':' and the client's own salt, if
# any (a namespace has no ':', so no client salt can pass for another namespace)
SALT_PREFIX = "kvroute-ns:"


def tenant_salt(namespace: str | None, cache_salt: str | None) -> str | None:
    """The cache salt a request's KV is hashed and stored under: the client's ``cache_salt``
    inside its key's ``namespace`` (None: no keys, the client's salt as it is)."""
    if namespace is None:
        return cache_salt
    return SALT_PREFIX + namespace + (f":{cache_salt}" if cache_salt is not None else "")


def fingerprint(secret: str) -> str:
    """The id of a key given without one: a one-way fingerprint (16 hex digits of SHA-256),
    stable across replicas and restarts and unrelated to the key's position in any list."""
    return "fp-" + hashlib.sha256(secret.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ApiKey:
    """One client key: ``id`` names the client (rate limits, logs), ``namespace`` its cache."""

    id: str
    secret: str = field(repr=False)
    namespace: str


def parse_key(entry: str) -> tuple[str, str]:
    """``(id, secret)`` of a configured key: ``"<id> <secret>"`` (whitespace between; a bearer
    token has none), or a bare ``"<secret>"``, whose id is its ``fingerprint``."""
    parts = entry.split()
    if len(parts) == 1:
        return fingerprint(parts[0]), parts[0]
    if len(parts) != 2 or not _NAME.match(parts[0]):
        raise ValueError(
            f"an API key entry is '<secret>' or '<id> <secret>' with an id matching "
            f"{NAME_PATTERN}; got one with {len(parts)} words (first: {parts[0][:24]!r}...)"
        )
    return parts[0], parts[1]


class ApiKeys:
    """The configured client keys. ``namespaces`` maps a namespace to the ids of the keys that
    share it; every other key is a namespace of its own, named by its id."""

    def __init__(
        self, entries: Iterable[str] = (), namespaces: Mapping[str, Iterable[str]] | None = None
    ) -> None:
        pairs = [parse_key(e) for e in entries if e.strip()]
        ids: dict[str, str] = {}
        for kid, secret in pairs:
            if ids.get(kid, secret) != secret:
                raise ValueError(f"API key id {kid!r} is given to two different keys")
            ids[kid] = secret
        shared: dict[str, str] = {}
        for ns, members in (namespaces or {}).items():
            if not _NAME.match(ns):
                raise ValueError(f"key namespace {ns!r} must match {NAME_PATTERN}")
            for kid in members:
                if kid not in ids:
                    raise ValueError(f"key namespace {ns!r}: no API key has the id {kid!r}")
                if shared.setdefault(kid, ns) != ns:
                    raise ValueError(
                        f"API key {kid!r} is in two namespaces: {shared[kid]!r}, {ns!r}"
                    )
        self._keys = tuple(ApiKey(kid, s, shared.get(kid, kid)) for kid, s in ids.items())

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def identify(self, token: str) -> ApiKey | None:
        """The key whose secret is ``token`` (every key compared, in constant time), or None."""
        found = None
        for k in self._keys:
            if secrets.compare_digest(token.encode(), k.secret.encode()):
                found = k
        return found

    @property
    def ids(self) -> list[str]:
        return [k.id for k in self._keys]
