"""`python -m doctor …` — see doctor.cli."""

from doctor.cli import run

run()
