"""Routing decisions as tables: model resolution (variants and LoRA adapters), variants by weight/tier/suffix,
canary revisions, pods by least outstanding with prefix affinity and a bounded-load cap, adapter requests only to
pods with the adapter Loaded."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from gateway.routing import (
    AdapterRoute,
    DeploymentRoute,
    Endpoint,
    RevisionRoute,
    RoutingError,
    RoutingTable,
    VariantRoute,
    adapter_endpoints,
    adapter_not_ready,
    affinity_key,
    choose_endpoint,
    choose_revision,
    choose_variant,
    load_cap,
    prompt_text,
    rendezvous_order,
    resolve_model,
    weighted_choice,
)


def eps(variant: str, revision: str, *names: str) -> tuple[Endpoint, ...]:
    return tuple(Endpoint(url=f"http://{n}:8000", name=n, variant=variant, revision=revision) for n in names)


def variant(name: str, weight: float, *revs: RevisionRoute, tiers: tuple[str, ...] = ()) -> VariantRoute:
    return VariantRoute(name=name, weight=weight, tiers=frozenset(tiers), revisions=revs)


FULL = variant(
    "full", 3, RevisionRoute("r1", 90, eps("full", "r1", "f1", "f2")), RevisionRoute("r2", 10, eps("full", "r2", "f3"))
)
INT4 = variant("int4", 1, RevisionRoute("r1", 1, eps("int4", "r1", "q1")))
BATCH = variant("batch", 0, RevisionRoute("r1", 1, eps("batch", "r1", "b1")), tiers=("batch",))
COLD = variant("cold", 1, RevisionRoute("r1", 1, ()))
DEP = DeploymentRoute(model="smollm2", name="smollm2", namespace="ns", variants=(FULL, INT4, BATCH))
TABLE = RoutingTable({"smollm2": DEP, "odd:name": DeploymentRoute(model="odd:name", name="odd")})


SQL = AdapterRoute("sql", source="/adapters/sql", tokens_per_minute=1000, pods=frozenset({"f1", "q1"}))
POET = AdapterRoute("poet", source="hf://org/poet", pods=frozenset({"f3"}))
# smollm2 declares sql, poet and an adapter named like the model `llama`; llama declares sql too (ambiguous bare name)
A_DEP = DeploymentRoute(
    model="smollm2",
    name="smollm2",
    namespace="ns",
    variants=(FULL, INT4, BATCH),
    adapters={"sql": SQL, "poet": POET, "llama": AdapterRoute("llama")},
)
LLAMA = DeploymentRoute(
    model="llama", name="llama", namespace="other", adapters={"sql": AdapterRoute("sql"), "chat": AdapterRoute("chat")}
)
A_TABLE = RoutingTable({"smollm2": A_DEP, "llama": LLAMA, "odd:name": DeploymentRoute(model="odd:name", name="odd")})


@pytest.mark.parametrize(
    ("table", "model", "dep", "suffix", "adapter"),
    [
        (TABLE, "smollm2", "smollm2", None, None),
        (TABLE, "smollm2:int4", "smollm2", "int4", None),
        (TABLE, "smollm2:batch", "smollm2", "batch", None),
        (TABLE, "odd:name", "odd", None, None),  # an exact name wins over splitting at ':'
        (A_TABLE, "smollm2", "smollm2", None, None),
        (A_TABLE, "smollm2:int4", "smollm2", "int4", None),
        (A_TABLE, "smollm2:sql", "smollm2", None, "sql"),  # MODEL:ADAPTER
        (A_TABLE, "llama:sql", "llama", None, "sql"),  # the same adapter name in another model
        (A_TABLE, "poet", "smollm2", None, "poet"),  # an adapter's own name, declared by one model
        (A_TABLE, "chat", "llama", None, "chat"),
        (A_TABLE, "llama", "llama", None, None),  # a model name wins over an adapter name
        (A_TABLE, "smollm2:llama", "smollm2", None, "llama"),  # ... which MODEL:ADAPTER still reaches
        (A_TABLE, "odd:name", "odd", None, None),
    ],
)
def test_resolve_model(table: RoutingTable, model: str, dep: str, suffix: str | None, adapter: str | None) -> None:
    got = resolve_model(table, model)
    assert (got.dep.name, got.variant, got.adapter.name if got.adapter else None) == (dep, suffix, adapter)
    if adapter is not None:
        assert got.adapter is got.dep.adapters[adapter]


@pytest.mark.parametrize(
    ("table", "model", "message"),
    [
        (TABLE, "llama", "does not exist"),
        (TABLE, "smollm2:fp8", "no variant or adapter 'fp8'"),
        (TABLE, ":int4", "does not exist"),
        (TABLE, "smollm2:", "does not exist"),
        (TABLE, "", "does not exist"),
        (A_TABLE, "smollm2:nope", "(variants: full, int4, batch; adapters: llama, poet, sql)"),  # unknown adapter
        (A_TABLE, "nope", "does not exist"),
        (A_TABLE, "llama:poet", "no variant or adapter 'poet'"),  # poet is smollm2's, not llama's
        (A_TABLE, "odd:sql", "does not exist"),  # `odd` serves nothing: odd:name is the model
        # a bare name two models declare is ambiguous: it says how to choose
        (A_TABLE, "sql", "the adapter name 'sql' is ambiguous: models llama, smollm2 each declare it"),
        (A_TABLE, "sql", "send model MODEL:ADAPTER (llama:sql, smollm2:sql)"),
    ],
)
def test_resolve_unknown_model_is_404(table: RoutingTable, model: str, message: str) -> None:
    with pytest.raises(RoutingError) as e:
        resolve_model(table, model)
    assert (e.value.status, e.value.code) == (404, "model_not_found")
    assert message in e.value.message


def test_adapter_entries_name_adapters_as_resolve_model_reads_them() -> None:
    entries = [(name, dep.model, a.name) for name, dep, a in A_TABLE.adapter_entries()]
    assert entries == [
        ("chat", "llama", "chat"),
        ("llama:sql", "llama", "sql"),  # ambiguous bare name
        ("smollm2:llama", "smollm2", "llama"),  # `llama` is a model
        ("poet", "smollm2", "poet"),
        ("smollm2:sql", "smollm2", "sql"),
    ]
    for name, dep, a in A_TABLE.adapter_entries():
        got = resolve_model(A_TABLE, name)
        assert (got.dep, got.adapter) == (dep, a)
    assert A_TABLE.adapter_limits() == {("ns", "smollm2", "sql"): 1000}
    assert TABLE.adapter_entries() == [] and TABLE.adapter_limits() == {}


def shares(fn, n: int = 4000, seed: int = 1) -> dict[str, float]:
    rng = random.Random(seed)
    c = Counter(fn(rng) for _ in range(n))
    return {k: v / n for k, v in c.items()}


@pytest.mark.parametrize(
    ("dep", "suffix", "tier", "expected"),
    [
        # untiered requests split by weight among untiered variants (3:1), the tier-only variant gets nothing
        (DEP, None, "standard", {"full": 0.75, "int4": 0.25}),
        # a tier claimed by a variant goes only there, even with weight 0
        (DEP, None, "batch", {"batch": 1.0}),
        # an explicit suffix wins over weights and tiers
        (DEP, "int4", "batch", {"int4": 1.0}),
        # a variant without ready pods is skipped while another can serve
        (DeploymentRoute("m", "m", variants=(FULL, COLD)), None, "standard", {"full": 1.0}),
        # ... but chosen (to be held until it scales up) when no eligible variant has a pod
        (
            DeploymentRoute("m", "m", variants=(COLD, variant("cold2", 0, RevisionRoute("r", 1, ())))),
            None,
            "standard",
            {"cold": 1.0},
        ),
        # all weights zero: uniform
        (
            DeploymentRoute("m", "m", variants=(variant("a", 0, *FULL.revisions), variant("b", 0, *INT4.revisions))),
            None,
            "x",
            {"a": 0.5, "b": 0.5},
        ),
    ],
)
def test_choose_variant_shares(dep: DeploymentRoute, suffix: str | None, tier: str, expected: dict[str, float]) -> None:
    got = shares(lambda rng: choose_variant(dep, suffix, tier, rng).name)
    assert set(got) == set(expected)
    for name, share in expected.items():
        assert got[name] == pytest.approx(share, abs=0.03)


def test_tier_served_by_nobody_is_404() -> None:
    dep = DeploymentRoute("m", "m", variants=(BATCH,))
    with pytest.raises(RoutingError, match="serves tier 'standard'"):
        choose_variant(dep, None, "standard", random.Random(0))


def test_canary_revision_weights() -> None:
    got = shares(lambda rng: choose_revision(FULL, rng).name)  # type: ignore[union-attr]
    assert got["r1"] == pytest.approx(0.9, abs=0.02)
    assert got["r2"] == pytest.approx(0.1, abs=0.02)


@pytest.mark.parametrize(
    ("revisions", "expected"),
    [
        ((RevisionRoute("stable", 100, ()), RevisionRoute("canary", 0, eps("v", "canary", "c1"))), {"canary": 1.0}),
        ((RevisionRoute("stable", 50, ()), RevisionRoute("canary", 50, ())), {}),
    ],
)
def test_revision_without_ready_pods_is_skipped(
    revisions: tuple[RevisionRoute, ...], expected: dict[str, float]
) -> None:
    v = variant("v", 1, *revisions)
    if not expected:
        assert choose_revision(v, random.Random(0)) is None
    else:
        assert shares(lambda rng: choose_revision(v, rng).name) == expected  # type: ignore[union-attr]


def test_weighted_choice_is_seeded() -> None:
    picks = lambda seed: [weighted_choice("abc", [1, 2, 3], random.Random(seed)) for _ in range(20)]  # noqa: E731
    assert picks(5) == picks(5)
    with pytest.raises(ValueError):
        weighted_choice([], [], random.Random(0))


PODS = eps("v", "r", "p0", "p1", "p2", "p3")


@pytest.mark.parametrize(
    ("outstanding", "exclude", "expected"),
    [
        ({"http://p0:8000": 3, "http://p1:8000": 1, "http://p2:8000": 2, "http://p3:8000": 5}, (), "p1"),
        (
            {"http://p0:8000": 3, "http://p1:8000": 1, "http://p2:8000": 2, "http://p3:8000": 5},
            ("http://p1:8000",),
            "p2",
        ),
        ({}, tuple(e.url for e in PODS), None),
    ],
)
def test_least_outstanding_without_affinity(
    outstanding: dict[str, int], exclude: tuple[str, ...], expected: str | None
) -> None:
    got = choose_endpoint(PODS, outstanding, None, 1.25, random.Random(0), exclude)
    assert (got.name if got else None) == expected


def test_least_outstanding_ties_are_broken_at_random_but_seeded() -> None:
    names = [choose_endpoint(PODS, {}, None, 1.25, random.Random(s)).name for s in range(40)]  # type: ignore[union-attr]
    assert set(names) == {"p0", "p1", "p2", "p3"}
    assert names == [choose_endpoint(PODS, {}, None, 1.25, random.Random(s)).name for s in range(40)]  # type: ignore[union-attr]


def test_affinity_is_sticky_and_spreads_distinct_prefixes() -> None:
    keys = [f"system prompt {i}" for i in range(200)]
    first = {k: choose_endpoint(PODS, {}, k, 1.25, random.Random(0)).name for k in keys}  # type: ignore[union-attr]
    again = {k: choose_endpoint(PODS, {}, k, 1.25, random.Random(99)).name for k in keys}  # type: ignore[union-attr]
    assert first == again  # independent of the rng: the prefix decides
    per_pod = Counter(first.values())
    assert set(per_pod) == {"p0", "p1", "p2", "p3"} and min(per_pod.values()) > 25


def test_rendezvous_moves_only_the_removed_pods_keys() -> None:
    keys = [f"k{i}" for i in range(300)]
    before = {k: rendezvous_order(k, PODS)[0].name for k in keys}
    after = {k: rendezvous_order(k, PODS[:3])[0].name for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "p3"}


@pytest.mark.parametrize(
    ("loads", "c", "cap"),
    [((0, 0, 0, 0), 1.25, 0.0), ((4, 0, 0, 0), 1.25, 1.25), ((4, 4, 4, 4), 1.0, 4.0), ((8, 0, 0, 0), 2.0, 4.0)],
)
def test_load_cap(loads: tuple[int, ...], c: float, cap: float) -> None:
    outstanding = {e.url: n for e, n in zip(PODS, loads, strict=True)}
    assert load_cap(outstanding, PODS, c) == cap


def test_hot_prefix_is_bounded_by_the_load_cap() -> None:
    """One prefix sent 400 times while nothing finishes: no pod exceeds c * mean + 1."""
    outstanding: dict[str, int] = {}
    c = 1.25
    rng = random.Random(3)
    for _ in range(400):
        e = choose_endpoint(PODS, outstanding, "the same hot system prompt", c, rng)
        assert e is not None
        mean = sum(outstanding.values()) / len(PODS)
        assert outstanding.get(e.url, 0) <= c * mean  # the bounded-load rule at the moment of choice
        outstanding[e.url] = outstanding.get(e.url, 0) + 1
    assert max(outstanding.values()) <= c * (400 / len(PODS)) + 1
    assert len(outstanding) == len(PODS)


def test_hot_prefix_prefers_its_home_pod_while_under_cap() -> None:
    home = rendezvous_order("hot", PODS)[0]
    outstanding = {e.url: 2 for e in PODS}
    assert choose_endpoint(PODS, outstanding, "hot", 1.25, random.Random(0)) == home
    outstanding[home.url] = 3  # mean 2.25, cap 2.81: home is over, the second-ranked pod takes it
    assert choose_endpoint(PODS, outstanding, "hot", 1.25, random.Random(0)) == rendezvous_order("hot", PODS)[1]


@pytest.mark.parametrize(
    ("body", "text"),
    [
        (
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
            "system\nbe brief\nuser\nhi\n",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "a"},
                            {"type": "image_url"},
                            {"type": "text", "text": "b"},
                        ],
                    }
                ]
            },
            "user\nab\n",
        ),
        ({"prompt": "once upon"}, "once upon"),
        ({"prompt": ["a", "b"]}, "ab"),
        ({"prompt": [1, 2, 3]}, "1 2 3"),
        ({"prompt": [[7, 8], [9]]}, "7 8"),
        ({"prompt": None}, ""),
        ({}, ""),
    ],
)
def test_prompt_text(body: dict, text: str) -> None:
    assert prompt_text(body) == text


@pytest.mark.parametrize(
    ("prompt", "n", "key"), [("abcdef", 3, "abc"), ("ab", 3, "ab"), ("abc", 0, None), ("", 5, None)]
)
def test_affinity_key(prompt: str, n: int, key: str | None) -> None:
    assert affinity_key(prompt, n) == key


def test_model_names_lists_variants_only_when_several() -> None:
    assert TABLE.model_names() == ["odd:name", "smollm2", "smollm2:full", "smollm2:int4", "smollm2:batch"]


def names(endpoints: list[Endpoint]) -> list[str]:
    return sorted(e.name for e in endpoints)


# full: r1 (f1, f2) 90 and canary r2 (f3) 10; int4: q1; batch (tier batch): b1
@pytest.mark.parametrize(
    ("pods", "variant_name", "revision", "tier", "exclude", "expected"),
    [
        # the chosen revision's pods with the adapter, never one without it
        ({"f1", "f3", "q1"}, "full", "r1", "standard", (), ["f1"]),
        ({"f1", "f2", "f3"}, "full", "r2", "standard", (), ["f3"]),
        # the canary has none: the variant's pods that have it
        ({"f1", "q1"}, "full", "r2", "standard", (), ["f1"]),
        # a retry (no revision) takes the variant's pods not tried yet
        ({"f1", "f2", "f3"}, "full", None, "standard", ("http://f1:8000",), ["f2", "f3"]),
        # the variant has none: any variant serving the tier (full, int4; batch is the batch tier's)
        ({"q1", "b1"}, "full", "r1", "standard", (), ["q1"]),
        ({"b1"}, "full", "r1", "standard", (), []),  # only a variant of another tier has it: none
        ({"b1"}, "batch", "r1", "batch", (), ["b1"]),
        ({"f1"}, "full", "r1", "standard", ("http://f1:8000",), []),  # tried already
        (set(), "full", "r1", "standard", (), []),  # loaded nowhere
        ({"gone"}, "full", "r1", "standard", (), []),  # a pod the table does not route (not ready, draining)
    ],
)
def test_adapter_endpoints_are_only_pods_with_the_adapter_loaded(
    pods: set[str], variant_name: str, revision: str | None, tier: str, exclude: tuple[str, ...], expected: list[str]
) -> None:
    adapter = AdapterRoute("sql", pods=frozenset(pods))
    v = A_DEP.variant(variant_name)
    assert v is not None
    rev = next(r for r in v.revisions if r.name == revision) if revision else None
    got = adapter_endpoints(A_DEP, v, rev, adapter, tier, exclude)
    assert names(got) == expected
    assert all(e.name in pods for e in got)


def test_adapter_requests_keep_canary_weights_where_the_adapter_is_everywhere() -> None:
    adapter = AdapterRoute("sql", pods=frozenset({"f1", "f2", "f3", "q1"}))

    def pick(rng: random.Random) -> str:
        v = choose_variant(A_DEP, None, "standard", rng)
        e = choose_endpoint(
            adapter_endpoints(A_DEP, v, choose_revision(v, rng), adapter, "standard"), {}, None, 1.25, rng
        )
        assert e is not None
        return e.revision if e.variant == "full" else e.variant

    got = shares(pick)
    # full 3 : int4 1, and within full the canary's 10 %
    assert got == pytest.approx({"r1": 0.75 * 0.9, "r2": 0.75 * 0.1, "int4": 0.25}, abs=0.03)


@pytest.mark.parametrize(
    ("adapter", "message"),
    [
        (AdapterRoute("sql"), "LoRA adapter 'sql' of model 'smollm2' is not loaded on a ready pod yet (loading)"),
        (
            AdapterRoute("sql", failed="adapter_config.json is missing; rank 64 > max-lora-rank 16"),
            "failed to load on every pod: adapter_config.json is missing; rank 64 > max-lora-rank 16",
        ),
    ],
)
def test_adapter_not_ready_is_503_saying_why(adapter: AdapterRoute, message: str) -> None:
    e = adapter_not_ready(A_DEP, adapter)
    assert (e.status, e.code) == (503, "adapter_not_ready")
    assert message in e.message
