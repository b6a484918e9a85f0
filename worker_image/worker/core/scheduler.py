"""Iteration-level continuous batching: which requests compute how many tokens in the next step.

Each `schedule()` spends a token budget (`max_num_batched_tokens`) over at most `max_num_seqs` requests:
running requests first (a decode is one token, an unfinished prefill continues with a chunk), then waiting
ones in FCFS or priority order. There is no separate "prefill" or "decode" phase: a request simply computes
`num_tokens - num_computed_tokens` tokens, capped by the budget, so chunked prefill, prefix-cache hits (which
advance `num_computed_tokens` at admission) and recompute after preemption are one mechanism.

When a running request cannot get a block, the newest (lowest-priority) running request is preempted: its
blocks are freed and it waits to be recomputed; if that is the request itself, it just waits. Requests are
capped at what the KV cache can hold in total, so a request that runs alone always fits and nothing loops.
While paused (draining) only requests that were already admitted run; new ones wait.

`update_from_output` applies the runner's sampled tokens and the stop conditions that need no text (EOS,
stop token ids, max_tokens, context length), and ends with an error the requests the runner could not run.
Stop strings need detokenised text; the engine applies them and calls `finish_requests`.

Speculative decoding (`EngineConfig.speculative`): a running request that decodes schedules its last token plus
the drafts `worker.core.ngram` proposes from its context (bounded by the token budget, its remaining
`max_tokens` and the context length; never for requests that want logprobs), in steps where at most
`disable_by_batch_size` requests decode. The runner returns the tokens it verified (`worker.core.spec_decode`);
each is appended and stop-checked in order, so a request stops exactly where plain decoding stops, and
`num_computed_tokens` counts only positions whose token is now known: the KV written for rejected drafts lies
beyond it and is overwritten later. Since blocks enter the prefix cache only below `num_computed_tokens` and are
hashed from the request's own (verified) tokens, no rejected draft can ever be cached.

LoRA (`EngineConfig.enable_lora`): a request with an adapter is admitted only when its adapter gets one of the
`max_loras` slots (`worker.core.lora.LoraSlots`: the slot it already holds, a free one, or the least recently used
idle adapter's); otherwise admission passes over it, leaving it at the head of the queue, and admits the requests
behind it. It holds the slot while running (so its adapter is never evicted under it) and gives it back when it
ends or is preempted. Its prefix-cache blocks are keyed by its adapter too (`KVCacheManager`), so KV computed
under one adapter is never reused for another or for the base.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable

from worker.core.config import EngineConfig
from worker.core.errors import QueueFullError
from worker.core.kv_cache_manager import KVCacheManager, token_slice
from worker.core.lora import LoraSlots, LoraStats
from worker.core.ngram import propose
from worker.core.outputs import ModelRunnerOutput, ScheduledSeq, SchedulerOutput
from worker.core.request import Logprob, Request, RequestStatus
from worker.core.spec_decode import SpecDecodeStats


def prompt_targets(req: Request, start: int, end: int) -> tuple[int, ...]:
    """The prompt tokens that positions start..end-1 predict, when the request wants prompt logprobs it lacks.

    Position p predicts token p + 1; positions recomputed after a preemption whose logprobs are already known
    are still listed (the runner scores them again; `record_prompt_logprobs` keeps the first values).
    """
    if req.prompt_logprobs_done:
        return ()
    return tuple(req.prompt_token_ids[start + 1 : min(end + 1, req.num_prompt_tokens)])


def record_prompt_logprobs(req: Request, seq: ScheduledSeq, values: list[Logprob]) -> None:
    """Append the logprobs of the prompt tokens this step scored and the request does not have yet."""
    if len(values) != len(seq.prompt_targets):
        raise ValueError(f"{req.request_id}: {len(values)} prompt logprobs for {len(seq.prompt_targets)} targets")
    first = seq.start_pos  # values[i] is for prompt token start_pos + 1 + i, i.e. list index start_pos + i
    known = len(req.prompt_logprobs)
    if first > known:
        raise ValueError(f"{req.request_id}: prompt logprobs from index {first} but only {known} are known")
    req.prompt_logprobs.extend(values[known - first :])


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        config.check_max_model_len(max_model_len)
        self.config = config
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        # A request may hold at most every block: beyond that even running alone it could not continue.
        self.max_request_len = min(max_model_len, self.kv.capacity_tokens)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.running: list[Request] = []
        # Heaps of (sort key, request). New requests and preempted ones wait apart so that, while paused,
        # preempted requests (already admitted once) can still resume and finish.
        self._waiting: list[tuple[tuple[int, int], Request]] = []
        self._preempted: list[tuple[tuple[int, int], Request]] = []
        self._num_waiting = 0  # live entries of both heaps (aborted ones are skipped lazily)
        self._keys: dict[str, tuple[int, int]] = {}
        self._arrivals = itertools.count()
        self._finished_ids: set[str] = set()  # ended since the last schedule(): the runner drops their state
        self.paused = False
        self.num_preemptions_total = 0
        self.spec_decode_stats = SpecDecodeStats()
        self.lora_slots = LoraSlots(config.max_loras) if config.enable_lora else None

    # ----------------------------------------------------------------------------------------------- admission
    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_schedulable_requests(self) -> bool:
        """Whether schedule() would do anything (False when idle, or paused with only new requests waiting)."""
        if self.running:
            return True
        if not self.paused:
            return self._num_waiting > 0
        return any(not r.is_finished for _, r in self._preempted)

    def check_prompt(self, num_prompt_tokens: int) -> None:
        """Raise ValueError for a prompt that can never be served (before it is queued)."""
        if num_prompt_tokens < 1:
            raise ValueError("the prompt is empty: give at least one token")
        if num_prompt_tokens >= self.max_request_len:
            raise ValueError(
                f"the prompt has {num_prompt_tokens} tokens, but this engine serves at most "
                f"{self.max_request_len} tokens per request (prompt + output; max_model_len and a KV cache of "
                f"{self.kv.num_blocks} blocks of {self.kv.block_size}): shorten the prompt"
            )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if self._num_waiting >= self.config.max_waiting:
            raise QueueFullError(f"{self._num_waiting} requests are already waiting (max_waiting)")
        self.check_prompt(request.num_prompt_tokens)
        if request.lora is not None and self.lora_slots is None:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora (--enable-lora)")
        priority = request.priority if self.config.scheduling_policy == "priority" else 0
        key = (priority, next(self._arrivals))
        self._keys[request.request_id] = key
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        heapq.heappush(self._waiting, (key, request))
        self._num_waiting += 1

    def pause(self) -> None:
        """Stop admitting new requests; running and preempted ones still run to completion."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    # ---------------------------------------------------------------------------------------------- scheduling
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_new: dict[str, int] = {}  # request id -> tokens scheduled this step (drafts included)
        # Running requests' shares, built as they are scheduled (a victim's is dropped): this loop has each
        # request's state at hand, which a model step has just evicted from the caches (64 a step).
        running_seqs: dict[str, ScheduledSeq] = {}
        preempted_ids: set[str] = set()
        speculate = self._speculation_on()

        # 1. Running requests, in admission order (a preemption deletes from this same list).
        i = 0
        running, allocate, scheduled_seq = self.running, self.kv.allocate_slots, self._scheduled_seq
        while i < len(running) and budget > 0:
            req = running[i]
            rid = req.request_id
            known = len(req.prompt_token_ids) + len(req.output_token_ids) - req.num_computed_tokens
            n = known if known < budget else budget
            if speculate and n == known == 1:
                draft = self._propose(req, budget)
                # Drafts only where their slots fit: a draft is never worth a preemption.
                if draft and (table := allocate(req, 1 + len(draft))) is not None:
                    num_new[rid] = 1 + len(draft)
                    running_seqs[rid] = scheduled_seq(req, 1 + len(draft), table, tuple(draft))
                    budget -= 1 + len(draft)
                    i += 1
                    continue
            while (table := allocate(req, n)) is None:
                victim = max(running, key=lambda r: self._keys[r.request_id])
                victim_index = running.index(victim)
                self._preempt(victim, victim_index)
                preempted_ids.add(victim.request_id)
                budget += num_new.pop(victim.request_id, 0)
                running_seqs.pop(victim.request_id, None)
                if victim_index < i:
                    i -= 1
                if victim is req:
                    break
            else:
                num_new[rid] = n
                running_seqs[rid] = scheduled_seq(req, n, table)
                budget -= n
                i += 1

        # 2. Waiting requests, unless this step had to preempt (admitting now would only thrash) and some
        #    request still runs.
        if not preempted_ids or not self.running:
            budget = self._admit(budget, num_new)

        if not num_new and self.requests and not self.paused:
            # Cannot happen: the budget is positive and a lone request always fits. Fail loudly, never spin.
            raise RuntimeError(f"scheduler made no progress with {len(self.requests)} unfinished requests")
        seqs = list(running_seqs.values())
        if len(seqs) < len(num_new):  # and the admitted ones', after the running ones as in `num_new`
            kv, requests = self.kv, self.requests
            seqs += [
                self._scheduled_seq(requests[rid], n, kv.get_block_ids(rid))
                for rid, n in itertools.islice(num_new.items(), len(seqs), None)
            ]
        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(
            seqs=seqs,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            finished_req_ids=frozenset(finished),
            preempted_req_ids=frozenset(preempted_ids),
        )

    def _admit(self, budget: int, num_new: dict[str, int]) -> int:
        # Requests whose adapter has no slot now are set aside for this step and put back after it.
        passed: list[tuple[list[tuple[tuple[int, int], Request]], tuple[tuple[int, int], Request]]] = []
        try:
            return self._admit_some(budget, num_new, passed)
        finally:
            for heap, entry in passed:
                heapq.heappush(heap, entry)

    def _admit_some(
        self,
        budget: int,
        num_new: dict[str, int],
        passed: list[tuple[list[tuple[tuple[int, int], Request]], tuple[tuple[int, int], Request]]],
    ) -> int:
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            heap = self._next_heap()
            if heap is None:
                break
            req = heap[0][1]
            if req.is_finished:  # aborted while waiting
                heapq.heappop(heap)
                continue
            slot = None
            if req.lora is not None:
                assert self.lora_slots is not None  # add_request refuses adapters otherwise
                slot = self.lora_slots.acquire(req.lora.lora_id)
                if slot is None:  # every slot is held by running requests: pass over it this step
                    passed.append((heap, heapq.heappop(heap)))
                    continue
            if req.sampling_params.prompt_logprobs is None:
                hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            else:  # every prompt position needs its logits: no cache hits
                hits, num_hit_tokens = [], 0
            n = req.num_tokens - num_hit_tokens
            if (n > budget and not self.config.enable_chunked_prefill) or self.kv.allocate_slots(
                req, min(n, budget), hits
            ) is None:
                if req.lora is not None and self.lora_slots is not None:
                    self.lora_slots.release(req.lora.lora_id)
                break
            n = min(n, budget)
            req.lora_slot = slot
            heapq.heappop(heap)
            self._num_waiting -= 1
            self.kv.record_lookup(req.num_tokens, num_hit_tokens)
            if req.status is RequestStatus.WAITING:
                req.num_cached_tokens = num_hit_tokens
            req.num_computed_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_new[req.request_id] = n
            budget -= n
        return budget

    def _next_heap(self) -> list[tuple[tuple[int, int], Request]] | None:
        """The heap whose head is admitted next: the smaller key wins; while paused only preempted requests."""
        if self.paused or not self._waiting:
            return self._preempted or None
        if not self._preempted:
            return self._waiting
        return self._preempted if self._preempted[0][0] < self._waiting[0][0] else self._waiting

    @staticmethod
    def _scheduled_seq(req: Request, n: int, block_ids: list[int], draft: tuple[int, ...] = ()) -> ScheduledSeq:
        # Runs for every scheduled request in every step: lengths read once, and the arguments go positionally (a
        # 12-field dataclass takes keywords at 3x the cost).
        start = req.num_computed_tokens
        end = start + n - len(draft)  # end of the known tokens this step computes
        outputs = req.output_token_ids
        num_tokens = len(req.prompt_token_ids) + len(outputs)
        token_ids = token_slice(req, start, end)
        if draft:
            token_ids = token_ids + list(draft)
        return ScheduledSeq(
            req.request_id,
            token_ids,
            start,
            block_ids,  # the KV manager's live table: no copy of every id per request per step
            end == num_tokens,  # sample
            req.sampling_params,
            len(outputs),  # num_output_tokens
            req.eos_token_id,
            () if req.sampling_params.prompt_logprobs is None else prompt_targets(req, start, end),
            draft,
            req.lora,
            -1 if req.lora_slot is None else req.lora_slot,
        )

    def _speculation_on(self) -> bool:
        """Whether this step proposes drafts: speculation is configured and few enough requests decode."""
        spec = self.config.speculative
        if spec is None:
            return False
        decoding = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        return decoding <= spec.disable_by_batch_size

    def _propose(self, req: Request, budget: int) -> list[int]:
        """Drafts for a decoding request: at most what the budget, its max_tokens and the context leave room
        for after the one token every step gains. None for requests that want logprobs (not speculated)."""
        spec = self.config.speculative
        params = req.sampling_params
        if spec is None or params.logprobs or params.prompt_logprobs is not None:
            return []
        k = min(
            spec.num_speculative_tokens,
            budget - 1,
            params.max_tokens - req.num_output_tokens - 1,
            self.max_request_len - req.num_tokens - 1,
        )
        if k < 1:
            return []
        return propose(req.all_token_ids, k, spec.prompt_lookup_max, spec.prompt_lookup_min)

    def _release_lora(self, req: Request) -> None:
        if req.lora is not None and req.lora_slot is not None and self.lora_slots is not None:
            self.lora_slots.release(req.lora.lora_id)
        req.lora_slot = None

    def remove_lora(self, lora_id: int) -> None:
        """The adapter was unregistered: free its slot (now, or when the last request using it ends)."""
        if self.lora_slots is not None:
            self.lora_slots.discard(lora_id)

    def lora_stats(self) -> LoraStats | None:
        """Adapters of running and waiting requests, slot count, loads and evictions (None without LoRA)."""
        slots = self.lora_slots
        if slots is None:
            return None
        running = {r.lora.name for r in self.running if r.lora is not None}
        waiting = {
            r.lora.name for r in self.requests.values() if r.lora is not None and r.status is not RequestStatus.RUNNING
        }
        return LoraStats(
            max_loras=slots.max_loras,
            running=tuple(sorted(running)),
            waiting=tuple(sorted(waiting)),
            loads_total=slots.loads_total,
            evictions_total=slots.evictions_total,
        )

    def _preempt(self, req: Request, index: int) -> None:
        del self.running[index]
        self._release_lora(req)
        self.kv.free(req.request_id, finished=False)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        heapq.heappush(self._preempted, (self._keys[req.request_id], req))
        self._num_waiting += 1

    # ----------------------------------------------------------------------------------------------- updating
    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance the scheduled requests; return those that got a new token or ended (the runner failed them)."""
        sampled = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs
        failed = runner_output.failed
        requests = self.requests
        # Without prefix caching there is nothing to index: no call per request per step.
        cache_blocks = self.kv.cache_computed_blocks if self.kv.enable_caching else None
        check_stop = self._check_stop
        updated: list[Request] = []
        finished = []
        for seq in scheduler_output.seqs:
            rid = seq.req_id
            req = requests[rid]
            error = failed.get(rid) if failed else None
            if error is not None:  # its KV of this step may be missing: never cache it, end the request
                req.status = RequestStatus.FINISHED_ERROR
                req.error = error
                finished.append(req)
                updated.append(req)
                continue
            if seq.draft_token_ids:
                status = self._apply_verified(req, seq, runner_output.verified_token_ids.get(rid))
                if status is not None:
                    req.status = status
                    finished.append(req)
                updated.append(req)
                continue
            req.num_computed_tokens += len(seq.token_ids)
            if cache_blocks is not None:
                cache_blocks(req)
            if seq.prompt_targets:
                record_prompt_logprobs(req, seq, runner_output.prompt_logprobs[rid])
            if not seq.sample:
                continue
            token = sampled[rid]
            req.output_token_ids.append(token)
            params = req.sampling_params
            if params.logprobs:
                req.output_logprobs.append(logprobs[rid])
                if params.top_logprobs:
                    req.output_top_logprobs.append(runner_output.top_logprobs[rid])
            status = check_stop(req, token)
            if status is not None:
                req.status = status
                finished.append(req)
            updated.append(req)
        if finished:
            finished_ids = {r.request_id for r in finished}
            self.running = [r for r in self.running if r.request_id not in finished_ids]
            for req in finished:
                self._release(req)
        return updated

    def _apply_verified(self, req: Request, seq: ScheduledSeq, tokens: list[int] | None) -> RequestStatus | None:
        """Append the tokens a speculative step verified, stop-checking each in order; roll back the rest."""
        num_drafts = len(seq.draft_token_ids)
        if not tokens or len(tokens) > num_drafts + 1:
            raise ValueError(f"{req.request_id}: the runner verified {tokens!r} for {num_drafts} drafts")
        self.spec_decode_stats.observe(num_drafts, len(tokens) - 1)
        status = None
        appended = 0
        for token in tokens:
            req.output_token_ids.append(token)
            appended += 1
            status = self._check_stop(req, token)
            if status is not None:
                break
        # Positions start_pos .. start_pos + appended - 1 hold the last known token and the accepted drafts: their
        # KV is right. The KV of rejected drafts (and of drafts after a stop) lies beyond and is never read.
        req.num_computed_tokens = seq.start_pos + appended
        self.kv.cache_computed_blocks(req)
        return status

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        num_output = len(req.output_token_ids)
        if num_output >= params.min_tokens:
            if token == req.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens or len(req.prompt_token_ids) + num_output >= self.max_request_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_requests(
        self,
        request_ids: Iterable[str],
        status: RequestStatus,
        stop_reason: int | str | None = None,
        error: str | None = None,
    ) -> list[Request]:
        """End requests from outside the step (abort, stop string, an error in the output processor); unknown or
        finished ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        ended = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status is RequestStatus.RUNNING:
                self.running.remove(req)
            else:  # still in a heap: skipped lazily when it reaches the head
                self._num_waiting -= 1
            req.status = status
            if stop_reason is not None:
                req.stop_reason = stop_reason
            if error is not None:
                req.error = error
            self._release(req)
            ended.append(req)
        return ended

    def _release(self, req: Request) -> None:
        self._release_lora(req)
        self.kv.free(req.request_id, finished=True)
        del self.requests[req.request_id]
        del self._keys[req.request_id]
        self._finished_ids.add(req.request_id)

    # -------------------------------------------------------------------------------------------------- stats
    @property
    def kv_cache_usage(self) -> float:
        return self.kv.usage

    def remaining_tokens_estimate(self) -> int:
        return sum(r.remaining_tokens for r in self.requests.values())
