"""vLLM engines started without tool calling: every request that carries tools is refused.

`vllm serve` leaves tool calling off unless started with `--enable-auto-tool-choice --tool-call-parser NAME`. Then a
request with `tools` and tool_choice "auto" (the default when tools are sent, and what Claude Code, Codex and every
agent SDK send on each turn) is answered 400 `"auto" tool choice requires --enable-auto-tool-choice and
--tool-call-parser to be set`. Plain chat keeps working, so health checks and a curl look fine while every agent fails.
The router answers such requests 400 `unsupported_parameter` naming tool_choice (stack/router/upstream.py); the evidence
is its `router.upstream_error` (vLLM's body, verbatim) and vLLM's own access line. Recorded from vLLM 0.32.0 CPU:
tests/unit/doctor/bundles/vllm_no_tool_parser.
"""

from __future__ import annotations

from doctor import engine_facts
from doctor.engine_lines import VLLM
from doctor.findings import Context, Finding, finding
from stack.common import events
from stack.router.upstream import VLLM_NO_TOOL_PARSER

# What vLLM's JSON body looks like inside the router's `body` field (its quotes escaped once).
_IN_BODY = VLLM_NO_TOOL_PARSER.replace('"', '\\"')


def check(ctx: Context) -> list[Finding]:
    router = [r for r in ctx.by_event(events.ROUTER_UPSTREAM_ERROR)
              if r[events.STATUS] == 400 and _IN_BODY in (r[events.BODY] or "")]
    if not router:
        return []
    ids = list(dict.fromkeys(r.request_id for r in router))
    refused = set(ids)
    roles = sorted({r[events.ROLE] or "?" for r in router})
    engines = [r for r in ctx.records if r.service in roles and r.event == VLLM + "access" and r.data.get("status") == 400]
    answered = [r for r in ctx.by_event(events.ROUTER_REQUEST_DONE) if r.request_id in refused]
    asked = {r.data.get("client_request_id") for r in router} - {None}
    client = [r for r in ctx.client if r.request_id in asked]
    restart = "docker compose up -d --force-recreate prefill decode" if engine_facts.compose(ctx) else "restart both engines"
    return [finding(
        "vllm.tool_calling_off", "error",
        f"The vLLM {' and '.join(roles)} engine(s) run without tool calling: {len(ids)} request(s) carrying tools "
        "were refused (400)",
        "vLLM was started without --enable-auto-tool-choice and --tool-call-parser, so it refuses every request whose "
        "tool_choice is \"auto\", the default when tools are sent: every agent turn (Claude Code, Codex, the SDKs' tool "
        "loops). Requests without tools, health checks and tool_choice \"none\" still work. Not the client's fault: "
        f"its request is valid. (vLLM's words: '{VLLM_NO_TOOL_PARSER} and --tool-call-parser to be set'.)",
        "start prefill and decode with --enable-auto-tool-choice --tool-call-parser NAME, the parser of the model's chat "
        "template (hermes for Qwen2.5 and Hermes, llama3_json for Llama 3.1+, mistral for Mistral); compose.vllm-cpu.yaml "
        f"and compose.gpu.yaml pass both, the parser from VLLM_TOOL_CALL_PARSER in .env (default hermes); {restart}",
        client[:1] + router[:3] + answered[:1] + engines[:2], ids)]
