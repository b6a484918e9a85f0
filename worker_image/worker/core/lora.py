"""LoRA adapters as the scheduler sees them: a registered adapter (`LoraSpec`) and the LRU of adapter slots.

Why it exists: the engine serves many adapters of one base model, but only `max_loras` of them are resident in
the model runner at once (S-LoRA / vLLM's `--max-loras`). Which adapter occupies which slot is a scheduling
decision: a request may be admitted only when its adapter has a slot, an adapter used by a running request is
never evicted, and a non-resident adapter takes the least recently used idle slot. That bookkeeping is pure
Python here (no torch, like the rest of `worker.core`); the runner loads the weights of whatever adapter a
scheduled sequence names into that sequence's slot (`worker.model.lora`).

Imports nothing but the standard library.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass


def check_new_adapter_name(name: str, loaded: Collection[str], base: str) -> None:
    """ValueError when `name` cannot be registered: taken by a loaded adapter, or the base model's name (both
    engines' `load_lora` apply this one rule, with the same words)."""
    if name in loaded:
        raise ValueError(f"an adapter named {name!r} is already loaded: unload it first")
    if name == base:
        raise ValueError(f"{name!r} is the base model's name: give the adapter another name")


@dataclass(frozen=True)
class LoraSpec:
    """One registered adapter. `lora_id` is unique per registration (never reused), so an adapter unloaded and
    loaded again under the same name (possibly from changed files) never shares KV-cache blocks or a slot with
    its earlier self."""

    name: str
    lora_id: int
    path: str


@dataclass
class LoraStats:
    """A snapshot for metrics: vLLM's `vllm:lora_requests_info` labels and our load/eviction counters."""

    max_loras: int
    running: tuple[str, ...] = ()  # adapters of running requests (sorted, distinct)
    waiting: tuple[str, ...] = ()  # adapters of waiting requests (sorted, distinct)
    loads_total: int = 0  # adapters put into a slot
    evictions_total: int = 0  # idle adapters dropped from a slot to make room for another


class LoraSlots:
    """`max_loras` adapter slots with reference counts and least-recently-used eviction of idle adapters.

    `acquire(spec)` gives the slot the adapter holds (a hit), or puts it into a free slot, or evicts the least
    recently used adapter no request holds; None when every slot is held by some request (the caller then leaves
    the request waiting). Each successful `acquire` must be paired with one `release`.
    """

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.max_loras = max_loras
        self._slot_of: dict[int, int] = {}  # lora_id -> slot
        self._refs: dict[int, int] = {}  # lora_id -> requests holding it (resident adapters only)
        self._idle: OrderedDict[int, None] = OrderedDict()  # resident, unreferenced, least recently used first
        self._free: list[int] = list(range(max_loras - 1, -1, -1))  # pop() gives the lowest slot first
        self._doomed: set[int] = set()  # unregistered while in use: freed at their last release
        self.loads_total = 0
        self.evictions_total = 0

    def slot_of(self, lora_id: int) -> int | None:
        return self._slot_of.get(lora_id)

    @property
    def resident(self) -> frozenset[int]:
        return frozenset(self._slot_of)

    def refs(self, lora_id: int) -> int:
        return self._refs.get(lora_id, 0)

    def acquire(self, lora_id: int) -> int | None:
        slot = self._slot_of.get(lora_id)
        if slot is not None:
            self._idle.pop(lora_id, None)
            self._refs[lora_id] += 1
            return slot
        if self._free:
            slot = self._free.pop()
        elif self._idle:
            victim, _ = self._idle.popitem(last=False)
            slot = self._slot_of.pop(victim)
            del self._refs[victim]
            self.evictions_total += 1
        else:
            return None
        self._slot_of[lora_id] = slot
        self._refs[lora_id] = 1
        self.loads_total += 1
        return slot

    def release(self, lora_id: int) -> None:
        refs = self._refs.get(lora_id, 0)
        if refs <= 0:
            raise ValueError(f"adapter {lora_id} released more often than acquired")
        self._refs[lora_id] = refs - 1
        if refs > 1:
            return
        if lora_id in self._doomed:
            self._doomed.discard(lora_id)
            self._drop(lora_id)
        else:
            self._idle[lora_id] = None  # most recently used: evicted last

    def discard(self, lora_id: int) -> None:
        """The adapter was unregistered: free its slot now if idle, else when its last request releases it."""
        if lora_id not in self._slot_of:
            return
        if self._refs[lora_id] > 0:
            self._doomed.add(lora_id)
        else:
            self._idle.pop(lora_id, None)
            self._drop(lora_id)

    def _drop(self, lora_id: int) -> None:
        slot = self._slot_of.pop(lora_id)
        del self._refs[lora_id]
        self._free.append(slot)
        self._free.sort(reverse=True)
