"""One choice of a response, built from its sequence's outputs: text, tool calls, logprobs, finish reason.

`add(out)` for a non-streamed body (`body()`), `chunks(out, ids)` for the stream; both go through the
same tool-call parser (tool_parser.py), so the deltas of a stream add up to the non-streamed message.
Logprob shapes are OpenAI's: chat `logprobs.content[{token, logprob, bytes, top_logprobs}]`,
completions the legacy `{tokens, token_logprobs, top_logprobs, text_offset}`.
"""

from __future__ import annotations

from typing import Any

from stack.engine import protocol
from stack.engine.protocol import CompletionRequest, ResponseIds
from stack.engine.sequence import Output, TokenLogprob
from stack.engine.tokenizer import Tokenizer
from stack.engine.tool_parser import ToolCallParser, delta_tool_calls, message_tool_calls


class Choice:
    """The state of choice `index` of `req` while its outputs arrive."""

    def __init__(self, req: CompletionRequest, index: int, tokenizer: Tokenizer) -> None:
        self.req = req
        self.index = index
        self.tokenizer = tokenizer
        self.parser = ToolCallParser() if req.tools and req.kind == "chat" else None
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # vLLM's choice field: the stop string / token id that matched
        self.logprobs: list[dict[str, Any]] = []  # chat entries
        self.legacy: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self._offset = 0  # completions: characters of the token strings so far (text_offset)
        self._first = True

    def _finish(self, reason: str) -> str:
        if reason == "stop" and self.parser is not None and self.parser.calls:
            return "tool_calls"
        return reason

    def _events(self, out: Output) -> list[tuple[Any, ...]]:
        if self.parser is None:
            return [("content", out.text)] if out.text else []
        events = self.parser.feed(out.text)
        if out.finish_reason is not None:
            events += self.parser.finish()
        return events

    def add(self, out: Output) -> None:
        """Fold one output into the non-streamed choice."""
        if self.parser is None:
            self.text += out.text
        else:
            self._events(out)
        self._logprobs(out.logprobs)
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason = self._finish(out.finish_reason), out.stop_reason

    def body(self) -> dict[str, Any]:
        assert self.finish_reason is not None, "a choice body needs its last output"
        if self.parser is not None:
            text, calls = self.parser.content, message_tool_calls(self.parser.calls)
        else:
            text, calls = self.text, []
        body = protocol.choice_body(self.req.kind, self.index, text, self.finish_reason, self._logprobs_json(), calls or None)
        return body | {"stop_reason": self.stop_reason}

    def chunks(self, out: Output, ids: ResponseIds) -> list[dict[str, Any]]:
        """The stream chunks for one output (possibly none); the last output's last chunk has the finish reason."""
        kind, n_before = self.req.kind, len(self.logprobs) + len(self.legacy["tokens"])
        self._logprobs(out.logprobs)
        lp = self._logprobs_json(since=n_before) if out.logprobs else None
        events = self._events(out)
        content = "".join(e[1] for e in events if e[0] == "content")
        chunks: list[dict[str, Any]] = []
        if content or lp is not None or self._first:
            chunks.append(protocol.chunk_body(kind, ids, content, None, self._first, index=self.index, logprobs=lp))
            self._first = False
        for event in events:
            if event[0] != "content":
                chunks.append(protocol.chunk_body(kind, ids, None, None, False, index=self.index, tool_calls=delta_tool_calls(event)))
        if out.finish_reason is not None:
            reason = self._finish(out.finish_reason)
            if not chunks or chunks[-1]["choices"][0].get("delta", {}).get("tool_calls"):
                chunks.append(protocol.chunk_body(kind, ids, None, reason, False, index=self.index))
            chunks[-1]["choices"][0] |= {"finish_reason": reason, "stop_reason": out.stop_reason}
        return chunks

    # -- logprobs --------------------------------------------------------------------------------

    def _token(self, token: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _logprobs(self, entries: tuple[TokenLogprob, ...]) -> None:
        for e in entries:
            text, raw = self._token(e.token)
            if self.req.kind == "chat":
                top = [{"token": t, "logprob": lp, "bytes": b} for t, b, lp in ((*self._token(i), lp) for i, lp in e.top)]
                self.logprobs.append({"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top})
            else:
                self.legacy["tokens"].append(text)
                self.legacy["token_logprobs"].append(e.logprob)
                self.legacy["top_logprobs"].append({self._token(i)[0]: lp for i, lp in e.top})
                self.legacy["text_offset"].append(self._offset)
                self._offset += len(text)

    def _logprobs_json(self, since: int = 0) -> dict[str, Any] | None:
        if self.req.sampling.logprobs is None:
            return None
        if self.req.kind == "chat":
            return {"content": self.logprobs[since:], "refusal": None}
        return {key: values[since:] for key, values in self.legacy.items()}
