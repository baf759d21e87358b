"""Shared test setup. Area fixtures live in each folder's own conftest.py."""

import os

# Ryuk's image cannot be pulled where there is no registry; compose tests clean up themselves.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
