"""Typed application state shared by the router's middlewares and API handlers (no module globals)."""

from __future__ import annotations

from aiohttp import web

from stack.router.auth import Caller, KeyRing
from stack.router.config import RouterConfig
from stack.router.limits import Limiter
from stack.router.metrics import Metrics
from stack.router.p2pnccl import Registry
from stack.router.pd import PDClient
from stack.router.usage import UsageStore

CONFIG = web.AppKey("config", RouterConfig)
KEYRING = web.AppKey("keyring", KeyRing)
LIMITER = web.AppKey("limiter", Limiter)
USAGE = web.AppKey("usage", UsageStore)
METRICS = web.AppKey("metrics", Metrics)
PD = web.AppKey("pd", PDClient)
REGISTRY = web.AppKey("p2pnccl_registry", Registry)  # only when [p2pnccl] registry_port is set
INTERNAL_KEY = web.AppKey("internal_key", str)  # PD_INTERNAL_KEY, sent to the engines; "" = none set

# Per-request state the front middleware and the handlers share.
CALLER = web.RequestKey("caller", Caller)  # the authenticated key
TOKENS = web.RequestKey("tokens", tuple)  # (prompt_tokens, completion_tokens) the request used
STREAM_ERROR = web.RequestKey("stream_error", str)  # why a started stream ended early (error type or client_disconnected)
