"""gRPC health (grpc.health.v1) for every service, and the probe compose health checks run.

Serving side: `health = await start_health_server(port)`; it answers NOT_SERVING until the service
calls `await health.set_serving()` after warm-up. Probe side: `probe("prefill:50051")` returns the
status name, and `python -m stack.common.health HOST:PORT` exits 0 only when SERVING (used by the
compose health checks and by the router's backend monitor). A probe that fails says how: UNREACHABLE
(nothing answered the connection) or TIMEOUT (no answer within the deadline; a busy host or a cut network).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from stack.common.health_probe import NOT_SERVING, SERVING, TIMEOUT, UNREACHABLE

__all__ = ["NOT_SERVING", "SERVING", "TIMEOUT", "UNREACHABLE", "HealthServer", "probe_async", "start_health_server"]


class HealthServer:
    """A grpc.aio server carrying only the standard health service."""

    def __init__(self, server: grpc.aio.Server, servicer: health.aio.HealthServicer, port: int) -> None:
        self._server = server
        self._servicer = servicer
        self.port = port

    async def set_serving(self) -> None:
        await self._servicer.set("", health_pb2.HealthCheckResponse.SERVING)

    async def set_not_serving(self) -> None:
        await self._servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float = 2.0) -> None:
        await self._servicer.enter_graceful_shutdown()
        await self._server.stop(grace)


async def start_health_server(port: int, host: str = "0.0.0.0") -> HealthServer:
    """Start serving health on host:port (port 0 picks a free one), status NOT_SERVING."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    # The overall "" status defaults to SERVING in grpcio; a cold service must not look ready.
    await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    return HealthServer(server, servicer, bound)


def _failure_name(err: grpc.RpcError) -> str:
    return TIMEOUT if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED else UNREACHABLE


def _status_name(response: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


async def probe_async(address: str, timeout: float = 2.0) -> str:
    """Status of the service at address: SERVING, NOT_SERVING, …, UNREACHABLE or TIMEOUT."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError as err:
            return _failure_name(err)
    return _status_name(response)
