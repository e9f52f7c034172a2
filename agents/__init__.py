"""RLlib side of the project: models, RLModules, algorithms and the command-line tools."""


def exit_with(code) -> None:
    """Ends a command-line run with `code`. The garbage collector is frozen first: what is left
    is freed by the exit itself, and Python's last collections over torch's, transformers' and
    RLlib's objects took about a second per process (exit handlers, Ray's shutdown, still run)."""
    import gc
    import sys

    gc.freeze()
    sys.exit(code)
