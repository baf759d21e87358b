"""When a sequence stops, and how much of its text may be streamed yet (vLLM's stop checker, for one sequence).

A sampled token ends the sequence when it is one of `stop_token_ids`, EOS (unless `ignore_eos`), completes a
`stop` string (the text is cut before it), or reaches `max_tokens`. Until then, the tail of the text that could
still grow into a stop string is held back; it is sent once it cannot.
"""

from __future__ import annotations

from stack.engine.sequence import Sequence


def add_token_text(seq: Sequence, token: int, stop_ids: frozenset[int]) -> str | None:
    """Add the text of `token` (already appended to `seq.output`) to `seq.text`; the finish reason it causes,
    "stop" | "length", else None. On a stop, `seq.stop_reason` is the stop string or stop token id (None for EOS)."""
    assert seq.detok is not None, f"sequence {seq.request_id} has no detokenizer"
    params = seq.params
    if token in params.stop_token_ids or (token in stop_ids and not params.ignore_eos):
        seq.text += seq.detok.flush()
        seq.stop_reason = token if token in params.stop_token_ids else None
        return "stop"
    seq.text += seq.detok.push(token)
    if params.stop:
        search_from = max(0, seq.sent - max(map(len, params.stop)))
        hits = [(i, s) for s in params.stop if (i := seq.text.find(s, search_from)) >= 0]
        if hits:
            at, seq.stop_reason = min(hits, key=lambda hit: (hit[0], len(hit[1])))  # earliest; on a tie, the shorter (done first)
            seq.text = seq.text[:at]
            return "stop"
    if len(seq.output) >= params.max_tokens:
        seq.text += seq.detok.flush()
        return "length"
    return None


def releasable_text(seq: Sequence) -> str:
    """The unsent text of a running sequence that can no longer become a stop string; marks it sent."""
    stops = seq.params.stop
    safe = len(seq.text) - (max(map(len, stops)) - 1 if stops else 0)
    new = seq.text[seq.sent : max(safe, seq.sent)]
    seq.sent += len(new)
    return new
