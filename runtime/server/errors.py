"""HTTP errors with OpenAI's error body, and the engine's `SiftError`s turned into them.

Every error a client can cause is a 400 whose body names the problem the way OpenAI's API does:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "documents", "code": "stale_document"}}

`param` names the request field at fault and `code` the kind of problem, so a client can act on an error
without parsing its message. Overload is a 503 with `Retry-After`, a request past the server's timeout a 504, a
failure of the server itself a 500 (its message one line, never a traceback).
"""
from __future__ import annotations

import re

from sift.errors import SiftError, one_line


class ApiError(Exception):
    """An HTTP error: status, one-line message, OpenAI's `type`, the field at fault (`param`) and a `code`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


class Overloaded(Exception):
    """A replica's queue is full; retry_after_s: when a retry is likely to be admitted."""

    def __init__(self, waiting: int, retry_after_s: int):
        super().__init__(f"the server is overloaded ({waiting} requests waiting): retry after {retry_after_s} s")
        self.waiting, self.retry_after_s = waiting, retry_after_s


class RequestTimeout(Exception):
    """A request ran past the server's per-request timeout and was aborted."""


# The engine's refusals of a request, by the start of their message (runtime/engine.py, runtime/store.py,
# runtime/sampling.py): -> (param, code). The prompt field is filled in per endpoint.
_ENGINE_REFUSALS = [
    (r"document '.*' is not in index|unknown document|not in the index", "documents", "document_not_found"),
    (r"stale index", "documents", "stale_document"),
    (r"document '.*' has no tokens", "documents", "empty_document"),
    (r".*more than the model's context|.*exceeds the model's sliding window", "<prompt>", "context_length_exceeded"),
    (r"request \d+ has no tokens", "<prompt>", "empty_prompt"),
    (r"request \d+ spans \d+ blocks", "documents", "too_many_documents"),
    (r"SamplingParams (\w+)=", None, "invalid_value"),
    (r"mode=", "sift_mode", "invalid_value"),
    (r".*(pages|KV pool|hbm_bytes)", None, "kv_capacity_exceeded"),
]


def from_sift_error(exc: SiftError, prompt_param: str) -> ApiError:
    """A SiftError the engine raised for one request -> its 400 (param and code from the kind of refusal)."""
    message = one_line(exc)
    for pattern, param, code in _ENGINE_REFUSALS:
        m = re.match(pattern, message)
        if m:
            if param is None and m.groups():
                param = m.group(1)
            return bad_request(message, prompt_param if param == "<prompt>" else param, code)
    return bad_request(message, None, None)
