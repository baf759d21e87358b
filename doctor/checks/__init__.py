"""One module per diagnosis; each exposes a pure `check(ctx) -> list[Finding]` (see doctor.findings)."""
