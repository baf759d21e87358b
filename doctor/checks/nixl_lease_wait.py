"""Decode's KV read that completes only when the prefill's KV lease expires: vLLM 0.32's pull-mode NIXL on CPU.

vLLM's NixlConnector (= NixlPullConnector) has decode read a finished prefill's blocks, which the prefill keeps for a
lease (kv_lease_duration, 30 s). Recorded with the CPU overlay (`./pd up --vllm-cpu`, vLLM 0.32.0, KV in host memory
over UCX/TCP; tests/unit/doctor/bundles/vllm_lease_wait): every request's decode read completed only as the prefill
released its blocks at the lease's expiry, so each first token came a lease late (31 s for an 8-token answer); with
the lease at 4 s, 1.0-5.3 s; in a benchmark at 1 request a second, 40 of 40 streams passed the router's 30 s
silence limit. Decode's own transfer metrics show each read took under a millisecond once posted: decode was not
slow, it was waiting on the prefill. The two lines it leaves, per request, in the prefill's log
(doctor/signatures.py):

    WARNING … Releasing expired KV blocks for request <id> which were retrieved by 0 remote worker(s) …
    ERROR   … Potentially invalid KV blocks for unrecognized request <id> were retrieved by a decode worker …

Either line alone has other causes (decode down, unreachable or queued: `kv.stranded_on_prefill`,
`kv.read_after_expiry`, where a longer lease is the fix). Both for one request, the read logged within
READ_AFTER_RELEASE_S of the release, say the read waited for the release: a longer lease only lengthens the wait.

The cause, found on host processes with the same layout: vLLM's NIXL worker on CPU pins each engine's main worker
thread (which also runs the model) to the last core of the NUMA node, "reserved for KV transfer", whatever
VLLM_CPU_OMP_THREADS_BIND said. With decode bound to core 0 and prefill to core 1 of 2, decode's main thread sat
runnable with no CPU on core 1 (0 ticks over seconds) while the prefill busy-stepped there holding the KV; it ran
when the lease ended and the prefill went idle. scripts/vllm-cpu.sh patches the installed vLLM to pick the last
core the thread is allowed instead (10 of 10 decodes 0.04-0.14 s after, 31 s in 2 of 3 before).
"""

from __future__ import annotations

from datetime import datetime

from doctor import engine_lines
from doctor.findings import Context, Finding, finding
from doctor.parse import UPSTREAM, Record

RELEASED = UPSTREAM + "kv.stranded_on_prefill"
READ_LATE = UPSTREAM + "kv.read_after_expiry"
READ_AFTER_RELEASE_S = 3.0  # vLLM stamps its lines to the second; recorded: the read a second after the release


def check(ctx: Context) -> list[Finding]:
    pairs = stalled_pairs(ctx)
    if not pairs:
        return []
    widest = max(gap for _, _, gap in pairs)
    return [finding(
        "kv.read_at_lease_expiry", "error",
        f"Decode's KV reads completed only as the prefill's lease expired ({len(pairs)} request(s)): each first token "
        "a lease late",
        "The prefill logged each request's blocks as released at the end of its KV lease (kv_lease_duration, 30 s in "
        f"vLLM 0.32) and decode's read of them within {widest:g} s after: decode's read waited for that release "
        "(recorded with vLLM 0.32.0's CPU build and pull-mode NixlConnector, where each transfer took under "
        "a millisecond once posted). Every first token comes a lease late, and decode reads blocks the prefill has "
        "already released (output may be wrong).",
        "do not raise the lease (it lengthens the wait). On vLLM's CPU build the cause is its KV-core pin: each "
        "engine's main worker thread is moved to the host's last core, so decode's waits behind a prefill bound "
        "there. Rebuild the overlay's image (scripts/vllm-cpu-image.sh: its install patches the pin to the cores "
        "the engine is bound to); with your own vLLM CPU build, apply scripts/vllm-cpu.sh's patch_vllm_kv_core, or "
        "bind decode to the last core (DECODE_CPUS) and prefill below it; docs/vllm-cpu.md has the figures",
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
    return next(iter(engine_lines.request_ids(record.line)), None)


def _seconds_between(first: Record, then: Record) -> float | None:
    """Seconds from `first` to `then` by the stamps vLLM wrote in the lines (to the second, no year)."""
    a, b = engine_lines.stamp(first.line), engine_lines.stamp(then.line)
    if a is None or b is None:
        return None
    return (datetime.strptime(b, "%m-%dT%H:%M:%S") - datetime.strptime(a, "%m-%dT%H:%M:%S")).total_seconds()
