"""Which pod goes first when pods must be removed: unready, then old revision, then least in flight, then youngest.

Why this order: an unready pod serves nothing, so removing it costs no capacity; a pod of an old revision is going
away anyway; among the rest, the pod with the fewest requests in flight drains fastest and disturbs the fewest
streams (unknown in-flight counts as zero: the order then falls back to age); the youngest pod has the coldest
prefix cache and is the least proven. Ties end on the name so the order is total and repeatable.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from datetime import datetime

from controllers.observed import PodInfo


def deletion_order(pods: Iterable[PodInfo], current: str | Collection[str] | None) -> list[PodInfo]:
    """`pods` sorted so that the first is the best one to remove. `current` is the revision (or, during a
    canary, the revisions) the variant keeps; any other revision is old."""
    keep = {current} if isinstance(current, str) or current is None else set(current)
    return sorted(pods, key=lambda pod: _key(pod, keep))


def _key(pod: PodInfo, keep: Collection[str | None]) -> tuple[bool, bool, int, float, str]:
    created = pod.created_at.timestamp() if isinstance(pod.created_at, datetime) else float("inf")
    return (
        pod.ready,  # unready (False) first
        pod.revision in keep,  # old revision (False) first
        pod.in_flight or 0,  # least in flight first
        -created,  # youngest (latest creation) first; unknown creation time counts as youngest
        pod.name,
    )
