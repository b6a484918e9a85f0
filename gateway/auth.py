"""API keys: loading (file or Kubernetes Secret), constant-time checking, never logging.

Key format (a file in static mode, or one item of a Secret in Kubernetes mode): one key per line, `KEY [TIER]`;
blank lines and lines starting with `#` are ignored; a key without a tier gets the gateway's default tier. Keys are
at least 8 printable non-space characters. The Secret form is a Secret whose `data` item (default `api-keys`)
holds exactly that text, so keys may contain any characters a Secret data name could not.

Checking hashes the presented key and compares it with `hmac.compare_digest` against the hash of every configured
key (no early exit), so the time taken reveals neither which key nor how much of one matched. Keys never appear in
logs, errors or metrics: a key is identified by `key_id`, the first 12 hex digits of its SHA-256.

Fail closed: a store with no key rejects every request; `unavailable` then says why (e.g. the Secret is missing),
which the app answers with 503 until keys arrive. Open mode (every request accepted at the default tier under one
shared identity, with a loud warning at start-up) exists only when asked for by name: `KeyStore.open`, reached from
`--insecure-open-mode` / `GatewaySettings.allow_open_mode`, which the chart never sets.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

OPEN_MODE_KEY_ID = "open"
_KEY_RE = re.compile(r"^[\x21-\x7e]{8,}$")


class KeyFileError(ValueError):
    """A key file or Secret is malformed; the message names the line, never the key."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a non-secret key identity and the key's tier."""

    key_id: str
    tier: str
    open_mode: bool = False


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def parse_keys(text: str, known_tiers: Collection[str], default_tier: str, source: str) -> dict[str, str]:
    """Parse `KEY [TIER]` lines into {key: tier}; errors name `source` and the line number only."""
    keys: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) > 2:
            raise KeyFileError(f"{source} line {lineno}: expected `KEY [TIER]`, found {len(fields)} fields")
        key = fields[0]
        tier = fields[1].lower() if len(fields) == 2 else default_tier
        if not _KEY_RE.match(key):
            raise KeyFileError(f"{source} line {lineno}: a key must be at least 8 printable non-space characters")
        if tier not in known_tiers:
            raise KeyFileError(
                f"{source} line {lineno}: unknown tier {tier!r} (known: {', '.join(sorted(known_tiers))})"
            )
        if key in keys:
            raise KeyFileError(f"{source} line {lineno}: this key is listed twice")
        keys[key] = tier
    return keys


def load_keys_file(path: Path, known_tiers: Collection[str], default_tier: str) -> dict[str, str]:
    try:
        text = path.read_text()
    except OSError as e:
        raise KeyFileError(f"cannot read API keys file {path}: {e.strerror}") from e
    return parse_keys(text, known_tiers, default_tier, str(path))


def keys_from_secret(
    secret: Mapping[str, object], item: str, known_tiers: Collection[str], default_tier: str
) -> dict[str, str]:
    """Keys from a Secret (as returned by the API: base64 `data`, or `stringData`)."""
    meta = secret.get("metadata") or {}
    name = meta.get("name", "?") if isinstance(meta, dict) else "?"
    source = f"Secret {name} item {item!r}"
    data = secret.get("data") or {}
    string_data = secret.get("stringData") or {}
    if isinstance(data, dict) and item in data:
        try:
            text = base64.b64decode(str(data[item]), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError) as e:
            raise KeyFileError(f"{source}: not base64-encoded UTF-8 text") from e
    elif isinstance(string_data, dict) and item in string_data:
        text = str(string_data[item])
    else:
        raise KeyFileError(f"{source}: the Secret has no such data item")
    return parse_keys(text, known_tiers, default_tier, source)


NO_KEYS = "no API keys are loaded"


class KeyStore:
    """The configured keys, checked in constant time. No keys means every request is refused (`unavailable` says
    why), unless the store was made with `KeyStore.open` (explicit open mode)."""

    def __init__(self, keys: Mapping[str, str], default_tier: str, unavailable: str = NO_KEYS) -> None:
        self._entries = [(hashlib.sha256(k.encode()).digest(), key_id(k), tier) for k, tier in keys.items()]
        self._default_tier = default_tier
        self._open = False
        self._unavailable = unavailable

    @classmethod
    def open(cls, default_tier: str) -> KeyStore:
        """Open mode: every caller is accepted at `default_tier` under one shared identity. Only for an explicit
        `--insecure-open-mode`."""
        store = cls({}, default_tier)
        store._open = True
        return store

    @property
    def open_mode(self) -> bool:
        return self._open

    @property
    def unavailable(self) -> str | None:
        """Why every request is refused (no key loaded and not open mode), else None."""
        return None if self._open or self._entries else self._unavailable

    def key_ids(self) -> set[str]:
        ids = {kid for _, kid, _ in self._entries}
        return ids | {OPEN_MODE_KEY_ID} if self._open else ids

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The caller behind an `Authorization: Bearer KEY` header, or None (-> 401; 503 while `unavailable`)."""
        if self._open:
            return Principal(OPEN_MODE_KEY_ID, self._default_tier, open_mode=True)
        if not authorization:
            return None
        scheme, _, presented = authorization.partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            return None
        digest = hashlib.sha256(presented.strip().encode()).digest()
        found: Principal | None = None
        for h, kid, tier in self._entries:
            if hmac.compare_digest(digest, h) and found is None:
                found = Principal(kid, tier)
        return found
