"""`gpu-planner` command line; its subcommands come from the `gpu_planner.commands` entry points.

Each entry point names a function `add_command(subparsers)` that adds one
subparser and sets its `run(args) -> int` as the parser's `run` default. The
integrations (the demo, `info`) register themselves that way, so the core
imports none of them.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

COMMAND_GROUP = "gpu_planner.commands"


def build_parser() -> argparse.ArgumentParser:
    """The `gpu-planner` parser with every installed subcommand."""
    parser = argparse.ArgumentParser(prog="gpu-planner", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in sorted(entry_points(group=COMMAND_GROUP), key=lambda point: point.name):
        command.load()(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `gpu-planner` script."""
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
