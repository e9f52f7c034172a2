"""Files written whole: each is written beside its target under a partial name and renamed over it
(`os.replace`, atomic), so a process killed at any moment leaves the file as it was or as it is
now, never cut short. A killed writer's partial file is left behind; `remove_partial_files` removes
them (an experiment's before a resume, a warm start's output before it goes on). The standard
library only."""
from __future__ import annotations

import os
import re
import threading

PARTIAL = ".partial-"  # a file being written whole: <name>.partial-<pid>-<thread>
PARTIAL_NAME = re.compile(r"\.partial-\d+-\d+$")


def partial_path(path: str) -> str:
    """Where this thread writes `path` before renaming it into place (a name of its own per
    process and thread: two writers of one file never share a partial file)."""
    return f"{path}{PARTIAL}{os.getpid()}-{threading.get_ident()}"


def remove_partial_files(folder: str, *, recursive: bool = False) -> None:
    """Removes the partial files killed writers left in `folder` (and its subfolders: `recursive`);
    each one's target is whole, as it was before or as it is now."""
    for parent, dirs, files in os.walk(folder):
        for name in files:
            if PARTIAL_NAME.search(name):
                os.remove(os.path.join(parent, name))
        if not recursive:
            break


def write_whole(path: str, write, *, exclusive: bool = False) -> None:
    """Writes the file `path` whole: `write(f)` fills `f` (a file open for writing bytes) beside
    it, then it is renamed into place. `exclusive`: creates the file, and raises FileExistsError
    where it exists (of two writers, one gets it; on a filesystem without hard links the file is
    still written, though not exclusively)."""
    partial = partial_path(path)
    try:
        with open(partial, "wb") as f:
            write(f)
        if exclusive:
            try:
                os.link(partial, path)  # fails where the file exists
                return
            except FileExistsError:
                raise
            except OSError:  # no hard links here
                pass
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
