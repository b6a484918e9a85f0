"""Drain tokens derived from the operator's key: stable per deployment, different across deployments and keys."""

from __future__ import annotations

import pytest

from controllers.drain_token import deployment_drain_token, drain_token

KEY = b"k" * 32


def test_the_same_deployment_always_gets_the_same_token():
    assert drain_token(KEY, "ns", "m", "uid-1") == drain_token(KEY, "ns", "m", "uid-1")
    assert len(drain_token(KEY, "ns", "m", "uid-1")) == 43  # 256 bits, URL-safe base64 without padding


@pytest.mark.parametrize(
    "other",
    [
        (KEY, "ns2", "m", "uid-1"),  # another namespace
        (KEY, "ns", "m2", "uid-1"),  # another deployment
        (KEY, "ns", "m", "uid-2"),  # the same name deleted and created again
        (b"j" * 32, "ns", "m", "uid-1"),  # a rotated key
    ],
)
def test_tokens_differ_per_deployment_incarnation_and_key(other):
    assert drain_token(*other) != drain_token(KEY, "ns", "m", "uid-1")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((b"short", "ns", "m", "u"), "at least 32"),
        ((KEY, "", "m", "u"), "namespace, name and uid"),
        ((KEY, "ns", "m", ""), "namespace, name and uid"),
    ],
)
def test_weak_keys_and_missing_identity_are_refused(args, needle):
    with pytest.raises(ValueError, match=needle):
        drain_token(*args)


def test_no_key_means_no_token():
    meta = {"name": "m", "namespace": "ns", "uid": "uid-1"}
    assert deployment_drain_token(None, meta) is None
    assert deployment_drain_token(KEY, meta) == drain_token(KEY, "ns", "m", "uid-1")
