"""Request migration, the stream side (pure): what a relayed stream has given the client so far,
and continuation chunks made to look like the rest of the same answer. For a client that asked
for a whole answer, the stream its decode sends is read the same way and nothing is relayed:
the ledger puts the answer together (`whole_answer`) once the stream ends.

With migration on, the relay forwards whole SSE events only (a partial event at a cut never
reaches the client) and reads each one just enough to keep the continuation's inputs: the
prompt's token ids, the output's token ids, the tail of the text sent (for stop strings that
span the cut), whether the answer finished. Token ids the client did not ask for are removed.

A continuation is a completions stream (migration_plan.py): its chunks get the original id,
`created`, model and object, chat shape for a chat answer, text offsets and usage counted from
the start of the original answer, and its stop strings are checked over the cut.
"""

from __future__ import annotations

from typing import Any

import orjson

SSE_DONE = b"data: [DONE]\n\n"
_DATA = b"data: "
_EVENT_END = b"\n\n"


class MalformedStream(Exception):
    """The upstream stream broke its shape: an event that is not JSON, or one too large."""


class StreamLedger:
    """One streamed answer's relay state across its decode legs (one choice: see
    migration_plan.migration_refusal)."""

    def __init__(
        self,
        chat: bool,
        client_wants_ids: bool,
        include_usage: bool,
        max_event_bytes: int,
        whole: bool = False,
    ) -> None:
        self.chat = chat
        self.whole = whole
        self._client_wants_ids = client_wants_ids
        self._strip_ids = not client_wants_ids and not whole  # a whole answer's chunks stay here
        self._include_usage = include_usage
        self._max_event = max_event_bytes
        self._buffer = b""
        self.prompt_ids: list[int] | None = None
        self.generated: list[int] = []
        self.chars_sent = 0  # text characters the client has
        # A clean cut: output tokens whose text the client has in full, and that text's length.
        # vLLM sends no text for a token that ends inside a UTF-8 character (nor for tokens
        # after it) until one completes it, and a continuation whose prompt ends inside one
        # gets the whole prompt's text as its first text (the tokenizers library's stream
        # decoder). A chunk of one token with text ends cleanly; a chunk of several may end
        # with tokens still pending, so it moves the clean cut only if it holds one token.
        self._settled = 0
        self._settled_chars = 0
        # Completions logprobs: the text_offset the client's next token gets. vLLM counts it
        # over the reported tokens' strings, not the text sent: a special token adds its
        # string's length and no text, and stop-string text lags the tokens.
        self._next_offset = 0
        self._settled_offset = 0
        self.finished = False  # the choice's finish_reason went out
        self.done = False  # [DONE] went out
        self.migratable = True  # false once a tool call or reasoning went out
        # An upstream that sends no token ids (not vLLM, or one too old) cannot be continued:
        # its stream is relayed as it comes, watched only for its [DONE].
        self._passthrough = False
        self._tail = b""
        self.migrations = 0
        # A replayed continuation (migration_plan.continuation) regenerates what the client
        # has: that many token ids and characters of it are not sent again.
        self._skip_ids = 0
        self._skip_chars = 0
        self._offset_shift = 0
        self._id: Any = None
        self._created: Any = None
        self._model: Any = None
        self._before_cut = 0  # tokens generated before the current continuation
        # A whole answer's parts, as the client will get them.
        self._texts: list[str] = []
        self._reasoning: list[str] = []
        self._reasoning_field = "reasoning"
        self._logprobs: dict[str, list[Any]] | None = None
        self._finish: Any = None
        self._stop_reason: Any = None
        self.error: Any = None  # the instance's own error event
        self._whole_bytes = 0

    # -- relaying --------------------------------------------------------------------------

    def feed(self, data: bytes) -> bytes:
        """The whole events of `data` (after what was buffered) as the client gets them."""
        if self._passthrough:
            return self._relayed(data)
        if self.whole:  # kept here until it ends: bounded like a whole answer's body
            self._whole_bytes += len(data)
            if self._whole_bytes > self._max_event:
                self.migratable = False  # a continuation would only add to it
                raise MalformedStream(
                    f"a whole answer's stream longer than {self._max_event} bytes"
                )
        buffer = self._buffer + data if self._buffer else data
        end = buffer.rfind(_EVENT_END)
        if end < 0:
            self._check_buffer(buffer)
            self._buffer = buffer
            return b""
        whole, self._buffer = buffer[: end + 2], buffer[end + 2 :]
        self._check_buffer(self._buffer)
        out = []
        events = whole.split(_EVENT_END)[:-1]
        for number, event in enumerate(events):
            if self.done:
                continue
            sent = self._event(event)
            if sent is not None:
                out.append(sent)
            if self._passthrough:  # the rest as it came
                rest = b"".join(e + _EVENT_END for e in events[number + 1 :]) + self._buffer
                out.append(self._relayed(rest))
                self._buffer = b""
                break
        return b"".join(out)

    def _relayed(self, data: bytes) -> bytes:
        if data:
            self._tail = (self._tail + data)[-len(SSE_DONE) :]
            self.done = self._tail == SSE_DONE
        return data

    def _check_buffer(self, buffer: bytes) -> None:
        if len(buffer) > self._max_event:
            raise MalformedStream(f"an event longer than {self._max_event} bytes")

    def _event(self, event: bytes) -> bytes | None:
        if not event.startswith(_DATA):
            return event + _EVENT_END  # a comment or another field: not ours to read
        data = event[len(_DATA) :]
        if data == b"[DONE]":
            self.done = True
            return SSE_DONE
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise MalformedStream("an event that is not JSON") from None
        if not isinstance(chunk, dict):
            raise MalformedStream("an event that is not a JSON object")
        if self.migrations:
            return self._continued(chunk)
        if self._id is None:
            self._id, self._created, self._model = (
                chunk.get("id"),
                chunk.get("created"),
                chunk.get("model"),
            )
        changed = self._record(chunk)
        if "error" in chunk:
            self.migratable = False  # the instance's own error event: relayed as it is
            self.error = chunk["error"]
        elif self.prompt_ids is None and not self.generated:
            self.migratable, self._passthrough = False, not self.whole
        if not changed:
            return event + _EVENT_END
        return _DATA + orjson.dumps(chunk) + _EVENT_END

    def _record(self, chunk: dict[str, Any]) -> bool:
        """Keep what a continuation needs from one chunk; whether the chunk was changed."""
        # Run for every event a migrating stream relays: see docs/performance.md.
        strip, changed = self._strip_ids, False
        top_prompt = chunk.get("prompt_token_ids")
        if top_prompt is not None:
            self.prompt_ids = _ids(top_prompt)
            if strip:
                del chunk["prompt_token_ids"]
                changed = True
        choices = chunk.get("choices")
        if type(choices) is not list:
            return changed
        for choice in choices:
            if type(choice) is not dict:
                continue
            if strip and ("token_ids" in choice or "prompt_token_ids" in choice):
                ids = choice.pop("token_ids", None)
                prompt = choice.pop("prompt_token_ids", None)
                changed = True
            else:
                ids, prompt = choice.get("token_ids"), choice.get("prompt_token_ids")
            if prompt is not None:
                self.prompt_ids = _ids(prompt)
            count = 0
            if ids is not None:
                self.generated.extend(_ids(ids))
                count = len(ids)
            if self.chat:
                delta = choice.get("delta")
                if type(delta) is not dict:
                    text = ""
                else:
                    text = delta.get("content") or ""
                    if (
                        delta.get("tool_calls")
                        or delta.get("reasoning_content")
                        or delta.get("reasoning")
                    ):
                        self.migratable = False
                        if self.whole:
                            self._collect_reasoning(delta)
            else:
                text = choice.get("text") or ""
                logprobs = choice.get("logprobs")
                if type(logprobs) is dict:
                    self._advance_offset(logprobs)
            if type(text) is not str:
                text = ""
            self._count_text(text, count, len(text))
            if self.whole:
                self._collect(text, choice.get("logprobs"), choice)
            if choice.get("finish_reason") is not None:
                self.finished = True
        return changed

    def _collect(self, text: str, logprobs: Any, choice: dict[str, Any]) -> None:
        """Keep a whole answer's part of one choice chunk."""
        if text:
            self._texts.append(text)
        if isinstance(logprobs, dict):
            if self._logprobs is None:
                self._logprobs = {k: [] for k, v in logprobs.items() if isinstance(v, list)}
            for key, values in self._logprobs.items():
                part = logprobs.get(key)
                if isinstance(part, list):
                    values.extend(part)
        finish = choice.get("finish_reason")
        if finish is not None:
            self._finish, self._stop_reason = finish, choice.get("stop_reason")

    def _collect_reasoning(self, delta: dict[str, Any]) -> None:
        for field in ("reasoning_content", "reasoning"):
            part = delta.get(field)
            if isinstance(part, str) and part:
                self._reasoning.append(part)
                self._reasoning_field = field

    def _count_text(self, upstream_text: str, upstream_tokens: int, sent_chars: int) -> None:
        self.chars_sent += sent_chars
        replaying = self._skip_ids or self._skip_chars  # not yet past what the client has
        if upstream_text and upstream_tokens == 1 and not replaying:
            self._settled, self._settled_chars = len(self.generated), self.chars_sent
            self._settled_offset = self._next_offset

    def _advance_offset(self, logprobs: dict[str, Any]) -> None:
        offsets, tokens = logprobs.get("text_offset"), logprobs.get("tokens")
        if type(offsets) is list and type(tokens) is list and offsets and tokens:
            last_offset, last_token = offsets[-1], tokens[-1]
            if type(last_offset) is int and type(last_token) is str:
                self._next_offset = last_offset + len(last_token)

    # -- migrating -------------------------------------------------------------------------

    def settled(self) -> list[int]:
        """The output ids a continuation goes on from: up to the last clean cut. The ids after
        them are generated again, and what the client has of their text is not sent twice."""
        return self.generated[: self._settled]

    def cut(self, replay: bool) -> None:
        """The current decode failed: what arrives next is a continuation's stream, which
        goes on after the settled ids, or (`replay`) starts from the prompt again."""
        self.migrations += 1
        self._buffer = b""
        if replay:
            self._skip_ids, self._skip_chars = len(self.generated), self.chars_sent
            self._offset_shift, self._before_cut = 0, 0
        else:
            self._skip_ids = len(self.generated) - self._settled
            self._skip_chars = self.chars_sent - self._settled_chars
            self._offset_shift, self._before_cut = self._settled_offset, self._settled

    def closing(self) -> bytes:
        """What ends a stream whose choice finished but whose upstream did not end it: the
        usage (if asked for) and [DONE]."""
        self.done = True
        if not self._include_usage:
            return SSE_DONE
        chunk = {
            "id": self._id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": [],
            "usage": self._usage(len(self.generated)),
        }
        return _DATA + orjson.dumps(chunk) + _EVENT_END + SSE_DONE

    def whole_answer(self) -> tuple[int, bytes]:
        """The status and JSON body a client that asked for no stream gets: the instance's own
        error, or the answer put together from every leg's chunks."""
        if self.error is not None:
            code = self.error.get("code") if isinstance(self.error, dict) else None
            status = code if isinstance(code, int) and 400 <= code <= 599 else 500
            return status, orjson.dumps({"error": self.error})
        # The fields and nulls of vLLM's own whole answers (its CompletionResponse and
        # ChatCompletionResponse), so that clients cannot tell the difference.
        ids = self.generated if self._client_wants_ids else None
        prompt_ids = self.prompt_ids if self._client_wants_ids else None
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {
                "role": "assistant",
                "content": "".join(self._texts),
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                self._reasoning_field: "".join(self._reasoning) if self._reasoning else None,
            }
        else:
            choice["text"] = "".join(self._texts)
        choice |= {
            "logprobs": self._logprobs,
            "finish_reason": self._finish,
            "stop_reason": self._stop_reason,
            "token_ids": ids,
        }
        if not self.chat:
            choice |= {"prompt_logprobs": None, "prompt_token_ids": prompt_ids}
        choice["routed_experts"] = None
        answer: dict[str, Any] = {
            "id": self._id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": self._usage(len(self.generated)) | {"completion_tokens_details": None},
        }
        if self.chat:
            answer |= {"prompt_logprobs": None, "prompt_token_ids": prompt_ids, "prompt_text": None}
        answer |= {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
        return 200, orjson.dumps(answer)

    def _usage(self, completion: int) -> dict[str, Any]:
        prompt = len(self.prompt_ids or ())
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
        }

    def _continued(self, chunk: dict[str, Any]) -> bytes | None:
        """A continuation chunk as part of the original answer (None: nothing to send)."""
        if "error" in chunk:
            return _DATA + orjson.dumps(chunk) + _EVENT_END  # the instance's own error event
        out: dict[str, Any] = {
            "id": self._id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self._created,
            "model": self._model,
        }
        choices = []
        for choice in _choices(chunk):
            ids = _ids(choice.get("token_ids") or [])
            text = choice.get("text")
            text = text if isinstance(text, str) else ""
            logprobs = choice.get("logprobs")
            finish = choice.get("finish_reason")
            upstream_text, upstream_tokens = text, len(ids)
            if self._skip_ids and ids:
                skipped = min(len(ids), self._skip_ids)
                self._skip_ids -= skipped
                ids = ids[skipped:]
                logprobs = _without_first(logprobs, skipped)
            if self._skip_chars and text:
                skipped = min(len(text), self._skip_chars)
                self._skip_chars -= skipped
                text = text[skipped:]
            if isinstance(logprobs, dict) and isinstance(logprobs.get("text_offset"), list):
                shift = self._offset_shift
                logprobs["text_offset"] = [o + shift for o in logprobs["text_offset"]]
                self._advance_offset(logprobs)
            self.generated.extend(ids)
            self._count_text(upstream_text, upstream_tokens, len(text))
            if not ids and not text and finish is None:
                continue  # all of it replayed what the client has
            if finish is not None:
                self.finished = True
            if self.whole:
                self._collect(text, logprobs, choice)
            new: dict[str, Any] = {"index": 0}
            if self.chat:
                new["delta"] = {"content": text}
            else:
                new["text"] = text
            new["logprobs"] = logprobs
            new["finish_reason"] = finish
            new["stop_reason"] = choice.get("stop_reason")
            if not self._strip_ids:
                new["token_ids"] = ids
            choices.append(new)
        out["choices"] = choices
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            out["usage"] = self._usage(self._before_cut + _int(usage.get("completion_tokens")))
        elif not choices:
            return None
        return _DATA + orjson.dumps(out) + _EVENT_END


def _choices(chunk: dict[str, Any]) -> list[dict[str, Any]]:
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return []
    return [c for c in choices if isinstance(c, dict)]


def _without_first(logprobs: Any, count: int) -> Any:
    """Completions logprobs without their first `count` tokens' entries."""
    if not isinstance(logprobs, dict):
        return logprobs
    return {k: v[count:] if isinstance(v, list) else v for k, v in logprobs.items()}


def _ids(value: Any) -> list[int]:
    if type(value) is not list:
        raise MalformedStream("token ids that are not a list of integers")
    for token in value:
        if type(token) is not int:
            raise MalformedStream("token ids that are not a list of integers")
    return value


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
