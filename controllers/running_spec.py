"""Which spec the fleet runs: the resource's own when it is valid, else the last valid one, kept in status.

Why: an edit can pass the CRD schema and still be wrong in ways only `crds.validate` sees (a cross-field rule, a
step list that does not end at 100, chunked prefill off with a token budget below the context). Such an edit must
not freeze the fleet: like a Deployment whose new template was never accepted, the last accepted spec keeps being
maintained (failed pods are replaced, the autoscaler and a running canary go on), while the InvalidSpec condition
and a Warning Event say what is wrong and how to fix it. The reconciler records every valid spec it acts on in
`status.lastValidSpec`; a deployment that was never valid has nothing to fall back to and nothing runs.

A pass reads the resource once (`DeploymentView.of`): its status as last written (empty when this version cannot
read it) and, on first use, the spec it runs. The reconcile pass hands the same view to the canary analysis and to
the planner, and the autoscaler reads its spec and state from one; nobody parses a CR on their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pydantic import ValidationError

from crds.helpers import parse_spec, parse_status
from crds.models import InferenceDeploymentSpec, InferenceDeploymentStatus
from crds.validate import validate


@dataclass(frozen=True)
class RunningSpec:
    """The spec to act on (None: nothing valid to run) and the problems of the resource's own spec."""

    spec: InferenceDeploymentSpec | None
    problems: tuple[str, ...] = ()
    raw: Mapping[str, Any] | None = None  # the valid spec as stored (what `status.lastValidSpec` becomes)

    @property
    def valid(self) -> bool:
        """The resource's own spec is valid (and is the one returned)."""
        return not self.problems

    @property
    def fallback(self) -> bool:
        """The resource's spec is invalid and the last valid one runs instead."""
        return bool(self.problems) and self.spec is not None


def running_spec(raw_spec: Any, last_valid: Mapping[str, Any] | None) -> RunningSpec:
    """The spec the fleet should run given the resource's `spec` and its `status.lastValidSpec`."""
    problems = tuple(str(p) for p in validate(raw_spec))
    if not problems:
        return RunningSpec(parse_spec(raw_spec), (), raw_spec)
    if last_valid is None or validate(last_valid):  # an older operator's spec may no longer validate: no fallback
        return RunningSpec(None, problems)
    return RunningSpec(parse_spec(last_valid), problems, last_valid)


@dataclass(frozen=True)
class DeploymentView:
    """One InferenceDeployment as read once per pass: metadata, the spec as written, the status as last written
    (`status_readable` False: this version cannot read it, and `status` is empty: it is recomputed), and the spec
    the fleet runs (`running`, computed on first use: a deployment being deleted never needs it)."""

    meta: Mapping[str, Any]
    raw_spec: Any
    status: InferenceDeploymentStatus
    status_readable: bool = True

    @classmethod
    def of(cls, resource: Mapping[str, Any] | DeploymentView) -> DeploymentView:
        """The view of a resource (a dict as the API returns it); a view is returned as it is."""
        if isinstance(resource, DeploymentView):
            return resource
        raw = resource.get("status")
        try:
            status, readable = parse_status(raw if isinstance(raw, Mapping) else None), True
        except ValidationError:
            status, readable = InferenceDeploymentStatus(), False
        return cls(resource.get("metadata") or {}, resource.get("spec"), status, readable)

    @property
    def deleting(self) -> bool:
        """metadata.deletionTimestamp is set."""
        return bool(self.meta.get("deletionTimestamp"))

    @cached_property
    def running(self) -> RunningSpec:
        """The spec to act on: the resource's own when valid, else `status.lastValidSpec` (see `running_spec`)."""
        return running_spec(self.raw_spec, self.status.last_valid_spec)
