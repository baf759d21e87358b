"""404 model_not_found: the client asks for a model name the router does not serve.

Claude Code asks for claude-* names (its default and small/fast model) unless every ANTHROPIC_*_MODEL
variable is set; the router then needs `model_aliases = ["claude-*"]` in [taotoken] of
router/settings.toml. Relies on the router's http.bad_request (code model_not_found; its message
names the model asked for and the one served).
"""

from __future__ import annotations

import re
from collections import Counter

from doctor.findings import Context, Finding, finding
from stack.common import events

_ASKED = re.compile(r"The model '([^']+)' does not exist")
_SERVED = re.compile(r"it serves '([^']+)'")


def check(ctx: Context) -> list[Finding]:
    missing = [r for r in ctx.by_event(events.HTTP_BAD_REQUEST) if r.service == "router"
               and r[events.CODE] == "model_not_found"]
    if not missing:
        return []
    asked: Counter[str] = Counter()
    served = None
    for r in missing:
        m = _ASKED.search(r.msg)
        asked[m.group(1) if m else "?"] += 1
        s = _SERVED.search(r.msg)
        served = s.group(1) if s else served
    claude = sorted(m for m in asked if m.startswith("claude-"))
    names = ", ".join(f"{m!r} ×{n}" for m, n in asked.items())
    if claude:
        cause = (f"The client asked for {names}: Claude Code (or an Anthropic SDK client with its default) asks for "
                 f"claude-* models, which this router does not serve" + (f" (it serves {served!r})" if served else "")
                 + ".")
        fix = ('router/settings.toml [taotoken]: model_aliases = ["claude-*"]  then docker compose up -d router; '
               f"or set ANTHROPIC_MODEL and ANTHROPIC_SMALL_FAST_MODEL to {served or 'the served model'!r} for the client")
    else:
        cause = (f"The client asked for {names}, which the router does not serve"
                 + (f"; it serves {served!r} (GET /v1/models)" if served else "") + ".")
        fix = (f"send model={served or '<the id GET /v1/models lists>'!r}, or add the name to model_aliases in "
               "router/settings.toml [taotoken] and docker compose up -d router")
    return [finding("model.not_found", "error", f"{len(missing)} request(s) asked for a model the router does not "
                    f"serve ({', '.join(asked)})", cause, fix, missing[:3],
                    [r.request_id for r in missing])]
