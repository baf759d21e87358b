"""Helpers for the doctor unit tests: a one-call diagnosis of log files (the bundles: see the `bundles` fixture)."""

from __future__ import annotations

from pathlib import Path

from doctor import environment
from doctor.checks import run_checks
from doctor.findings import Context
from doctor.sources import load_files


def diagnose(*logs: Path | str, client: tuple[Path | str, ...] = (), home: Path | None = None,
             environ: dict | None = None, router_url: str = "http://localhost:8080"):
    """Run every diagnosis on log files (and client output) → (findings, context); no home unless given."""
    loaded = load_files([str(p) for p in logs], [str(c) for c in client])
    env = environment.snapshot(home or Path(logs[0]).parent / "no-home", environ=environ or {}, router_url=router_url)
    ctx = Context.build(loaded.records, env, loaded.stats)
    return run_checks(ctx), ctx


def by_id(findings, fid: str):
    matches = [f for f in findings if f.id == fid]
    assert matches, f"no finding {fid}; got {[f.id for f in findings]}"
    return matches[0]
