"""`python -m replayssm_jax COMMAND [args]`: the project's entry points.

  check  replay decode against the scan reference on a built-in config (agreement + bytes)
  demo   the model demo (`replayssm_jax.model.demo`)

Each command's module is imported only when that command runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple


class Command(NamedTuple):
    module: str
    help: str


COMMANDS: dict[str, Command] = {
    "check": Command(
        "replayssm_jax.check_job",
        "run a few hundred replay decode steps against the scan reference and print the "
        "agreement and the state bytes per step versus plain decode",
    ),
    "demo": Command("replayssm_jax.model.demo", "run the model demo"),
}


def build_parser() -> argparse.ArgumentParser:
    """Top-level parser: a command name, then that command's own arguments."""
    listing = "\n".join(f"  {name:<7}{cmd.help}" for name, cmd in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="python -m replayssm_jax",
        description="ReplaySSM decode for Gated DeltaNet / KDA layers in JAX.",
        epilog=f"commands:\n{listing}\n\n`python -m replayssm_jax COMMAND -h` shows a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=list(COMMANDS), help="what to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the command")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Dispatch to `COMMANDS[argv[0]]`'s `main(rest)`; print help when no command is given."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        parser.print_help()
        return 0
    parsed = parser.parse_args(argv)
    module = importlib.import_module(COMMANDS[parsed.command].module)
    return module.main(parsed.args)


if __name__ == "__main__":
    sys.exit(main())
