"""The floor under our router: what aiohttp's server, uvloop and the legs' client cost with nothing else on the path.

    python -m benchmarks.floor_router --config settings.toml     (the settings file benchmarks.router_peers writes)

A gateway a benchmark measures, never a product: one route (POST /v1/chat/completions), the key compared in
constant time, the body parsed once, a PD prefill leg then the decode leg on `EngineHTTP` (the router's own client),
the answer or the stream relayed as bytes. No contract checks, limits, usage, logs, deadlines, retries or health.
Its CPU a request is the least any router built on these parts can spend; `benchmarks.router_peers` runs it as
the `pd-deploy-floor` arm, in the same run as the shipped router and the Rust gateways (docs/router-performance.md).
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import sys
import tomllib

import uvloop
from aiohttp import web

from stack.router.engine_http import EngineHTTP, Timeout

_LEG = Timeout(connect_s=5, total_s=60, read_s=30)
# What vLLM's NIXL prefill leg carries (the fake backend answers it with kv_transfer_params).
_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                   "remote_block_ids": None, "remote_host": None, "remote_port": None}


def build(settings: dict) -> web.Application:
    key = ("Bearer " + os.environ[settings["taotoken"]["api_key_env"]]).encode()
    prefill, decode = settings["prefill"]["endpoint"], settings["decode"]["endpoint"]
    pd = prefill != decode  # the harness points both at one backend in plain mode
    client = EngineHTTP()

    async def chat(request: web.Request) -> web.StreamResponse:
        if not hmac.compare_digest(request.headers.get("Authorization", "").encode(), key):
            return web.json_response({"error": {"message": "bad key", "type": "authentication_error"}}, status=401)
        raw = await request.read()
        body = json.loads(raw)
        if pd:
            leg = dict(body, max_tokens=1, stream=False, kv_transfer_params=_PREFILL_PARAMS)
            answer = await client.post(prefill + "/v1/chat/completions", json.dumps(leg).encode(), {}, _LEG)
            params = json.loads(await answer.read())["kv_transfer_params"]
            answer.release()
            raw = json.dumps(dict(body, kv_transfer_params=params)).encode()
        upstream = await client.post(decode + "/v1/chat/completions", raw, {}, _LEG)
        try:
            if not body.get("stream"):
                return web.Response(body=await upstream.read(), status=upstream.status, content_type="application/json")
            out = web.StreamResponse(status=upstream.status, headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for chunk in upstream.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out
        finally:
            upstream.release()

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def close(_app: web.Application) -> None:
        await client.close()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.on_cleanup.append(close)
    return app


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the router settings file benchmarks.router_peers writes")
    args = parser.parse_args(argv)
    with open(args.config, "rb") as file:
        settings = tomllib.load(file)
    server = settings["server"]
    web.run_app(build(settings), host=server["host"], port=server["port"], access_log=None, print=None,
                loop=uvloop.new_event_loop())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
