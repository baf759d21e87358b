"""What the relay (pd.py `DecodeStream`) reads and writes: the answered decode leg, its stream's frames checked
(an engine's in-band error frame is the leg's failure) and counted, usage with cached_tokens as the prefill saw
them (handoff.py), and a JSON answer as the chunks a stream would have carried.

The fast path: most frames of a stream are ordinary token chunks (choices, none finished, no usage, no error), and
an API that answers in the engine's own format (OpenAI chat/completions) forwards them unchanged but for the model
id. `Passthrough` tells such a frame by its bytes (`token_frame`, or a network read shaped as the last such frame)
and swaps the model id in place, so it is relayed without being decoded and encoded again
(`PDClient.open(raw_model=…)`). An API that translates (Anthropic's and Responses' text deltas) gets the token's
text as the engine escaped it, a JSON string's inside that is one in its own frame too (`PDClient.open(text_frame=…)`).
Every other frame (the first, the finishing one, the usage chunk, an error, anything unexpected) is parsed as before,
so what is counted, charged, checked and logged is decided on parsed JSON as it always was; a token chunk needs no
more than its count and time.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stack.common import events, json_text
from stack.common.logging import log_event
from stack.common.sse import FrameReader, dumps
from stack.router.backends import Backend
from stack.router.engine_http import Response
from stack.router.metrics import Metrics
from stack.router.upstream import EngineError, LegFailed, status_failure


@dataclass
class Leg:
    """An answered decode leg: the backend, and the JSON body or the open stream."""

    decode: Backend
    answer: dict[str, Any] | None = None
    response: Response | None = None
    reader: FrameReader | None = None  # the rest of the stream, a network read's frames at a time
    first: dict[str, Any] | None = None  # the first chunk, checked before anything reached the client
    rest: list[bytes] = field(default_factory=list)  # the other frames' data that arrived with the first
    prefill_cached: int | None = None  # prompt tokens the prefill found in its prefix cache (what usage reports)


def parse_chunk(decode: Backend, data: bytes) -> dict[str, Any]:
    """One SSE data frame of decode's stream; an in-band error frame (vLLM's) is the leg's failure."""
    chunk = json_text.loads(data)
    if not isinstance(chunk, dict):
        raise ValueError("chunk is not a JSON object")
    if "error" in chunk:
        error = chunk["error"]
        code = error.get("code") if isinstance(error, dict) else None  # vLLM: the HTTP status, an int
        status = code if isinstance(code, int) and not isinstance(code, bool) and code >= 400 else 502
        text = data.decode()
        log_event(events.ROUTER_UPSTREAM_ERROR, f"decode {decode.url} sent an in-band error", "WARNING",
                  backend=decode.url, role=decode.role, status=status, body=text[:2000])
        raise status_failure(decode, status, EngineError.parse(text))
    return chunk


_UNFINISHED = (b'"finish_reason":null', b'"finish_reason": null')  # compact (our engine, vLLM) or json.dumps' spacing
# In token_frame, `sub in data` for bytes first tries `sub` as an int (`7 in b"…"`), and on CPython 3.11 that raises and clears a
# TypeError each time: ~2k instructions before the search starts (benchmarks.instructions found 4 a chunk).
# `data.find(sub)` takes bytes straight away.


def token_frame(data: bytes) -> bool:
    """Is this frame an ordinary token chunk: an object whose every choice has `finish_reason` null, with no `usage`
    and no `error`? Told from its bytes: inside a JSON string every quote is escaped, so a quoted name such as
    `"usage"` in the bytes is a key (or a string value that is exactly that word, which only sends the frame to the
    parser). Any doubt answers False, and the frame is parsed."""
    if not (data.startswith(b'{"') and data.endswith(b"}")) or data.find(b'"usage"') >= 0 \
            or data.find(b'"error"') >= 0:
        return False
    finish = data.count(b'"finish_reason"')
    return finish > 0 and finish == data.count(_UNFINISHED[0]) + data.count(_UNFINISHED[1])


def report_cached(usage: Any, cached: int | None) -> None:
    """Usage as the client sees it: cached_tokens from the prefill's view (decode's own count, where it keeps one, is
    every token it loaded from the prefill)."""
    if cached is not None and isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        usage["prompt_tokens_details"] = {**(details if isinstance(details, dict) else {}), "cached_tokens": cached}


def answer_chunks(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """A non-streamed chat or text completion as the stream chunks an engine would have sent for it: one chunk per
    choice with the whole delta and its finish_reason, then the usage chunk (choices [])."""
    chat = answer.get("object") == "chat.completion"
    head = {"id": answer.get("id", ""), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer.get("created", 0), "model": answer.get("model", "")}
    chunks = []
    for choice in answer.get("choices") or []:
        out = {"index": choice.get("index", 0), "logprobs": choice.get("logprobs"), "finish_reason": choice.get("finish_reason")}
        if chat:
            message = choice.get("message") or {}
            delta = {"role": "assistant", "content": message.get("content") or ""}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            out["delta"] = delta
        else:
            out["text"] = choice.get("text") or ""
        chunks.append({**head, "choices": [out]})
    if answer.get("usage"):
        chunks.append({**head, "choices": [], "usage": answer["usage"]})
    return chunks


# Where a token chunk's text starts (chat, text completion; compact or json.dumps' spacing).
_TEXT_KEYS = (b'"content":"', b'"content": "', b'"text":"', b'"text": "')
# What cannot lie inside a JSON string's bytes as the learnt shape has it: a quote, a line break (the frame would not
# be one line), a backslash at the end (it would escape the tail's quote).
_NOT_TEXT = re.compile(rb'["\r\n]|\\\Z')


@dataclass(frozen=True, slots=True)
class _Shape:
    """A token chunk's frame around its text: as a network read holds it, and as relayed (the client's model id)."""

    wire_head: bytes  # "data: " + the engine's bytes up to the text
    tail: bytes  # the bytes after the text + the frame's blank line, the same read and relayed
    head: bytes  # "data: " + the bytes up to the text, with the client's model id


TextFrame = Callable[[bytes], "bytes | None"]  # a token's JSON-escaped text → the client's frame for it, or None


class Passthrough:
    """Ordinary token frames sent on without being decoded: as the engine wrote them but for the client's model id
    (OpenAI chat/completions), or, given `text_frame`, as another API's frame for their text (a text delta).

    `take` decides on a frame's data (`token_frame`). `whole` is quicker still, for the common case: a network read
    that is one `data:` frame shaped as the last token chunk taken, every byte the same but its text's. An engine's
    token chunks differ only there (same id, created, model, index, null finish_reason), so such a frame is an
    ordinary token chunk too; it needs two comparisons and a search instead of a frame split and seven. Both give the
    frame the client is sent, or None: the chunk is then parsed and translated as any other."""

    def __init__(self, engine_model: Any, model: str, text_frame: TextFrame | None = None) -> None:
        """`engine_model`: the id the engine wrote in its first chunk (parsed); `model`: the one the client asked for.
        `text_frame`: the frame for a token chunk's text (the escaped JSON string's inside, as the engine wrote it), or
        None when the translator needs the parsed chunk; with it, `take` only learns the shape (its frames are parsed)."""
        value = dumps(engine_model) if isinstance(engine_model, str) else None
        self.old = (b'"model":' + value, b'"model": ' + value) if value is not None else ()  # compact, or json.dumps' spacing
        self.new = b'"model":' + dumps(model)
        self.text_frame = text_frame
        self.shape: _Shape | None = None  # the last token chunk's, once one was taken

    def take(self, data: bytes) -> bytes | None:
        """The frame for this data with the client's model id, or None: not a `token_frame`, or the swap is not
        certain (the id not written as in the first chunk, or `"model"` more than once), or a translated stream's
        frame, so the caller parses it."""
        if self.text_frame is not None and self.shape is not None:
            return None  # a translated stream's frames are all parsed: once the shape is learnt, nothing to look for
        if not token_frame(data) or data.count(b'"model"') != 1:
            return None
        for old in self.old:
            if data.find(old) >= 0:  # not `in`: see token_frame
                if self.shape is None:
                    self._learn(data, old)
                return None if self.text_frame is not None else b"data: " + data.replace(old, self.new) + b"\n\n"
        return None

    def _learn(self, data: bytes, old: bytes) -> None:
        """Keep a token chunk's shape: the bytes before its text (the model id among them) and after it. Only from a
        text without a quote or backslash, so that the text's end is the first quote after its start; for a translated
        stream, only from a chunk that carries nothing else (no tool call)."""
        for key in _TEXT_KEYS:
            at = data.find(key)
            if at >= 0:
                break
        else:
            return
        start = at + len(key)
        end = data.find(b'"', start)
        head, tail = data[:start], data[end:]
        if data.find(b"\\", start, end) >= 0 or head.find(old) < 0 or data.count(key) != 1:
            return
        if self.text_frame is not None and data.find(b'"tool_calls"') >= 0:
            return  # a translated frame says the text only: a chunk that also calls a tool is parsed
        self.shape = _Shape(b"data: " + head, tail + b"\n\n", b"data: " + head.replace(old, self.new))

    def whole(self, block: bytes) -> bytes | None:
        """A network read that is exactly one frame of the learnt shape: the client's frame for its text. None for
        anything else (the reader splits and `take` decides). The text between may hold escapes but no quote, nor end
        in a backslash (`_NOT_TEXT`), and must be UTF-8."""
        shape = self.shape
        if shape is None or not block.startswith(shape.wire_head) or not block.endswith(shape.tail):
            return None
        text = block[len(shape.wire_head):len(block) - len(shape.tail)]
        if _NOT_TEXT.search(text):
            return None
        if not text.isascii():
            try:
                text.decode()
            except UnicodeDecodeError:
                return None  # the reader's split fails the leg on it
        text_frame = self.text_frame
        return shape.head + text + shape.tail if text_frame is None else text_frame(text)


class Tally:
    """What a relayed stream has shown so far: token chunks (ITL observed between them), finish, usage. A chunk is a
    parsed dict, or the bytes of a `token_frame` (one token chunk, unfinished, no usage)."""

    def __init__(self, metrics: Metrics, started: float) -> None:
        self.metrics = metrics
        self.last = started
        self.first = started  # when the first token chunk arrived
        self.tokens = 0
        self.finished = False
        self.usage: dict[str, Any] | None = None

    def count(self, chunks: list[dict[str, Any] | bytes]) -> None:
        now = time.perf_counter()  # chunks of one batch arrived together: the gaps inside it are 0
        for chunk in chunks:
            if isinstance(chunk, bytes):
                self.token(now)
                continue
            choices = chunk.get("choices")
            if choices:
                self.token(now)
                self.finished = self.finished or bool(choices[0].get("finish_reason"))
            if chunk.get("usage"):
                self.usage = chunk["usage"]

    def token(self, now: float) -> None:
        """One token chunk arrived at `now`."""
        if self.tokens:
            self.metrics.itl.observe(now - self.last)
        else:
            self.first = now
        self.tokens += 1
        self.last = now
