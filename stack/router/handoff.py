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
and `decode_params()` once prefill answered; nothing else in the router knows which kind runs.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from stack.common.errors import UpstreamError
from stack.router.backends import Backend
from stack.router.p2pnccl import leg_request_id

# The prefill leg's params as vLLM's own proxy sends them (vllm tests/v1/kv_connector/nixl_integration/
# toy_proxy_server.py, send_request_to_service): prefill keeps the blocks for a remote decode to pull.
NIXL_PREFILL_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                       "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass(frozen=True)
class Route:
    """One attempt's hand-off, fixed before its legs are sent."""

    request_id: str  # the X-Request-ID both legs carry
    transfer_id: str  # names the KV in the router's logs (router.prefill_done, router.kv_handoff)
    prefill_params: dict[str, Any] | None  # the prefill leg's kv_transfer_params (None: it carries none)


class Handoff(Protocol):
    kind: str  # pd-push | nixl | p2pnccl | colocated
    prefill_leg: bool  # False (colocated): decode does the whole request
    discovers_kv_addr: bool  # decodes tell their KV address on GET /health before they take requests (discovery.py)

    def route(self, request_id: str, prefill: Backend, decode: Backend) -> Route:
        """The hand-off for one prefill → decode pair (colocated: prefill is decode)."""
        ...

    def decode_params(self, route: Route, answer: dict[str, Any]) -> dict[str, Any] | None:
        """The decode leg's kv_transfer_params from prefill's JSON answer (None: it carries none); UpstreamError when
        the answer lacks what decode needs."""
        ...


def _answered_params(answer: dict[str, Any]) -> dict[str, Any]:
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise UpstreamError("the prefill engine returned no kv_transfer_params (is it running as a KV producer?)")
    return params


class Push:
    """Our engines: prefill pushes the KV to the address decode reported (discovery.py), under a fresh transfer id."""

    kind, prefill_leg, discovers_kv_addr = "pd-push", True, True

    def route(self, request_id: str, prefill: Backend, decode: Backend) -> Route:
        assert decode.kv_addr, f"{decode} is usable before its KV address was learned"
        transfer_id = uuid.uuid4().hex  # one per prefill attempt: a retried prefill never collides with a late push
        return Route(request_id, transfer_id, {"do_remote_decode": True, "transfer_id": transfer_id, "decode_kv_addr": decode.kv_addr})

    def decode_params(self, route: Route, answer: dict[str, Any]) -> dict[str, Any] | None:
        return _answered_params(answer)


class Nixl:
    """vLLM NixlConnector: decode pulls the blocks prefill's answer names, so that answer goes to decode as it came."""

    kind, prefill_leg, discovers_kv_addr = "nixl", True, False

    def route(self, request_id: str, prefill: Backend, decode: Backend) -> Route:
        # vLLM names its request (and so the KV, remote_request_id) after the X-Request-ID.
        return Route(request_id, request_id, dict(NIXL_PREFILL_PARAMS))

    def decode_params(self, route: Route, answer: dict[str, Any]) -> dict[str, Any] | None:
        return _answered_params(answer)


class P2pNccl:
    """vLLM P2pNcclConnector: the request id names both registered zmq addresses; prefill pushes, decode waits."""

    kind, prefill_leg, discovers_kv_addr = "p2pnccl", True, False

    def route(self, request_id: str, prefill: Backend, decode: Backend) -> Route:
        assert prefill.kv_addr and decode.kv_addr, f"{prefill} or {decode} joined without a zmq address"
        leg_id = leg_request_id(prefill.kv_addr, decode.kv_addr)
        return Route(leg_id, leg_id, None)

    def decode_params(self, route: Route, answer: dict[str, Any]) -> dict[str, Any] | None:
        return None


class Colocated:
    """One engine (role both) does prefill and decode: one ordinary request, no KV crosses the network."""

    kind, prefill_leg, discovers_kv_addr = "colocated", False, False

    def route(self, request_id: str, prefill: Backend, decode: Backend) -> Route:
        return Route(request_id, "", None)

    def decode_params(self, route: Route, answer: dict[str, Any]) -> dict[str, Any] | None:
        return None  # the interface's; without a prefill leg there is no answer, so pd.py never asks


_KINDS: dict[str, type[Handoff]] = {"pd-push": Push, "nixl": Nixl, "p2pnccl": P2pNccl}


def handoff_for(kv_connector: str, colocated: bool) -> Handoff:
    """The hand-off for [scheduler] kv_connector, or Colocated when prefill and decode are the same engines."""
    return Colocated() if colocated else _KINDS[kv_connector]()
