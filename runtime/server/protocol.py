"""The OpenAI-compatible API: request bodies in, the engine's `Call` out; the engine's chunks back to OpenAI's
JSON (plain) and server-sent events (streaming).

    POST /v1/completions        prompt (the query), optional "prefix" (the system part), "documents"
    POST /v1/chat/completions   messages rendered with the model's chat template (runtime/server/render.py)

Both take OpenAI's sampling fields (`max_tokens`, `temperature`, `top_p`, `seed`, `stop`; `top_k` and
`stop_token_ids` as vLLM does) and two of SIFT's, which the `openai` client sends through `extra_body`:
`documents`, a list of `{"id": ..., "text": ...}` (the retrieved documents, in prompt order, ids as the index
knows them), and `sift_mode`, the engine mode of this request (`sift`, `dense`, `reuse`,
`hybrid[:policy][@fraction]`; the server's `--mode` when absent). Fields OpenAI defines but the server cannot
honour (`n` > 1, `logprobs`, `echo`, penalties, `logit_bias`, tools) are refused with a 400 naming them rather
than ignored; fields the server does not know are ignored, as OpenAI-compatible servers do.
"""
from __future__ import annotations

import functools
import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator

from sift.errors import SiftError, one_line, root_cause
from ..request import Request
from ..sampling import SamplingParams

from .errors import ApiError, Overloaded, RequestTimeout, bad_request, from_sift_error

MAX_STOP = 4                     # OpenAI's limit on stop sequences
Number = Annotated[float, Field(strict=True)]   # an int or a float, never a string or a bool


def doc_key(text: str) -> str:
    """The routing key of a document: a hash of its text, which fixes its token ids and so its KV store entry
    (runtime/server/routing.py)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


@dataclass(frozen=True)
class Call:
    """One generation as the ingress hands it to an engine replica (picklable: it crosses Ray's object store).
    timeout_s: the server's per-request timeout."""

    id: str
    request: Request
    params: SamplingParams
    mode: str
    timeout_s: float

    @functools.cached_property
    def doc_keys(self) -> tuple[str, ...]:
        """`doc_key` of each document, read by the router. Hashed when first read (by the router, before the
        call leaves the ingress, and pickled with it), so a server without a router never hashes on a request's
        way to its first token."""
        return tuple(doc_key(text) for _, text in self.request.docs)


@dataclass(frozen=True)
class Parsed:
    """A validated request: the call, the endpoint it came to ("chat" | "completion"), the model name it asked
    for, and how to answer (stream, include_usage)."""

    call: Call
    kind: str
    model: str
    stream: bool
    include_usage: bool


# ------------------------------------------------------------------------------------------ request bodies


class Document(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: StrictStr = Field(min_length=1)
    text: StrictStr = Field(min_length=1)


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Body(BaseModel):
    """Fields common to both endpoints. Defaults are OpenAI's (temperature 1, top_p 1)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: Any = None
    stop_token_ids: list[StrictInt] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    documents: list[Document] = []
    sift_mode: StrictStr | None = None
    # OpenAI fields the server cannot honour: refused unless they carry their neutral value.
    n: StrictInt | None = None
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: Any = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return ()
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop holds {len(stops)} sequences: give at most {MAX_STOP}")
        return tuple(stops)

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for every field set to something the server cannot do."""
        out = []
        if self.n not in (None, 1):
            out.append(("n", "only n=1 is served: send one request per completion"))
        if self.logprobs not in (None, False, 0):
            out.append(("logprobs", "log probabilities are not returned"))
        if self.top_logprobs not in (None, 0):
            out.append(("top_logprobs", "log probabilities are not returned"))
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                out.append((name, "penalties are not applied"))
        if self.logit_bias not in (None, {}):
            out.append(("logit_bias", "logit biases are not applied"))
        return out


class CompletionBody(_Body):
    prompt: Any
    prefix: StrictStr = ""
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
            return v[0]
        if not isinstance(v, str):
            raise ValueError("prompt must be a string (one prompt per request; token id prompts are not served)")
        return v

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.echo:
            out.append(("echo", "the prompt is not echoed"))
        if self.best_of not in (None, 1):
            out.append(("best_of", "only best_of=1 is served"))
        if self.suffix:
            out.append(("suffix", "insertion (suffix) is not served"))
        return out


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: StrictStr
    content: Any = None

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        """A string, or OpenAI's list of content parts of which only text parts are served."""
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            texts = []
            for part in v:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("content parts must be {\"type\": \"text\", \"text\": ...} (only text is served)")
                texts.append(part["text"])
            return "".join(texts)
        raise ValueError("content must be a string or a list of text parts")


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    tools: Any = None
    response_format: Any = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.tools:
            out.append(("tools", "tool calls are not served"))
        if self.response_format not in (None, {"type": "text"}):
            out.append(("response_format", "only text responses are served"))
        return out


def _param(loc) -> str:
    """pydantic's error location -> OpenAI's `param`, e.g. ("documents", 2, "text") -> "documents[2].text"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _validate(model: type[BaseModel], body: bytes | dict) -> BaseModel:
    """The request body (its raw bytes: parsed and validated in one pass by pydantic's JSON parser, or a dict)
    -> the model, or a 400 naming the field at fault."""
    try:
        if isinstance(body, (bytes, bytearray, str)):
            return model.model_validate_json(body)
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = _param(err["loc"])
        reason = err["msg"].removeprefix("Value error, ")
        if err["type"] == "json_invalid":
            raise bad_request(f"the request body is not valid JSON: {reason}", None, "invalid_json") from None
        if err["type"] == "model_type" and not err["loc"]:
            raise bad_request("the request body must be a JSON object", None, "invalid_json") from None
        if err["type"] == "missing":
            raise bad_request(f"missing required field {param!r}", param, "missing_field") from None
        raise bad_request(f"invalid {param!r}: {reason}", param) from None


# -------------------------------------------------------------------------------------- body -> engine call


@dataclass(frozen=True)
class ServerDefaults:
    """What a request gets when it leaves a field out, and the server's limits."""

    mode: str
    max_tokens_completion: int = 16        # OpenAI's default for /v1/completions
    max_tokens_chat: int = 256             # chat's default (OpenAI: up to the context; pages are reserved here)
    timeout_s: float = 600.0


def _sampling(body: _Body, max_tokens: int | None, default_max: int) -> SamplingParams:
    for field, why in body.unsupported():
        raise bad_request(f"{field!r} is not supported: {why}", field, "unsupported_field")
    try:
        return SamplingParams(
            max_tokens=default_max if max_tokens is None else max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k, seed=body.seed, stop=body.stop,
            stop_token_ids=tuple(body.stop_token_ids or ()))
    except SiftError as e:
        raise from_sift_error(e, "prompt") from None


def _call(body: _Body, request: Request, params: SamplingParams, defaults: ServerDefaults, prefix: str) -> Call:
    return Call(id=f"{prefix}-{uuid.uuid4().hex}", request=request, params=params,
                mode=body.sift_mode or defaults.mode, timeout_s=defaults.timeout_s)


def parse_completion(body: bytes | dict, defaults: ServerDefaults) -> Parsed:
    b = _validate(CompletionBody, body)
    params = _sampling(b, b.max_tokens, defaults.max_tokens_completion)
    request = Request(prefix=b.prefix, docs=[(d.id, d.text) for d in b.documents], query=b.prompt)
    return Parsed(_call(b, request, params, defaults, "cmpl"), "completion", b.model, b.stream,
                  bool(b.stream_options and b.stream_options.include_usage))


def parse_chat(body: bytes | dict, defaults: ServerDefaults, renderer) -> Parsed:
    b = _validate(ChatBody, body)
    if b.max_tokens is not None and b.max_completion_tokens is not None and b.max_tokens != b.max_completion_tokens:
        raise bad_request("max_tokens and max_completion_tokens differ: give one of them", "max_completion_tokens")
    params = _sampling(b, b.max_completion_tokens if b.max_tokens is None else b.max_tokens,
                       defaults.max_tokens_chat)
    request = renderer.request([(m.role, m.content) for m in b.messages], [(d.id, d.text) for d in b.documents])
    return Parsed(_call(b, request, params, defaults, "chatcmpl"), "chat", b.model, b.stream,
                  bool(b.stream_options and b.stream_options.include_usage))


# ------------------------------------------------------------------------------------------------ responses


@dataclass(frozen=True)
class Chunk:
    """What a replica yields per engine step of one request. text / token_ids: new since the previous chunk;
    finish_reason: set on the last chunk ("stop" | "length" | "abort"); prompt_tokens: the prompt's length;
    completion_tokens: generated so far; replica: which replica served it; engine_ttft_s: the engine's own
    time to first token (add_request to the first token), set on the first chunk."""

    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    replica: str
    engine_ttft_s: float | None = None
    tile_fraction: float | None = None


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(parsed: Parsed, model: str, text: str, last: Chunk) -> dict:
    """The whole (non-streaming) response of OpenAI's API."""
    created = int(time.time())
    if parsed.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": last.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
        obj = "text_completion"
    return {"id": parsed.call.id, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage(last.prompt_tokens, last.completion_tokens), "system_fingerprint": None}


class EventStream:
    """The server-sent events of one streaming response: `data: {chunk JSON}` per event, `data: [DONE]` last."""

    def __init__(self, parsed: Parsed, model: str):
        self.parsed, self.model, self.created = parsed, model, int(time.time())
        self.obj = "chat.completion.chunk" if parsed.kind == "chat" else "text_completion"
        self.started = False

    def _event(self, choices: list, extra: dict | None = None) -> bytes:
        payload = {"id": self.parsed.call.id, "object": self.obj, "created": self.created, "model": self.model,
                   "choices": choices, "system_fingerprint": None, **(extra or {})}
        return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"

    def events(self, chunk: Chunk) -> list[bytes]:
        """The events of one chunk: its text (if any, and the assistant role first in chat), its finish reason,
        and after the last one the usage (when asked for)."""
        out = []
        chat = self.parsed.kind == "chat"
        if chat and not self.started:
            out.append(self._event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]))
        self.started = True
        if chunk.text or chunk.finished:
            reason = chunk.finish_reason if chunk.finished else None
            if chat:
                delta = {"content": chunk.text} if chunk.text else {}
                out.append(self._event([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]))
            else:
                out.append(self._event([{"index": 0, "text": chunk.text, "logprobs": None, "finish_reason": reason}]))
        if chunk.finished and self.parsed.include_usage:
            out.append(self._event([], {"usage": usage(chunk.prompt_tokens, chunk.completion_tokens)}))
        return out

    @staticmethod
    def error(err: ApiError) -> bytes:
        return b"data: " + json.dumps(err.body()).encode() + b"\n\n"

    DONE = b"data: [DONE]\n\n"


def error_of(exc: BaseException, kind: str = "completion") -> ApiError:
    """Any failure of a request to endpoint `kind` -> its HTTP error (an ApiError as it is)."""
    cause = root_cause(exc)
    if isinstance(cause, ApiError):
        return cause
    if isinstance(cause, SiftError):
        return from_sift_error(cause, "messages" if kind == "chat" else "prompt")
    if isinstance(cause, Overloaded):
        return ApiError(503, str(cause), type="server_error", code="overloaded",
                        headers={"Retry-After": str(cause.retry_after_s)})
    if type(cause).__name__ in ("BackPressureError", "DeploymentUnavailableError"):
        return ApiError(503, f"the server is overloaded: {one_line(cause)}", type="server_error", code="overloaded",
                        headers={"Retry-After": "1"})
    if isinstance(cause, RequestTimeout):
        return ApiError(504, str(cause), type="server_error", code="timeout")
    return ApiError(500, f"internal error: {one_line(cause)}", type="server_error", code="internal_error")
