"""One engine replica: continuous batching over the engine's step API, fed by asyncio endpoints.

    EngineWorker(engine, mode=...)      starts the loop thread
    async for chunk in worker.generate(call): ...
    worker.snapshot()                   queue depth, running requests, the KV store's and the index's counters
    worker.warm_documents()             the routing keys of the documents the KV store holds (routing.py)

Threads. One loop thread drives `engine.step()` (prefill of newly admitted requests, one decode step of every
running one) and hands each request's output to the asyncio loop of the endpoint waiting for it
(`loop.call_soon_threadsafe` into the request's asyncio queue); it sleeps while the engine has nothing to do.
`engine.add_request` runs on one admission thread (it tokenises and validates: a bad request is refused there,
before it costs the loop anything), so neither the event loop nor the step loop waits for tokenisation.
Admission into the running batch is the engine's (by KV pages: a request runs once its pages are leased).

Bounds. At most `max_queue` requests wait (added, no token yet); past that a request is refused at once with
`Overloaded` (HTTP 503, `Retry-After` from the recent completion rate). A request past `call.timeout_s`, or whose
client went away (the endpoint's generator is closed or cancelled), is aborted: `engine.abort`, which ends it
and returns its pages to the pool at the next step.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field

from sift.errors import SiftError
from ..request import Request

from .errors import Overloaded, RequestTimeout
from .protocol import Call, Chunk

log = logging.getLogger("sift.serve")

# Routing keys of documents this replica served, remembered to report which of them its store still holds.
_KNOWN_DOCS = 100_000
_TIMED_OUT = object()       # put in a request's queue when it runs past its timeout
# How long the loop thread waits at most, after a step that produced first tokens, for their endpoints to take
# them (see EngineWorker._run).
FIRST_CHUNK_WAIT_S = 0.002


@dataclass(eq=False)
class _Stream:
    """One request's channel from the loop thread to its endpoint."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    t_add: float
    state: str = "waiting"              # "waiting" (no token yet) | "running" | "done"
    sent_text: int = 0                  # characters of the output's text already handed on
    sent_ids: int = 0
    taken: threading.Event = field(default_factory=threading.Event)   # the endpoint took its first item

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:            # the endpoint's event loop has closed (server shutting down)
            pass


@dataclass
class _Counters:
    finished: int = 0
    aborted: int = 0
    timed_out: int = 0
    rejected: int = 0
    failed: int = 0
    completions: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))


class EngineWorker:
    """Drives `engine` (a SiftEngine) from one loop thread.

    mode: the engine mode of calls that name none; max_queue: requests that may wait for admission;
    replica: this replica's name in chunks and metrics."""

    def __init__(self, engine, *, mode: str = "sift", max_queue: int = 64, replica: str = "0"):
        if max_queue < 1:
            raise SiftError(f"max_queue={max_queue} must be >= 1")
        self.engine, self.mode, self.max_queue, self.replica = engine, mode, max_queue, replica
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = False
        self._step_error: BaseException | None = None
        self._counts = _Counters()
        self._known: collections.OrderedDict[str, str] = collections.OrderedDict()   # routing key -> store key
        self._unkeyed: dict[str, str] = {}        # routing key -> text, store key not computed yet
        self._reporting = False                   # whether warm_documents was called (a router reads this worker)
        self._admit = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sift-admit")
        self._thread = threading.Thread(target=self._run, name="sift-engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------ endpoint side

    async def generate(self, call: Call):
        """Yield the request's `Chunk`s as the engine produces them. Raises SiftError (a bad request),
        Overloaded or RequestTimeout; closing or cancelling the generator aborts the request."""
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), time.perf_counter())
        with self._lock:
            waiting = sum(s.state == "waiting" for s in self._streams.values())
            if waiting >= self.max_queue:
                self._counts.rejected += 1
                raise Overloaded(waiting, self._retry_after(waiting))
            if call.id in self._streams:
                raise SiftError(f"request id {call.id!r} is already in use")
            self._streams[call.id] = stream     # before the engine can produce its first output
        deadline = stream.t_add + call.timeout_s
        added = loop.run_in_executor(self._admit, self._add, call, stream)
        try:
            await asyncio.shield(added)
        except asyncio.CancelledError:
            # the client left while the request was being added: abort it once it is in
            added.add_done_callback(lambda f: f.cancelled() or f.exception() or self.abort(call.id))
            raise
        done = False
        # One timer for the whole request rather than a timeout per chunk: the endpoint awaits its queue
        # directly, so a chunk handed over by the loop thread resumes it in the event loop's next iteration.
        timer = loop.call_later(max(deadline - time.perf_counter(), 0.0), stream.queue.put_nowait, _TIMED_OUT)
        try:
            while True:
                item = await stream.queue.get()
                if not stream.taken.is_set():
                    stream.taken.set()      # the loop thread goes on (_run)
                if item is _TIMED_OUT:
                    with self._lock:
                        self._counts.timed_out += 1
                    raise RequestTimeout(f"the request ran past the server's timeout of {call.timeout_s:g} s "
                                         f"and was aborted")
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            timer.cancel()
            if not done:
                self.abort(call.id)
            self._remember_docs(call)

    def _add(self, call: Call, stream: _Stream) -> None:
        """Admission thread: the engine validates, tokenises and queues the request."""
        try:
            self.engine.add_request(call.request, call.params, mode=call.mode, request_id=call.id)
        except BaseException:
            with self._lock:
                self._streams.pop(call.id, None)
            raise
        self._wake.set()

    def abort(self, rid: str) -> None:
        """Abort request `rid` now (thread-safe): it ends at the engine's next step, which frees its pages. A
        finished request is left alone."""
        with self._lock:
            stream = self._streams.pop(rid, None)
            if stream is None:
                return                  # finished before the abort
            stream.state = "done"
            self._counts.aborted += 1
        try:
            self.engine.abort(rid)
        except SiftError:
            pass                        # its add_request had failed: it never entered the engine
        self._wake.set()

    def _retry_after(self, waiting: int) -> int:
        """Seconds until the queue has likely drained enough: waiting requests over the recent completion rate."""
        done = self._counts.completions
        if len(done) < 2 or done[-1] <= done[0]:
            return 1
        rate = (len(done) - 1) / (done[-1] - done[0])
        return max(1, min(60, math.ceil(waiting / rate)))

    # -------------------------------------------------------------------------------------- loop thread

    def _run(self) -> None:
        engine = self.engine
        while not self._stop:
            self._wake.clear()
            if not engine.has_unfinished():
                self._wake.wait(timeout=1.0)
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - a prefill failed: its requests end (next step), others go on
                log.exception("engine step failed")
                self._step_error = e
                continue
            now = time.perf_counter()
            firsts = [stream for out in outputs if (stream := self._deliver(out, now)) is not None]
            # A first token goes out before the next step's host work: right after a step the loop thread runs
            # Python (it launches the next decode step), and the event loop, woken to send the token, would wait
            # for the GIL until a switch interval forced it over. So the loop thread waits (bounded) until the
            # endpoints took their first chunks; the decode step launched by this one runs on the device meanwhile.
            deadline = now + FIRST_CHUNK_WAIT_S
            for stream in firsts:
                stream.taken.wait(max(deadline - time.perf_counter(), 0.0))

    def _deliver(self, out, now: float) -> _Stream | None:
        """Hand `out` to its endpoint -> its stream when this was the request's first token."""
        with self._lock:
            stream = self._streams.get(out.request_id)
            if stream is None:
                return None             # aborted by its endpoint; the engine's "abort" output needs no one
            if stream.state == "waiting":
                stream.state = "running"
                engine_ttft = now - stream.t_add
            else:
                engine_ttft = None
            if out.finished:
                stream.state = "done"
                del self._streams[out.request_id]
                if out.finish_reason == "abort":
                    self._counts.failed += 1
                else:
                    self._counts.finished += 1
                    self._counts.completions.append(now)
        if out.finished and out.finish_reason == "abort":
            # the engine ended it without being asked: its prefill failed
            stream.put(self._step_error or RuntimeError("the engine aborted the request"))
            return None
        text = out.text[stream.sent_text:] if len(out.text) > stream.sent_text else ""
        ids = tuple(out.token_ids[stream.sent_ids:])
        stream.sent_text, stream.sent_ids = max(stream.sent_text, len(out.text)), len(out.token_ids)
        stream.put(Chunk(text=text, token_ids=ids, finished=out.finished, finish_reason=out.finish_reason,
                         prompt_tokens=out.prompt_tokens, completion_tokens=len(out.token_ids),
                         replica=self.replica, engine_ttft_s=engine_ttft,
                         tile_fraction=out.tile_fraction if engine_ttft is not None else None))
        return stream if engine_ttft is not None else None

    # --------------------------------------------------------------------------------------- reporting

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def load(self) -> tuple[int, int]:
        """(waiting, running) requests."""
        with self._lock:
            states = [s.state for s in self._streams.values()]
        return states.count("waiting"), states.count("running")

    def snapshot(self) -> dict:
        """What /metrics reports of this replica: its queue, its counters, its KV store's and index's stats."""
        waiting, running = self.load()
        c = self._counts
        index = self.engine.index
        return dict(replica=self.replica, pid=os.getpid(), waiting=waiting, running=running, finished=c.finished,
                    aborted=c.aborted, timed_out=c.timed_out, rejected=c.rejected, failed=c.failed,
                    store=self.engine.kv_store.stats(), index=index.stats() if index is not None else {})

    def _remember_docs(self, call: Call) -> None:
        """Keep the routing keys (and texts, keyed later) of a request's documents, once a router has asked which
        documents are warm: a worker no router reads (`sift-serve --replicas 0`) neither hashes nor holds them."""
        if not self._reporting or not call.request.docs:
            return
        with self._lock:
            for key, (_, text) in zip(call.doc_keys, call.request.docs):
                if key in self._known:
                    self._known.move_to_end(key)
                else:
                    self._unkeyed[key] = text

    def warm_documents(self) -> list[str]:
        """Routing keys of the documents whose KV this replica's store holds (either tier). Store keys of newly
        served documents are computed here, off the request path (it tokenises them)."""
        store = self.engine.kv_store
        self._reporting = True
        with self._lock:
            new, self._unkeyed = self._unkeyed, {}
        keyed = {}
        for key, text in new.items():
            (_, ids), = [s for s in self.engine.tokenize(Request("", [("d", text)], "")) if s[0] == "doc"]
            keyed[key] = self.engine.ctx.doc_key(ids)
        with self._lock:
            self._known.update(keyed)
            while len(self._known) > _KNOWN_DOCS:
                self._known.popitem(last=False)
            known = list(self._known.items())
        return [k for k, store_key in known if store_key in store]

    def close(self, timeout_s: float = 10.0) -> None:
        """Abort whatever is still in the engine, let the loop return its pages, stop the loop thread."""
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            self.abort(rid)
        deadline = time.monotonic() + timeout_s
        while self.alive and self.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._admit.shutdown(wait=False, cancel_futures=True)
