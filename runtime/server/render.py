"""Chat messages -> a RAG `Request` (prefix, documents, query), rendered with the model's own chat template
(docs/SPEC.md section 7).

The template is rendered once with the conversation up to the last user message and, as that message's content,
a marker that occurs nowhere else; the text is split at the marker. What comes before it is the prefix (the
system message, earlier turns, the last user turn's header: the template's own special tokens included); what
comes after it (the end of the user turn, the assistant header of the generation prompt) closes the query. The
documents go between the two, inside the last user turn, and the query is

    SEPARATOR + last user message + the template's text after the marker        (SEPARATOR only with documents)

so a request without documents is exactly the template's rendering of the conversation. A document's text is
used exactly as it was indexed (its token ids must hash to the index's content_hash), so nothing is inserted
between documents. Renders are cached per conversation prefix (the system message and earlier turns), which
RAG traffic repeats.
"""
from __future__ import annotations

import functools
from typing import Sequence

from ..request import Request

from .errors import bad_request

# Between the last document and the user's message.
SEPARATOR = "\n\n"
_MARKER = "\u2063SIFTQUERY\u2063"   # invisible separators around a word: no template or text produces it
_ROLES = ("system", "developer", "user", "assistant")


class ChatRenderer:
    """Renders conversations for one tokenizer (its `chat_template`)."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request("the served model's tokenizer has no chat template: use /v1/completions",
                              "messages", "no_chat_template")
        self.tokenizer = tokenizer
        # The engine tokenises the prefix with the tokenizer's special tokens (SPEC section 4). Where those
        # include a BOS that the template also writes, the template's copy is dropped, so the prompt holds one.
        bos = tokenizer.bos_token
        ids = tokenizer("a", add_special_tokens=True).input_ids
        self._strip_bos = bos if bos and ids and ids[0] == tokenizer.bos_token_id else None

    @functools.lru_cache(maxsize=1024)
    def split(self, history: tuple[tuple[str, str], ...]) -> tuple[str, str]:
        """The template around the last user message after `history` -> (prefix, text after the message)."""
        messages = [{"role": r, "content": c} for r, c in history] + [{"role": "user", "content": _MARKER}]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template rejecting a conversation (e.g. roles out of order)
            raise bad_request(f"the model's chat template refused the messages: {e}", "messages") from None
        if text.count(_MARKER) != 1:
            raise bad_request("the model's chat template does not place the last user message once",
                              "messages", "no_chat_template")
        before, _, after = text.partition(_MARKER)
        if self._strip_bos and before.startswith(self._strip_bos):
            before = before[len(self._strip_bos):]
        return before, after

    def request(self, messages: Sequence[tuple[str, str | None]], docs: Sequence[tuple[str, str]]) -> Request:
        """messages: (role, content), the last one the user's question; docs: (doc_id, text) in prompt order."""
        for i, (role, content) in enumerate(messages):
            if role not in _ROLES:
                raise bad_request(f"messages[{i}].role {role!r} must be one of {', '.join(_ROLES)}",
                                  f"messages[{i}].role")
            if content is None:
                raise bad_request(f"messages[{i}] has no content", f"messages[{i}].content", "missing_field")
        role, query = messages[-1]
        if role != "user":
            raise bad_request(f"the last message is from {role!r}: it must be the user's question",
                              f"messages[{len(messages) - 1}].role")
        prefix, after = self.split(tuple((r, c) for r, c in messages[:-1]))
        return Request(prefix=prefix, docs=list(docs), query=(SEPARATOR if docs else "") + query + after)
