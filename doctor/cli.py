"""`python -m doctor diagnose | explain | check | verify` — argparse front end; exit 0 / 1 / 2.

diagnose: read logs (compose project via the Docker API, or --logs files/folders/stdin), join them
          by request id, run every diagnosis, print findings.
explain:  one request's timeline across the services with per-hop durations, as text and a PNG/SVG.
check:    live probes of the running stack (docker, compose, containers, key, router, proxies,
          engine health, KV port, one streamed request); with --prefill-url/--decode-url, of engines
          run as processes or elsewhere, over HTTP (doctor/remote.py).
verify:   send one streamed request through the router and prove from the logs that it went
          prefill → KV → decode.
advise:   watch the router's /metrics under load and recommend more prefill, more decode or balanced,
          with the numbers behind it (doctor/advise.py).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence, TextIO

from doctor import environment, render, sources
from doctor.errors import DoctorError
from doctor.checks import REGISTRY, STALLED, UNEXPLAINED, run_checks
from doctor.findings import Context, Finding

EPILOG = "exit codes: 0 no failure (warnings too, unless --strict), 1 findings, 2 the doctor could not run"


def _common(sub: bool) -> argparse.ArgumentParser:
    """Global options, accepted before or after the command (after it, they must not reset the defaults)."""
    common = argparse.ArgumentParser(add_help=False)
    default = {"default": argparse.SUPPRESS} if sub else {}
    common.add_argument("--json", action="store_true", help="print the report as JSON (schema in docs/doctor.md)",
                        **default)
    common.add_argument("-v", "--verbose", action="store_true", help="show cause, evidence lines and fix", **default)
    common.add_argument("--no-color", action="store_true", help="plain ASCII marks, no colour (also NO_COLOR=1)",
                        **default)
    common.add_argument("--strict", action="store_true", help="exit 1 on warnings too", **default)
    common.add_argument("--project", help="compose project name (default: auto-detect from container labels)",
                        **default)
    common.add_argument("--home", help="home folder holding .claude/ and .codex/ (default: $HOME)", **default)
    common.add_argument("--router-url", help="the router as clients should reach it (default: the router "
                        "container's published port, $PD_ROUTER_URL or http://localhost:8080)", **default)
    return common


def build_parser() -> argparse.ArgumentParser:
    common = _common(sub=True)
    parser = argparse.ArgumentParser(prog="python -m doctor", parents=[_common(sub=False)], epilog=EPILOG,
                                     description="Diagnose the PD stack from its logs and the client configuration.")
    sub = parser.add_subparsers(dest="command", required=True)
    diagnose = sub.add_parser("diagnose", parents=[common], epilog=EPILOG,
                              help="read router/prefill/decode logs and diagnose failures")
    diagnose.add_argument("--logs", action="append", default=[], metavar="PATH",
                          help="log file or folder (docker compose logs output or JSON lines); '-' for stdin; "
                               "repeatable. Default: the running compose project's containers")
    diagnose.add_argument("--client-log", action="append", default=[], metavar="FILE",
                          help="a client's output (SDK traceback, Claude Code / Codex error); repeatable")
    diagnose.add_argument("--since", help="only lines since a duration ago (10m, 2h) or an ISO-8601 time")
    diagnose.add_argument("--request-id", help="only this request (and the start-up lines around it)")
    diagnose.add_argument("--check", action="append", default=[], metavar="ID",
                          help="run only these diagnoses (see --list-checks)")
    diagnose.add_argument("--list-checks", action="store_true", help="list the diagnoses and exit")

    explain = sub.add_parser("explain", parents=[common], epilog=EPILOG,
                             help="one request's hops (router queue, prefill, KV push, decode first token, stream)")
    explain.add_argument("request_id", help="the request id (X-Request-ID, or the id in a finding)")
    explain.add_argument("--logs", action="append", default=[], metavar="PATH",
                         help="log file or folder, '-' for stdin (default: the running compose project's containers)")
    explain.add_argument("--since", help="only lines since a duration ago (10m, 2h) or an ISO-8601 time")
    explain.add_argument("--out", metavar="FILE", help="the picture to write, .png or .svg "
                         "(default: doctor-explain-<request id>.png)")
    explain.add_argument("--no-picture", action="store_true", help="text only")

    check = sub.add_parser("check", parents=[common], epilog=EPILOG, help="live probes of the running stack")
    check.add_argument("--timeout", type=float, default=60.0, help="seconds for the end-to-end request")
    verify = sub.add_parser("verify", parents=[common], epilog=EPILOG,
                            help="send one streamed request and prove it went prefill → KV → decode")
    verify.add_argument("--timeout", type=float, default=60.0, help="seconds for the request")
    verify.add_argument("--logs", action="append", default=[], metavar="PATH",
                        help="the router's and engines' log files or folder (a deployment without compose)")
    for live_command in (check, verify):  # engines run as processes or on other hosts: no compose project needed
        for role in ("prefill", "decode"):
            live_command.add_argument(f"--{role}-url", action="append", default=[], metavar="URL",
                                      help=f"a {role} engine's base URL (repeatable); probes it over HTTP, no Docker")
    verify.add_argument("--model", default=None, help="model name to request (default: the router's first model)")
    advise = sub.add_parser("advise", parents=[common], epilog=EPILOG,
                            help="more prefill, more decode or balanced, from the router's metrics under the current load")
    advise.add_argument("--window", type=float, default=30.0, help="seconds to watch the router's /metrics (default 30)")
    advise.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes (default 2)")
    advise.add_argument("--ttft-slo-ms", type=float, help="TTFT target (default: the router's PD_SLO_TTFT_MS)")
    advise.add_argument("--tpot-slo-ms", type=float, help="TPOT target (default: the router's PD_SLO_TPOT_MS)")
    return parser


def load_context(args: argparse.Namespace, stdin: TextIO | None = None) -> tuple[Context, sources.Loaded]:
    """The logs (files or the compose project) and the client side, joined into one Context."""
    since = sources.parse_since(args.since) if args.since else None
    if args.logs:
        loaded = sources.load_files(args.logs, args.client_log, stdin)
        records = sources.since_filter(loaded.records, since) if since else loaded.records
    else:  # the daemon filters by its own clock, which skewed containers do not share
        loaded = sources.load_docker(args.project, since)
        sources.add_client_logs(loaded, args.client_log)
        records = loaded.records
    # A quiet window is not a failure: the project's containers (or files) were read, they just logged nothing since.
    quiet = since is not None and (loaded.docker is not None or loaded.stats.lines > 0)
    if not records and not quiet:
        raise DoctorError(f"no log lines found in {', '.join(loaded.sources) or 'the given sources'} "
                          f"({loaded.stats.unreadable} unreadable)")
    published = (loaded.docker or {}).get("router_url")
    env = environment.snapshot(args.home, router_url=args.router_url or published)
    return Context.build(records, env, loaded.stats, loaded.docker), loaded


def diagnose(args: argparse.Namespace, stdin: TextIO | None = None) -> tuple[list[Finding], dict]:
    known = {check.id for check in REGISTRY} | {STALLED, UNEXPLAINED}
    unknown = sorted(set(args.check) - known)
    if unknown:
        raise DoctorError(f"--check {', '.join(unknown)}: unknown (known: {', '.join(sorted(known))})")
    ctx, loaded = load_context(args, stdin)
    if args.request_id:
        narrowed = ctx.narrow(args.request_id)
        if narrowed is None:
            raise DoctorError(f"--request-id {args.request_id}: not in the logs ({len(ctx.timelines)} requests seen)")
        ctx = narrowed
    findings = run_checks(ctx, args.check)
    summary = {
        "sources": loaded.sources,
        "lines": loaded.stats.lines,
        "records": loaded.stats.records,
        "unreadable": loaded.stats.unreadable,
        "ignored": loaded.stats.ignored,
        "undeclared": loaded.stats.undeclared,  # lines whose event or fields differ from stack/common/events.py
        "requests": len(ctx.timelines),
        "complete": sum(t.complete for t in ctx.timelines.values()),
    }
    return findings, summary


def main(argv: Sequence[str] | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    out = stdout or sys.stdout
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage, 0 on --help
        return int(exc.code or 0)
    if getattr(args, "list_checks", False):
        for check in REGISTRY:
            out.write(f"{check.id:<12} {check.summary}\n")
        return 0
    if args.command == "explain":
        return _explain(args, stdin, out)
    if args.command == "advise":
        return _advise(args, out)
    try:
        if args.command == "diagnose":
            findings, summary = diagnose(args, stdin)
        else:
            from doctor import live, remote

            where = remote if remote.wanted(args) else live
            findings, summary = (where.check if args.command == "check" else where.verify)(args)
    except DoctorError as exc:
        render.render_failure(str(exc), args.json, out)
        return 2
    if args.json:
        out.write(render.render_json(findings, summary, args.command))
    else:
        style = render.Style.detect(out, args.verbose, args.no_color)
        out.write(render.render_text(findings, style, summary, args.command))
    return render.exit_code(findings, args.strict)


def _explain(args: argparse.Namespace, stdin: TextIO | None, out: TextIO) -> int:
    from pathlib import Path

    from doctor import explain

    args.client_log = []
    try:
        ctx, _ = load_context(args, stdin)
        timeline = ctx.timeline(args.request_id)  # the router's id or the client's X-Request-ID
        if timeline is None:
            raise DoctorError(f"{args.request_id}: not in the logs ({len(ctx.timelines)} requests seen)")
        picture = None
        if not args.no_picture:
            picture = explain.picture(timeline, Path(args.out or f"doctor-explain-{args.request_id}.png"))
    except DoctorError as exc:
        render.render_failure(str(exc), args.json, out)
        return 2
    if args.json:
        import json

        out.write(json.dumps({"schema_version": render.SCHEMA_VERSION, "command": "explain",
                              "request_id": args.request_id, "status": timeline.status, "complete": timeline.complete,
                              "hops": [vars(h) for h in explain.hops(timeline)],
                              "picture": str(picture) if picture else None}, indent=2) + "\n")
    else:
        out.write(explain.text(timeline) + (f"picture: {picture}\n" if picture else ""))
    return 0 if timeline.complete else 1


def _advise(args: argparse.Namespace, out: TextIO) -> int:
    from doctor import advise, live

    ttft, tpot = (value / 1000 if value else None for value in (args.ttft_slo_ms, args.tpot_slo_ms))
    url = live.router_url(None, args.router_url)
    try:
        if args.window <= 0 or args.interval <= 0:
            raise DoctorError(f"--window and --interval must be > 0 s, got {args.window:g} and {args.interval:g}")
        seen = advise.window(advise.scrape_metrics(url, args.window, args.interval))
    except DoctorError as exc:
        render.render_failure(str(exc), args.json, out)
        return 2
    found = advise.findings(advise.advise(seen, ttft, tpot), seen, ttft, tpot)
    summary = {"router_url": url, "window_s": round(seen.seconds, 1), "requests": seen.requests}
    if args.json:
        out.write(render.render_json(found, summary, "advise"))
    else:
        out.write(advise.text(found[0]))
    return 0


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    run()
