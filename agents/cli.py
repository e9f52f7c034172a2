"""The `tokenmdp` command: one entry point for every tool of the package.

    tokenmdp train CONFIG.yaml [--set key=value ...] [--resume]
    tokenmdp generate --checkpoint PATH [--prompt TEXT ...]
    tokenmdp evaluate MODEL [MODEL ...] [--config RL.yaml] | --curves RUN ...
    tokenmdp pretrain CONFIG.yaml [--set key=value ...]
    tokenmdp export --checkpoint PATH --out DIR
    tokenmdp serve --checkpoint PATH [--port 8000]
    tokenmdp demo

`tokenmdp COMMAND --help` shows a command's options. Each command is also
`python -m agents.COMMAND` with the same arguments.
"""
from __future__ import annotations

import importlib
import os
import sys

PROG = "tokenmdp"
COMMANDS = {  # name -> (module, one-line summary)
    "train": ("agents.train", "train a policy from a YAML experiment config (Ray Tune + RLlib)"),
    "generate": ("agents.generate", "generate text with a trained policy"),
    "evaluate": ("agents.evaluate", "evaluate policies side by side; plot training curves"),
    "pretrain": ("agents.pretrain", "supervised warm start (teacher forcing, scheduled sampling)"),
    "export": ("agents.export", "export a policy as a plain Hugging Face model directory"),
    "serve": ("agents.serve", "serve a policy over HTTP with Ray Serve (/generate, /v1/completions)"),
    "demo": ("agents.demo", "the offline sentiment demo: corpus -> warm start -> PPO -> evaluation"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROG} COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", f"`{PROG} COMMAND --help` shows a command's options."]
    return "\n".join(lines)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version(PROG)
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "unknown (not installed)"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        print(f"{PROG} {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (commands: {', '.join(COMMANDS)})"
        print(f"{PROG}: error: unknown command {name!r}{hint}", file=sys.stderr)
        return 2
    # As `python -m` does: your own modules (rewards, tasks: `module:attr` in a config) import from
    # the directory you run in. Appended, so an installed package is never shadowed by a folder here.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(rest, prog=f"{PROG} {name}")


def run() -> None:
    """The `tokenmdp` command (pyproject.toml's entry point)."""
    from agents import exit_with

    exit_with(main())


if __name__ == "__main__":
    run()
