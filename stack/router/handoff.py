"""How the prefill leg hands its KV to the decode leg: one interface, one implementation per backend kind.

    kind       prefill leg's kv_transfer_params             decode leg's kv_transfer_params   X-Request-ID of both legs
    pd-push    {do_remote_decode, transfer_id,              what prefill answered             the client's request id
               decode_kv_addr}: our engine pushes the KV
    nixl       vLLM's toy proxy's {do_remote_decode: true,  what prefill answered, whole and  the client's request id
               do_remote_prefill: false, remote_*: None}    unchanged (vLLM adds keys)
    p2pnccl    none                                         none                              leg_request_id(P zmq, D zmq):
                                                                                              the KV route (p2pnccl.py)
    colocated  no prefill leg: decode gets one ordinary request                                the client's request id

`handoff_for()` picks the kind: colocated when the prefill and decode endpoints are the same,
otherwise [scheduler] kv_connector. The PD flow (pd.py) asks `route()` once per prefill attempt
and `handed()` once prefill answered; nothing else in the router knows which kind runs. The kv_*
settings, the rule that a prefill's one token can finish the answer, what the prefill found cached,
and the KV lease a decode leg must start within are this module's too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

from stack.common import events
from stack.common.config import check
from stack.common.errors import UpstreamError, new_id
from stack.common.logging import log_event
from stack.router.backends import Backend
from stack.router.p2pnccl import leg_request_id
from stack.router.upstream import LegFailed

KVConnector = Literal["pd-push", "nixl", "p2pnccl"]
KV_CONNECTORS: tuple[str, ...] = get_args(KVConnector)  # the backend kinds [scheduler] kv_connector and KV_CONNECTOR name


@dataclass(frozen=True)
class HandoffSettings:
    """The kv_* keys of the [scheduler] table (SchedulerConfig extends this)."""

    # How prefill hands its KV to decode (KV_CONNECTOR overrides): "pd-push" = our engines (prefill pushes to the KV
    # port decode reports on GET /health), "nixl" = vLLM NixlConnector (prefill's kv_transfer_params go to decode
    # unchanged), "p2pnccl" = vLLM P2pNcclConnector (engines register on [p2pnccl] registry_port; the KV route is in the
    # request id). Identical prefill and decode endpoints are colocated whatever this says: one request.
    kv_connector: KVConnector = "pd-push"
    kv_transfer_timeout_ms: int = 5000  # the article's; the decode leg may wait this long for KV before its first token
    # vLLM NixlConnector frees the prefill's blocks this long after the prefill finished unless a decode pulls them
    # (its kv_connector_extra_config kv_lease_duration, 30 s by default; a late pull reads freed blocks and still answers
    # 200): the router never sends a decode leg later than this after the prefill answered; it re-picks the pair.
    kv_lease_ms: int = 30_000

    def __post_init__(self) -> None:
        for name in ("kv_transfer_timeout_ms", "kv_lease_ms"):
            check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")

# The prefill leg's params as vLLM's own proxy sends them (vllm tests/v1/kv_connector/nixl_integration/
# toy_proxy_server.py, send_request_to_service): prefill keeps the blocks for a remote decode to pull.
NIXL_PREFILL_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                       "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass(frozen=True)
class Route:
    """One attempt's hand-off, fixed before its legs are sent."""

    request_id: str  # the X-Request-ID both legs carry
    transfer_id: str  # names the KV in the router's logs (router.prefill_done)
    prefill_params: dict[str, Any] | None  # the prefill leg's kv_transfer_params (None: it carries none)


class Handoff(Protocol):
    kind: str  # pd-push | nixl | p2pnccl | colocated
    prefill_leg: bool  # False (colocated): decode does the whole request
    registers: bool  # the pools start empty and fill as engines register with the router (p2pnccl.py)
    discovers_kv_addr: bool  # decodes tell their KV address on GET /health before they take requests (discovery.py)

    def route(self, request_id: str, prefill: Backend, decode: Backend) -> Route:
        """The hand-off for one prefill → decode pair (colocated: prefill is decode)."""
        ...

    def decode_params(self, route: Route, answer: dict[str, Any]) -> dict[str, Any] | None:
        """The decode leg's kv_transfer_params from prefill's JSON answer (None: it carries none); UpstreamError when
        the answer lacks what decode needs."""
        ...


@dataclass(frozen=True)
class Handed:
    """What a prefill leg hands on: decode's kv_transfer_params and when the KV lease started; or, when its one token
    ended the answer, that answer (`finished`, with its finish_reason)."""

    prefill_url: str
    kv_params: dict[str, Any] | None
    answered_at: float  # the PD clock when the prefill answered: its blocks' lease runs from here
    finished: dict[str, Any] | None = None
    finish_reason: str | None = None
    cached_tokens: int | None = None  # prompt tokens the prefill found in its prefix cache (what usage reports)

    def check_lease(self, now: float, lease_ms: int, request_id: str, decode_url: str) -> None:
        """Never send a decode leg after the prefill's KV lease ([scheduler] kv_lease_ms) ran out: vLLM would read
        freed blocks ("Potentially invalid KV blocks …") and still answer 200. Retryable: a new pair, a new prefill."""
        waited_ms = (now - self.answered_at) * 1000
        if waited_ms < lease_ms:
            return
        log_event(events.ROUTER_KV_EXPIRED, f"prefill {self.prefill_url}'s KV lease ran out before the decode leg was sent",
                  "WARNING", request_id=request_id, prefill=self.prefill_url, decode=decode_url, lease_ms=lease_ms,
                  waited_ms=round(waited_ms, 1))
        raise LegFailed(UpstreamError(f"the prefill's KV blocks expired (kv_lease_ms {lease_ms}) before the decode leg could "
                                      "be sent", code="kv_expired"), retryable=True, code="kv_expired")


def handed(handoff: Handoff, route: Route, prefill_url: str, answer: dict[str, Any], answered_at: float) -> Handed:
    """Prefill's answer as the decode leg needs it. A finish other than "length" means the one token ended the answer
    (EOS, a stop string): vLLM 0.32 still hands on kv_transfer_params (it keeps FINISHED_STOPPED blocks for a remote
    decode; fixtures/vllm_nixl_prefill_eos.json), and a decode leg would generate past the end, so there is none."""
    choices = answer.get("choices") or [{}]
    finish = choices[0].get("finish_reason") if isinstance(choices[0], dict) else None
    if finish not in (None, "length"):
        return Handed(prefill_url, None, answered_at, finished=answer, finish_reason=finish)
    kv_params = handoff.decode_params(route, answer)
    return Handed(prefill_url, kv_params, answered_at, cached_tokens=_cached_tokens(answer, kv_params))


def _cached_tokens(answer: dict[str, Any], kv_params: dict[str, Any] | None) -> int | None:
    """The prompt tokens the prefill found cached: what the client's usage reports (decode loaded them all from the
    prefill, so its own count says ~100 %). vLLM names it in kv_transfer_params (`remote_prefill_cached_tokens`, 0.32+)
    and in the prefill answer's usage (with --enable-prompt-tokens-details)."""
    cached = (kv_params or {}).get("remote_prefill_cached_tokens")
    if not isinstance(cached, int) or isinstance(cached, bool):
        cached = ((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def _answered_params(answer: dict[str, Any]) -> dict[str, Any]:
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise UpstreamError("the prefill engine returned no kv_transfer_params (is it running as a KV producer?)")
    return params


class Push:
    """Our engines: prefill pushes the KV to the address decode reported (discovery.py), under a fresh transfer id."""

    kind, prefill_leg, discovers_kv_addr = "pd-push", True, True
    registers = False

    def route(self, request_id: str, prefill: Backend, decode: Backend) -> Route:
        assert decode.kv_addr, f"{decode} is usable before its KV address was learned"
        transfer_id = new_id()  # one per prefill attempt: a retried prefill never collides with a late push
        return Route(request_id, transfer_id, {"do_remote_decode": True, "transfer_id": transfer_id, "decode_kv_addr": decode.kv_addr})

    def decode_params(self, route: Route, answer: dict[str, Any]) -> dict[str, Any] | None:
        return _answered_params(answer)


class Nixl:
    """vLLM NixlConnector: decode pulls the blocks prefill's answer names, so that answer goes to decode as it came."""

    kind, prefill_leg, discovers_kv_addr = "nixl", True, False
    registers = False

    def route(self, request_id: str, prefill: Backend, decode: Backend) -> Route:
        # vLLM names its request (and so the KV, remote_request_id) after the X-Request-ID.
        return Route(request_id, request_id, dict(NIXL_PREFILL_PARAMS))

    def decode_params(self, route: Route, answer: dict[str, Any]) -> dict[str, Any] | None:
        return _answered_params(answer)


class P2pNccl:
    """vLLM P2pNcclConnector: the request id names both registered zmq addresses; prefill pushes, decode waits."""

    kind, prefill_leg, discovers_kv_addr = "p2pnccl", True, False
    registers = True

    def route(self, request_id: str, prefill: Backend, decode: Backend) -> Route:
        assert prefill.kv_addr and decode.kv_addr, f"{prefill} or {decode} joined without a zmq address"
        leg_id = leg_request_id(prefill.kv_addr, decode.kv_addr)
        return Route(leg_id, leg_id, None)

    def decode_params(self, route: Route, answer: dict[str, Any]) -> dict[str, Any] | None:
        return None


class Colocated:
    """One engine (role both) does prefill and decode: one ordinary request, no KV crosses the network."""

    kind, prefill_leg, discovers_kv_addr = "colocated", False, False
    registers = False

    def route(self, request_id: str, prefill: Backend, decode: Backend) -> Route:
        return Route(request_id, "", None)

    def decode_params(self, route: Route, answer: dict[str, Any]) -> dict[str, Any] | None:
        return None  # the interface's; without a prefill leg there is no answer, so pd.py never reads it


_KINDS: dict[str, type[Handoff]] = {"pd-push": Push, "nixl": Nixl, "p2pnccl": P2pNccl}
assert set(_KINDS) == set(KV_CONNECTORS), f"kv_connector kinds {KV_CONNECTORS} without a Handoff: {set(KV_CONNECTORS) - set(_KINDS)}"


def handoff_for(kv_connector: str, same_endpoints: bool) -> Handoff:
    """The hand-off for [scheduler] kv_connector, or Colocated when prefill and decode are the same engines (never for a
    kind whose engines register: their configured endpoints are ignored)."""
    kind = _KINDS[kv_connector]
    return Colocated() if same_endpoints and not kind.registers else kind()
