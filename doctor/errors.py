"""The doctor's own failures (exit code 2): it could not run, as opposed to finding problems."""

from __future__ import annotations


class DoctorError(Exception):
    """The doctor itself could not run: no docker, no logs found, bad usage."""
