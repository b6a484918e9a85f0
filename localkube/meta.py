"""Small helpers about object metadata: time stamps, deep copies, names, labels and human durations.

Kept apart so the store, the strategies and the kubelet agree on one rendering of time and one set of name rules.
"""

from __future__ import annotations

import datetime as dt
import re
import secrets

from localkube.errors import Cause, invalid_value

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
TOTAL_ANNOTATION_LIMIT = 256 * 1024


def clone(value):
    """A fast deep copy for JSON data (dicts, lists and scalars)."""
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clone(v) for v in value]
    return value


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def rfc3339(when: dt.datetime | None = None) -> str:
    """A ``metav1.Time`` string: RFC 3339 with second precision, as the API server writes it."""
    return (when or utcnow()).astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> dt.datetime | None:
    if not text or not isinstance(text, str):
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def human_duration(seconds: float) -> str:
    """Go's ``duration.HumanDuration``: what ``kubectl get`` prints in the AGE column."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        rem = s % 60
        return f"{minutes}m{rem}s" if rem else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        rem = (s % 3600) // 60
        return f"{hours}h{rem}m" if rem else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        rem = hours % 24
        return f"{hours // 24}d{rem}h" if rem else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = hours // 24
        rem = days % 365
        return f"{days // 365}y{rem}d" if rem else f"{days // 365}y"
    return f"{hours // 24 // 365}y"


def age(timestamp: str | None, now: dt.datetime | None = None) -> str:
    when = parse_time(timestamp)
    if when is None:
        return "<unknown>"
    return human_duration(((now or utcnow()) - when).total_seconds())


def generate_suffix(length: int = 5) -> str:
    return "".join(secrets.choice(_GENERATE_ALPHABET) for _ in range(length))


def validate_dns_subdomain(path: str, value: str) -> list[Cause]:
    if len(value) > 253:
        return [invalid_value(path, value, "must be no more than 253 characters")]
    if not _DNS1123_SUBDOMAIN.match(value):
        return [
            invalid_value(
                path,
                value,
                "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
                "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation "
                "is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')",
            )
        ]
    return []


def validate_dns_label(path: str, value: str) -> list[Cause]:
    if len(value) > 63:
        return [invalid_value(path, value, "must be no more than 63 characters")]
    if not _DNS1123_LABEL.match(value):
        return [
            invalid_value(
                path,
                value,
                "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start "
                "and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
                "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')",
            )
        ]
    return []


def validate_dns1035_label(path: str, value: str) -> list[Cause]:
    if len(value) > 63:
        return [invalid_value(path, value, "must be no more than 63 characters")]
    if not _DNS1035_LABEL.match(value):
        return [
            invalid_value(
                path,
                value,
                "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
                "character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for "
                "validation is '[a-z]([-a-z0-9]*[a-z0-9])?')",
            )
        ]
    return []


def validate_qualified_name(path: str, key: str) -> list[Cause]:
    """Label and annotation keys: an optional DNS subdomain prefix and a name of at most 63 characters."""
    prefix, _, name = key.rpartition("/")
    causes: list[Cause] = []
    if "/" in key and not prefix:
        causes.append(invalid_value(path, key, "prefix part must be non-empty"))
    elif prefix and validate_dns_subdomain(path, prefix):
        causes.append(invalid_value(path, key, "prefix part must be a lowercase RFC 1123 subdomain"))
    if not name or len(name) > 63 or not _QUALIFIED_NAME.match(name):
        causes.append(
            invalid_value(
                path,
                key,
                "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
                "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]') and must be no more than 63 characters",
            )
        )
    return causes


def validate_labels(path: str, labels: object) -> list[Cause]:
    if labels is None:
        return []
    if not isinstance(labels, dict):
        return [invalid_value(path, labels, "must be a map of strings")]
    causes: list[Cause] = []
    for key, value in labels.items():
        causes += validate_qualified_name(path, key)
        if not isinstance(value, str):
            causes.append(invalid_value(f"{path}", value, "label values must be strings"))
        elif len(value) > 63 or not _LABEL_VALUE.match(value):
            causes.append(
                invalid_value(
                    path,
                    value,
                    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and "
                    "must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', "
                    "regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?') and must be no more "
                    "than 63 characters",
                )
            )
    return causes


def validate_annotations(path: str, annotations: object) -> list[Cause]:
    if annotations is None:
        return []
    if not isinstance(annotations, dict):
        return [invalid_value(path, annotations, "must be a map of strings")]
    causes: list[Cause] = []
    total = 0
    for key, value in annotations.items():
        causes += validate_qualified_name(path, key.lower())
        if not isinstance(value, str):
            causes.append(invalid_value(path, value, "annotation values must be strings"))
            continue
        total += len(key) + len(value.encode())
    if total > TOTAL_ANNOTATION_LIMIT:
        causes.append(Cause(path, "FieldValueTooLong", f"Too long: must have at most {TOTAL_ANNOTATION_LIMIT} bytes"))
    return causes
