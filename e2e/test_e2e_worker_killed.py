"""A worker process SIGKILLed mid-load is replaced, and requests that had not started are retried by the gateway.

Two fake-engine pods serve 4 concurrent client streams through the gateway. One pod's worker process is killed
(SIGKILL: no drain, no goodbye). Streams it was serving break mid-stream (nothing can save a started stream), but
no request fails before its first byte: the gateway retries connection failures on the other pod. The kubelet
restarts the container, the pod is Ready again, and both pods serve afterwards.
"""

from __future__ import annotations

import os
import re
import signal
import time

import httpx

from llmfleet.traffic import StreamLoad

WORKERS = 4


def _pid(pod: dict) -> int:
    (status,) = pod["status"]["containerStatuses"]
    return int(status["containerID"].rsplit("-", 1)[1])


def _restarts(pod: dict) -> int:
    return sum(int(c.get("restartCount") or 0) for c in pod["status"].get("containerStatuses") or [])


def _gateway_retries(metrics_url: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    return sum(float(v) for v in re.findall(r"^llmfleet_gateway_retries_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def test_killed_worker_is_replaced_and_unstarted_requests_are_retried(scene, fleet, figures) -> None:
    scene.apply(scene.deployment("victim", replicas=2))
    scene.wait_until(lambda: scene.settled("victim", 2), "2 ready pods", timeout_s=90)
    retries_before = _gateway_retries(fleet.gateway_metrics_url)
    with StreamLoad(fleet.gateway_url, fleet.api_key, "victim", workers=WORKERS, deadline_s=150) as load:
        scene.wait_until(lambda: load.completed >= 10, "streams through the gateway", timeout_s=60)
        target = sorted(scene.ready_pods("victim"), key=lambda p: p["metadata"]["name"])[0]
        name, restarts = target["metadata"]["name"], _restarts(target)
        killed_at = time.monotonic()
        os.kill(_pid(target), signal.SIGKILL)
        sent_before = len(load.snapshot())
        back = scene.wait_until(
            lambda: next(
                (p for p in scene.ready_pods("victim") if p["metadata"]["name"] == name and _restarts(p) > restarts),
                None,
            ),
            "the killed pod restarted and Ready",
            timeout_s=60,
        )
        replaced_s = time.monotonic() - killed_at
        scene.wait_until(lambda: len(scene.ready_pods("victim")) == 2, "both pods ready", timeout_s=30)
        recovered_at = time.monotonic()
        scene.wait_until(
            lambda: sum(o.ok and o.started > recovered_at for o in load.snapshot()) >= 20,
            "20 streams after the restart",
            timeout_s=60,
        )
    outcomes = load.snapshot()
    before_first_byte = [o for o in outcomes if o.kind == "before_first_byte"]
    mid_stream = [o for o in outcomes if o.kind == "mid_stream"]
    assert before_first_byte == [], f"requests failed before their first byte: {before_first_byte[:3]}"
    assert len(mid_stream) <= WORKERS, f"more broken streams than were in flight: {mid_stream[:3]}"
    assert all(o.started <= killed_at for o in mid_stream), "a stream sent after the kill broke"
    assert _restarts(back) == restarts + 1
    figures(
        f"pod {name} restarted and Ready {replaced_s:.1f} s after SIGKILL; {load.summary()}; "
        f"{len(mid_stream)} stream(s) in flight on it broke ({sent_before} done before the kill); gateway "
        f"retries +{_gateway_retries(fleet.gateway_metrics_url) - retries_before:.0f}"
    )
