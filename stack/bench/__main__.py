"""`python -m stack.bench serve|compare` — see docs/benchmark.md."""

from __future__ import annotations

import argparse
import shlex
import sys

from stack.bench import compare, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stack.bench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve.add_cli_args(commands.add_parser("serve", help="one run against a server (vllm bench serve flags)"))
    compare.add_cli_args(
        commands.add_parser("compare", help="colocated vs disaggregated stack, same cores, same workload")
    )
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.command_line = "python -m stack.bench " + shlex.join(argv)  # recorded in the compare report
    return serve.main(args) if args.command == "serve" else compare.main(args)


if __name__ == "__main__":
    sys.exit(main())
