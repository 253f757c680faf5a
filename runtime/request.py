"""A request as the engine sees it: the prompt a caller gives (`Request`), what the caller gets back after each
step (`RequestOutput`), and the state the scheduler keeps for it between steps (`RequestState`), with its text
built incrementally from the generated ids and cut at stop strings (`OutputText`)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .modes import Mode
from .sampling import SamplingParams

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class Request:
    """One RAG prompt: prefix (system prompt), retrieved documents as (doc_id, text), query."""

    prefix: str
    docs: Sequence[tuple[str, str]]
    query: str


@dataclass(frozen=True)
class RequestOutput:
    """One request after a step. token_ids: every id generated so far (the eos or stop token that ended it
    included); text: their text (special tokens skipped, the ending stop token or stop string and what follows
    it excluded; while the request runs, the last characters that could still begin a stop string are held
    back); finish_reason: None while it runs, then "stop" (eos, a stop token id or a stop string), "length"
    (max_tokens reached) or "abort"; prompt_tokens: the prompt's token count; tile_fraction: attention tiles its
    prefill computed over the dense causal count (of the group prefilled with it; None before its prefill)."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    prompt_tokens: int = 0
    tile_fraction: float | None = None


class OutputText:
    """Incremental detokenisation of one request's output: each new id decodes a short window of the ids before
    it (TGI's prefix / read offsets: a tokenizer that merges bytes or strips a leading space decodes the window
    as it would the whole), and stop strings are searched in the new text only."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self._prefix = self._read = 0
        self._hold = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def append(self, token: int) -> bool:
        """Add one id to the text; True when a stop string now ends it (the text is cut before it)."""
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):   # an incomplete character: wait for more ids
            return False
        start = len(self.text)
        self.text += now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        if self.stop:
            at = self._find_stop(max(0, start - self._hold))
            if at is not None:
                self.text, self.stopped = self.text[:at], True
        return self.stopped

    def _find_stop(self, start: int) -> int | None:
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def final(self) -> str:
        """The whole text decoded at once (what the incremental text converges to), cut at the first stop
        string when one ended the request."""
        text = self._decode(self.ids)
        if self.stopped:
            at = next((i for i in sorted(text.find(s) for s in self.stop) if i >= 0), None)
            text = text[:at] if at is not None else self.text
        return text

    def visible(self) -> str:
        """The text a running request shows: without the characters that could begin a stop string."""
        return self.text[:len(self.text) - self._hold] if self._hold else self.text


@dataclass(eq=False)
class RequestState:
    """Everything the scheduler knows of one request between steps; it alone creates and changes it.

    segments: the prompt as (kind, token ids); stop_ids: the eos ids and the params' stop_token_ids; key: the
    sampler's hash key from the seed; group: the requests admitted (and prefilled) with it; lease: its pages in
    the KV pool (documents pinned, its own blocks, its generation pages), held from admission to finish;
    need: the pages it takes when admitted (runtime/plan.py `PageNeed`); table: its decode block table (device
    int32 pages and kv offsets of its prompt blocks, then of its generation pages, and None or, in mode "ape",
    int32 flags of the entries that are reused documents' pages); gen_pages_row: device int64,
    its generation pages padded to the decode batch's width; row: its row in the decode batch while it runs;
    launched: tokens the device will have drawn once the launched steps complete."""

    request_id: str
    request: Request
    params: SamplingParams
    mode: Mode
    segments: list
    stop_ids: tuple[int, ...]
    key: int
    text: OutputText
    n_prompt: int = 0
    need: object = None
    group: object = None
    lease: object = None
    table: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
    gen_pages_row: torch.Tensor | None = None
    row: int | None = None
    status: str = "waiting"           # "waiting" | "running" | "finished"
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    launched: int = 0
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finish_s: float | None = None
    latest: RequestOutput | None = None
    tiles: tuple | None = None          # (tiles its prefill computed, on their way to the host; the dense count)
    tile_fraction: float | None = None

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    def output(self) -> RequestOutput:
        text = self.text.final() if self.finished else self.text.visible()
        if self.tile_fraction is None and self.tiles is not None and self.token_ids:
            computed, dense = self.tiles      # copied when the prefill was planned: no wait once it has run
            self.tile_fraction = computed.values()[0] / dense if dense else 0.0
        out = RequestOutput(self.request_id, list(self.token_ids), text, self.finished, self.finish_reason,
                            self.n_prompt, self.tile_fraction)
        self.latest = out
        return out

    def accept(self, token: int) -> bool:
        """One generated token from the device: append it and apply the stop rules in the order the device
        applies them (a stop id, then the length) and then the stop strings. True when it finished the request
        (the device stops the row at the same token, except for stop strings, which it does not see)."""
        if self.finished:
            return False            # a token of a step launched before the host saw the end: discarded
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter()
        self.token_ids.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif self.text.append(token):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None
