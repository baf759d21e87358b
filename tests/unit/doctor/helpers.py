"""Helpers for the doctor unit tests: the recorded bundles and a one-call diagnosis."""

from __future__ import annotations

from pathlib import Path

from doctor import environment
from doctor.findings import Context, run_checks
from doctor.sources import load_files

BUNDLES = Path(__file__).parent / "bundles"


def diagnose(*names: str, client: tuple[str, ...] = (), home: Path | None = None, environ: dict | None = None,
             router_url: str = "http://localhost:8080"):
    """Run every diagnosis on bundle files → (findings, context)."""
    loaded = load_files([str(BUNDLES / n) for n in names], [str(BUNDLES / c) for c in client])
    env = environment.snapshot(home or BUNDLES / "no-home", environ=environ or {}, router_url=router_url)
    ctx = Context.build(loaded.records, env, loaded.stats)
    return run_checks(ctx), ctx


def by_id(findings, fid: str):
    matches = [f for f in findings if f.id == fid]
    assert matches, f"no finding {fid}; got {[f.id for f in findings]}"
    return matches[0]
