"""Prefill and decode started differently: what each engine printed at start-up, compared key by key.

vLLM prints its configuration (`non-default args: {…}`, `Initializing a V1 LLM engine (v…) with config: model=…,
tokenizer=…, dtype=…`, `Using max model len N`, `… KV cache size: N tokens`); our engine logs `service.starting`. The
keys in engine_facts.COMPARED must agree for the KV prefill computes to be the KV decode reads: a different max length
refuses prompts prefill accepted, a different tokenizer makes decode read another token sequence than the KV holds
(silently wrong answers, or an engine core crash). Each differing key is one finding naming both values, both lines
and the requests it broke; the generic findings for those requests (a failed decode, an unexplained 5xx) step back.
"""

from __future__ import annotations

import re

from doctor import engine_facts
from doctor.findings import Context, Finding, finding
from doctor.timeline import Timeline
from stack.common import events

# What the requests a mismatch broke show in their lines (vLLM's messages, the router's relay of them).
SYMPTOMS = {
    "max_model_len": re.compile(r"maximum context length|max_model_len|longer than the maximum model length|"
                                r"is too long|exceeds"),
}
WHY = {
    "max_model_len": "prefill accepts a prompt up to its limit, computes its KV, then decode refuses it (prompt + "
                     "max_tokens over decode's limit)",
    "tokenizer": "decode re-tokenizes the prompt into other tokens than prefill did: the KV it pulls belongs to another "
                 "token sequence, so answers are silently wrong, or a token count that does not match the KV blocks "
                 "crashes decode's engine core",
    "block_size": "NIXL maps KV blocks one to one: every handshake fails",
    "dtype": "the KV bytes are laid out for another dtype: NIXL refuses the transfer (compatibility hash)",
    "kv_cache_dtype": "the KV bytes are laid out for another dtype: NIXL refuses the transfer (compatibility hash)",
    "model": "decode continues another model's KV",
}
FLAG = {"max_model_len": "--max-model-len", "tokenizer": "--tokenizer", "block_size": "--block-size",
        "dtype": "--dtype", "kv_cache_dtype": "--kv-cache-dtype", "model": "--model"}


def _broken(ctx: Context, key: str) -> list[Timeline]:
    """The requests the mismatch broke: failed ones (with the key's symptom when it has one); for a tokenizer also
    every answered one that decode continued from prefill's KV (decode re-tokenized its prompt: wrong by construction)."""
    out = []
    symptom = SYMPTOMS.get(key)
    for t in ctx.timelines.values():
        failed = not t.complete and (t.status or 0) != 499 and t.first(events.ROUTER_CLIENT_DISCONNECTED) is None
        if failed and (symptom is None or any(symptom.search(r.line) for r in t.records)):
            out.append(t)
        elif key == "tokenizer" and t.complete and t.first(events.ROUTER_PREFILL_DONE) is not None:
            out.append(t)
    return out


def _shown(value: object) -> str:
    return "the default" if value is None else repr(value)


def check(ctx: Context) -> list[Finding]:
    runs = engine_facts.starts(ctx)
    if not runs.get("prefill") or not runs.get("decode"):
        return []
    prefill, decode = runs["prefill"][-1], runs["decode"][-1]
    out: list[Finding] = []
    for key in engine_facts.COMPARED:
        a, b = prefill.values.get(key), decode.values.get(key)
        # an unset block size is vLLM's default on both; one set and one not may still differ
        if a == b or (key != "block_size" and (a is None or b is None)):
            continue
        broken = _broken(ctx, key)
        evidence = prefill.evidence(key) + decode.evidence(key)
        for t in broken[:2]:
            router = [r for r in t.records if r.service == "router"]
            evidence += ([r for r in router if r.level == "ERROR" or r.event == events.ROUTER_UPSTREAM_ERROR]
                         or t.events(events.ROUTER_REQUEST_DONE))[:1]
            evidence += [r for r in t.records if r.service == "decode"][:1]
        kind = prefill.kind if prefill.kind == decode.kind else f"{prefill.kind}/{decode.kind}"
        failed = sum(not t.complete for t in broken)
        wrong = len(broken) - failed
        effect = ", ".join(p for p in (f"{failed} request(s) failed" if failed else "",
                                       f"{wrong} answered from the wrong tokens" if wrong else "") if p) or \
            "no request broken in this window yet"
        out.append(finding(
            f"config.{key}_mismatch", "error",
            f"{key} differs: prefill {_shown(a)}, decode {_shown(b)} (their start-up lines); {effect}",
            f"Prefill and decode must agree on {key} for PD: {WHY.get(key, 'the KV is not what decode expects')}. "
            f"Read from the engines' own start-up configuration ({kind}).",
            _fix(ctx, kind, key, a, b), evidence, [t.request_id for t in broken]))
    return out


def _fix(ctx: Context, kind: str, key: str, a: object, b: object) -> str:
    want = a if a is not None else b
    if "vllm" in kind:
        how = f"start prefill and decode with the same {FLAG.get(key, key)} {want}"
        if key == "tokenizer":
            how = "start decode with prefill's tokenizer (the same --tokenizer, or none on both: the model's own)"
    else:
        file = ctx.facts.config_file("decode")[0]
        how = f"set \"{key}\": {want!r} in {file} as in {ctx.facts.config_file('prefill')[0]}"
    then = "docker compose up -d --force-recreate prefill decode" if engine_facts.compose(ctx) else \
        "restart both engines, then: python -m doctor check --router-url … --prefill-url … --decode-url …"
    return f"{how}; {then}"
