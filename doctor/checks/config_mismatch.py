"""Prefill and decode configured differently: the mismatched key, both values and both files.

- max_model_len: prefill accepted the prompt, then decode refused it ("This model's maximum context
  length is N tokens", logged by decode at WARNING as http.bad_request) and the router answered 502: decode's
  limit is smaller. (With the same windows the router answers the client's 400: long_prompt.context_exceeded.)
- Live (the /config folders the containers mount are readable): keys that must agree between the
  two engines' config files (max_model_len, block_size, dtype, checkpoint, seed, model) are compared.
The KV port and model fingerprint mismatches are in kv_transfer (they show in KV events).
"""

from __future__ import annotations

import re

from doctor.findings import Context, Finding, finding
from stack.common import events

_CONTEXT = re.compile(r"maximum context length is (\d+) tokens")
MUST_AGREE = ("max_model_len", "block_size", "dtype", "checkpoint", "seed", "model")


def rejected_for_length(ctx: Context) -> list[tuple[str, int, list]]:
    """(request id, decode's max_model_len, decode's lines) for requests prefill served, decode refused and the router
    answered as the engines' fault (not the client's 400: the router passes that on when the windows are the same)."""
    by_request: dict[str, list] = {}
    for r in ctx.by_event(events.HTTP_BAD_REQUEST):  # decode's refusal (WARNING): rare, so start from it
        if r.service == "decode" and "maximum context length" in r.msg and _CONTEXT.search(r.msg):
            by_request.setdefault(r.request_id, []).append(r)
    out = []
    for rid, lines in by_request.items():
        t = ctx.timelines.get(rid)
        if t is not None and t.status != 400 and t.first(events.ROUTER_PREFILL_DONE) is not None:
            out.append((rid, int(_CONTEXT.search(lines[0].msg).group(1)), lines))
    return out


def _value(config: dict | None, key: str) -> object:
    return None if config is None else config.get(key)


def check(ctx: Context) -> list[Finding]:
    facts = ctx.facts
    prefill_file, prefill_cfg = facts.engine_config("prefill")
    decode_file, decode_cfg = facts.engine_config("decode")
    out: list[Finding] = []
    hits = rejected_for_length(ctx)
    if hits:
        decode_len = hits[0][1]
        prefill_len = _value(prefill_cfg, "max_model_len")
        prefill_says = (f"{prefill_len}" if prefill_len is not None else "not set (the model's max_seq_len)")
        evidence = []
        for rid, _, lines in hits[:2]:
            t = ctx.timelines[rid]
            evidence += t.events(events.ROUTER_PREFILL_DONE)[:1] + [r for r in t.records if r.service == "prefill"][:1]
            evidence += lines[:1] + t.events(events.ROUTER_DECODE_FAILED, events.ROUTER_UPSTREAM_ERROR)[:1]
        out.append(finding(
            "config.max_model_len_mismatch", "error",
            f"max_model_len mismatch: decode {decode_len} ({decode_file}) vs prefill {prefill_says} ({prefill_file}): "
            f"{len(hits)} request(s) prefilled, then refused by decode",
            f"Prefill accepted the prompt (its limit is larger), computed the KV, then decode refused the request "
            f"because prompt + max_tokens exceeds its max_model_len {decode_len}. Decode logs this at WARNING "
            "(http.bad_request), not ERROR.",
            f"give both engines the same max_model_len: set \"max_model_len\" in {decode_file} and {prefill_file} to "
            f"the same value, then docker compose up -d --force-recreate prefill decode",
            evidence, [rid for rid, _, _ in hits]))
    if facts.live and prefill_cfg is not None and decode_cfg is not None:
        differ = [k for k in MUST_AGREE if k != "max_model_len" or not hits
                  if _value(prefill_cfg, k) != _value(decode_cfg, k)]
        if differ:
            values = "; ".join(f"{k}: prefill {_value(prefill_cfg, k)!r}, decode {_value(decode_cfg, k)!r}" for k in differ)
            starting = [r for r in ctx.by_event(events.SERVICE_STARTING) if r.service in ("prefill", "decode")]
            out.append(finding(
                "config.pd_mismatch", "warning", f"prefill and decode configs disagree on {', '.join(differ)}",
                f"{values} ({prefill_file} vs {decode_file}). These keys must agree for the KV one engine computes to "
                "be usable by the other.",
                f"make {', '.join(differ)} equal in {prefill_file} and {decode_file}, then docker compose up -d "
                "--force-recreate prefill decode", starting[:2]))
    return out
