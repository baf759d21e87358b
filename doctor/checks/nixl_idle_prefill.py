"""Decode's KV read that waits for an idle prefill to wake: vLLM's pull-mode NIXL on a prefill with nothing else to do.

vLLM's NixlConnector (= NixlPullConnector; vLLM 0.32) has decode read a finished prefill's blocks. The prefill's
worker learns which blocks it serves, and progresses the read, only when its engine steps again; a prefill with no
other request parks on its input queue until the KV lease's expiry wakes it (kv_lease_duration, 30 s). So, on a
quiet deployment, each request's first token comes a lease late, and decode reads blocks the prefill has just
released. The two lines it leaves, per request, in the prefill's log (doctor/signatures.py):

    WARNING … Releasing expired KV blocks for request <id> which were retrieved by 0 remote worker(s) …
    ERROR   … Potentially invalid KV blocks for unrecognized request <id> were retrieved by a decode worker …

Either line alone has other causes (decode down, unreachable or queued: `kv.stranded_on_prefill`,
`kv.read_after_expiry`, where a longer lease is the fix). Both for one request, the read within READ_AFTER_RELEASE_S
of the release, say decode was waiting for the prefill to wake, not slow: the lease's expiry is what let it read.
Recorded with the CPU overlay (tests/unit/doctor/bundles/vllm_idle_prefill): 31 s for an 8-token answer; with the
lease at 4 s, 1.0-5.3 s; vLLM's push mode (NixlPushConnector, whose pending pushes keep both engines stepping)
4.8-5.7 s, its first request over 100 s.
"""

from __future__ import annotations

import re
from datetime import datetime

from doctor.findings import Context, Finding, finding
from doctor.parse import UPSTREAM, Record

RELEASED = UPSTREAM + "kv.stranded_on_prefill"
READ_LATE = UPSTREAM + "kv.read_after_expiry"
READ_AFTER_RELEASE_S = 3.0  # vLLM stamps its lines to the second; the read follows the wake-up within one
_REQUEST = re.compile(r"for (?:unrecognized )?request (\S+)")
_STAMP = re.compile(r"\b(\d\d-\d\d \d\d:\d\d:\d\d)\b")  # vLLM's "WARNING 12-02 18:21:24 [file.py:N]"


def check(ctx: Context) -> list[Finding]:
    pairs = stalled_pairs(ctx)
    if not pairs:
        return []
    widest = max(gap for _, _, gap in pairs)
    return [finding(
        "kv.idle_prefill_stall", "error",
        f"Decode waited for the idle prefill to wake: {len(pairs)} request(s) read their KV only as its lease expired",
        "vLLM's pull-mode NixlConnector serves a finished prefill's blocks only when the prefill engine steps again. "
        "With no other request to run, the prefill parks until the KV lease's expiry wakes it (kv_lease_duration, "
        f"30 s in vLLM 0.32), so each first token comes a lease late. Decode read every such request's KV within "
        f"{widest:g} s of the prefill releasing it: it was waiting for the prefill, not slow, and it read blocks the "
        "prefill had already released (output may be wrong).",
        "do not raise the lease (it lengthens the wait; a shorter one only trades it for reads of released blocks). "
        "Keep the prefill stepping: under steady traffic the stall goes (the next prefill wakes it), or run vLLM's push "
        "mode, \"kv_connector\":\"NixlPushConnector\" in both engines' --kv-transfer-config (compose.gpu.yaml: "
        "VLLM_NIXL_CONNECTOR); on the CPU build with little traffic, serve one vLLM engine colocated instead of 1P1D",
        [r for release, read, _ in pairs for r in (release, read)],
        [r.request_id for release, read, _ in pairs for r in (release, read)])]


def stalled_pairs(ctx: Context) -> list[tuple[Record, Record, float]]:
    """(release, late read, seconds between) of each request whose read followed its release within
    READ_AFTER_RELEASE_S (upstream.py leaves these lines to this check)."""
    released = {rid: r for r in ctx.by_event(RELEASED) if (rid := _vllm_request(r))}
    pairs: list[tuple[Record, Record, float]] = []
    for read in ctx.by_event(READ_LATE):
        rid = _vllm_request(read)
        release = released.get(rid) if rid else None
        gap = _seconds_between(release, read) if release is not None else None
        if release is not None and gap is not None and 0 <= gap <= READ_AFTER_RELEASE_S:
            pairs.append((release, read, gap))
    return pairs


def _vllm_request(record: Record) -> str | None:
    found = _REQUEST.search(record.line)
    return found.group(1) if found else None


def _seconds_between(first: Record, then: Record) -> float | None:
    """Seconds from `first` to `then` by the stamps vLLM wrote in the lines (the doctor's own ts when it has one)."""
    stamps = [_STAMP.search(r.line) for r in (first, then)]
    if stamps[0] and stamps[1]:
        a, b = (datetime.strptime(s.group(1), "%m-%d %H:%M:%S") for s in stamps)  # type: ignore[union-attr]
        return (b - a).total_seconds()
    if first.ts and then.ts:
        return (datetime.fromisoformat(then.ts.replace("Z", "+00:00"))
                - datetime.fromisoformat(first.ts.replace("Z", "+00:00"))).total_seconds()
    return None
