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


# A checkpoint's list of its files (relative path -> [bytes, CRC-32]), written last by its save:
# a file since cut short, changed or lost is found before a resume goes on from it (`damaged`).
MANIFEST = "checkpoint_files.json"


def _crc32(path: str) -> int:
    import zlib

    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(folder: str):
    for parent, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(parent, name), folder).replace(os.sep, "/")
            if rel != MANIFEST and not PARTIAL_NAME.search(name):
                yield rel


def write_manifest(folder: str) -> None:
    """Writes `folder`'s MANIFEST: each file's size and CRC-32, as it is now."""
    import json

    entries = {rel: [os.path.getsize(os.path.join(folder, rel)), _crc32(os.path.join(folder, rel))]
               for rel in sorted(_files(folder))}
    write_whole(os.path.join(folder, MANIFEST), lambda f: f.write(json.dumps(entries, indent=0).encode()))


def damaged(folder: str, under: str = "") -> str | None:
    """Why `folder`'s files (those `under` its subfolder, where given) are not the ones its
    MANIFEST lists (the first file missing, cut short or changed), or None: they are, or it has no
    MANIFEST (written before there was one). Files added since are not looked at."""
    import json

    try:
        with open(os.path.join(folder, MANIFEST), "rb") as f:
            entries = json.loads(f.read())
        prefix = under.replace(os.sep, "/").rstrip("/") + "/" if under else ""
        entries = {rel: (int(size), int(crc)) for rel, (size, crc) in entries.items() if rel.startswith(prefix)}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, AttributeError):  # cut short, or not a list of files
        return f"its {MANIFEST} cannot be read"
    for rel, (size, _) in entries.items():  # every file's size first (no file read), then their bytes
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        if os.path.getsize(path) != size:
            return f"{rel} holds {os.path.getsize(path):,} bytes of {size:,}"
    return next((f"{rel} changed since it was saved" for rel, (_, crc) in entries.items()
                 if _crc32(os.path.join(folder, rel)) != crc), None)
