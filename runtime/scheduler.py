"""The scheduler: the one owner of which requests run (STYLE 14). It admits waiting requests in arrival order
when the KV pool has their pages (a group of requests, one `generate` call's batch, all at once), keeps the
running ones in decode-row order, and finishes, aborts and frees them: a finished or aborted request's pages
return to the pool at once. The runner (runtime/runner.py) executes what it hands over and decides nothing.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from sift.errors import SiftError

from .modes import Mode
from .request import RequestState


@dataclass(eq=False)
class Group:
    """Requests admitted and prefilled together: one `add_request` (one request), or one `generate` /
    `prefill` call's batch. supplied: bits given instead of the index's (runtime/supplied_bits.py); timed: build
    the batch's `PrefillResult` (synchronised stage timing, the logits kept); result: that result once
    prefilled; lease_s: seconds the KV store took to lease its pages."""

    states: list[RequestState]
    mode: Mode
    supplied: tuple | None = None
    timed: bool = False
    result: object = None
    lease_s: float = 0.0

    @property
    def n_tokens(self) -> int:
        return sum(s.n_prompt for s in self.states)

    def docs(self) -> dict[str, int]:
        """The distinct documents of the group's requests: store key -> n_tokens."""
        return {k: n for s in self.states for k, n in s.need.docs.items()}

    def scratch(self) -> int:
        return sum(s.need.own + s.need.gen for s in self.states)

    def worst_pages(self, block: int) -> int:
        """Pages the group holds at most (every document missing), each distinct document counted once."""
        per_miss = self.states[0].need.per_miss
        return self.scratch() + sum(-(-n // block) + per_miss for n in self.docs().values())


class Scheduler:
    """waiting: groups in arrival order; running: admitted requests in decode-row order (a request stays there
    until the step after it finished, when `prune` drops it and the rows are refilled). max_running: the decode
    batch's rows; max_prefill_tokens: prompt tokens admitted per step beyond the first group (a long queue is
    prefilled over several steps, so the running requests keep decoding in between)."""

    def __init__(self, store, *, max_running: int, max_prefill_tokens: int):
        self.store = store
        self.max_running, self.max_prefill_tokens = max_running, max_prefill_tokens
        self.waiting: deque[Group] = deque()
        self.running: list[RequestState] = []

    def add(self, group: Group) -> None:
        self.waiting.append(group)

    def admit(self) -> list[Group]:
        """The waiting groups that start now, their leases taken: in arrival order while rows, the step's
        prefill budget and the pool's pages allow (the first group that does not fit waits, and so do those
        behind it)."""
        admitted, tokens = [], 0
        while self.waiting:
            group = self.waiting[0]
            group.states = [s for s in group.states if not s.finished]      # aborted while waiting
            if not group.states:
                self.waiting.popleft()
                continue
            if len(self.running) + sum(len(g.states) for g in admitted) + len(group.states) > self.max_running:
                break
            if admitted and tokens + group.n_tokens > self.max_prefill_tokens:
                break
            if not self.store.can_lease(group.docs(), group.scratch(), group.states[0].need.per_miss):
                break
            self.lease(group)
            self.waiting.popleft()
            admitted.append(group)
            tokens += group.n_tokens
        return admitted

    def lease_now(self, group: Group) -> None:
        """Lease a group's pages now or refuse (a `prefill` call, which does not wait for running requests)."""
        if not self.store.can_lease(group.docs(), group.scratch(), group.states[0].need.per_miss):
            raise SiftError(f"the KV pool has no room for this batch now: its pages are held by {len(self.running)} "
                            f"running requests; wait for them, or raise SiftEngine(kv_cache_bytes=...) / "
                            f"KVStore(hbm_bytes=...)")
        self.lease(group)

    def lease(self, group: Group) -> None:
        t = time.perf_counter()
        try:
            for s in group.states:
                s.lease = self.store.lease(s.need.docs, s.need.own + s.need.gen, per_miss_pages=s.need.per_miss)
        except BaseException:
            self.release(group)
            raise
        group.lease_s = time.perf_counter() - t

    def release(self, group: Group) -> None:
        for s in group.states:
            if s.lease is not None:
                s.lease.release()
                s.lease = None

    def start(self, group: Group) -> None:
        """The group is prefilled: its requests take the next rows."""
        for s in group.states:
            if not s.finished:
                s.status = "running"
                self.running.append(s)

    def finish(self, state: RequestState, reason: str) -> None:
        """End a request (its own rules decided `reason`, or an abort) and free its pages now: a step still in
        flight that reads or writes them runs before any later use of them on the same stream, and its row
        generates nothing once `prune` has refilled the rows."""
        if state.finished:
            return
        state.finish_reason = state.finish_reason or reason
        state.status = "finished"
        state.finish_s = time.perf_counter()
        if state.lease is not None:
            state.lease.release()
            state.lease = None

    def abort(self, state: RequestState) -> bool:
        """-> False when it had already finished."""
        if state.finished:
            return False
        self.finish(state, "abort")      # a waiting one leaves its group when the group comes up
        return True

    def prune(self) -> bool:
        """Drop finished requests from the running set. -> whether the rows changed."""
        kept = [s for s in self.running if not s.finished]
        changed = len(kept) != len(self.running)
        for s in self.running:
            if s.finished:
                s.row = None
        self.running = kept
        return changed

    def has_work(self) -> bool:
        return bool(self.waiting) or any(not s.finished for s in self.running)
