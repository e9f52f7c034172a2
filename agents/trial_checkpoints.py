"""What a `--resume` does with each restored trial's checkpoints on the storage path, before any
trial runs again: deletes the ones no trial names (`remove_unnamed_checkpoints`), and sends a trial
whose newest one is gone or damaged back to its newest whole one (`go_back_from_lost_checkpoints`).
Both read private names of Ray Train's `_CheckpointManager`, pinned in tests/test_rllib_contract.py.
"""
from __future__ import annotations

import os
import re


def remove_unnamed_checkpoints(trials) -> list[str]:
    """Deletes the checkpoint folders in the trials' folders on the storage path that no restored
    trial names (`--resume`, before any trial runs again): the ones a killed driver's retention had
    dropped and not deleted yet (its deletions waited for a copy), and the one a trial was writing
    when it was killed (the resumed trial would write its next checkpoint into it). A checkpoint
    any trial names stays, in another trial's folder too (PBT restores a trial from another's).
    Returns the paths deleted."""
    import pyarrow.fs
    from ray.train._internal.storage import _delete_fs_path

    named = set()
    for trial in trials:
        results = [*trial.run_metadata.checkpoint_manager._checkpoint_results, trial.latest_checkpoint_result]
        named |= {os.path.normpath(r.checkpoint.path) for r in results if r is not None and r.checkpoint is not None}
    removed = []
    for trial in trials:
        fs = trial.storage.storage_filesystem
        try:
            found = fs.get_file_info(pyarrow.fs.FileSelector(trial.storage.trial_fs_path, allow_not_found=True))
        except (OSError, RuntimeError):  # the trial has no folder (yet)
            continue
        for info in found:
            if (info.type == pyarrow.fs.FileType.Directory and re.fullmatch(r"checkpoint_\d+", info.base_name)
                    and os.path.normpath(info.path) not in named):
                _delete_fs_path(fs=fs, fs_path=info.path)
                removed.append(info.path)
    return removed


def go_back_from_lost_checkpoints(trials, say=None) -> None:
    """A restored trial whose newest checkpoint is gone from the storage path (deleted by hand, a
    disk lost) or damaged (on a local one: a file cut short, changed or missing, by its
    `MANIFEST`) goes on from its newest whole one, or from its start where none is: Tune would
    fail the trial ("does not exist on storage anymore", or an unpickling error) at every
    `--resume`. A damaged one no trial names after this is deleted by the resume
    (`remove_unnamed_checkpoints`), as the one a killed trial was writing is. `say(line)`: one
    line per trial sent back."""
    import pyarrow.fs

    from agents.whole_files import damaged

    checked: dict[str, str | None] = {}  # path -> what is wrong with it: each checkpoint read once

    def gone(result) -> bool:
        return trial.storage.storage_filesystem.get_file_info(result.checkpoint.path).type != pyarrow.fs.FileType.Directory

    def problem(result) -> str | None:
        path = result.checkpoint.path
        if path not in checked:
            local = isinstance(trial.storage.storage_filesystem, pyarrow.fs.LocalFileSystem)
            checked[path] = "is gone from" if gone(result) else (
                f"is damaged ({why}) in" if local and (why := damaged(path)) else None)
        return checked[path]

    for trial in trials:
        manager, latest = trial.run_metadata.checkpoint_manager, trial.latest_checkpoint_result
        if latest is None or latest.checkpoint is None or not (why := problem(latest)):
            continue
        # the trial's checkpoints in the order it saved them (a PBT exploit restarts its iterations)
        older = [r for r in manager._checkpoint_results if r.checkpoint is not None and not gone(r)
                 and r.checkpoint.path != latest.checkpoint.path]
        while older and problem(older[-1]):  # down to the newest whole one (those before it are not read)
            older.pop()
        newest = older[-1] if older else None
        manager._checkpoint_results, manager._latest_checkpoint_result = older, newest
        if say:
            to = (f"its newest one left, {os.path.basename(newest.checkpoint.path)} (iteration "
                  f"{(newest.metrics or {}).get('training_iteration', '?')})" if newest else "its start (none is left)")
            say(f"--resume: trial {trial.trial_id}'s checkpoint {os.path.basename(latest.checkpoint.path)} {why} "
                f"{os.path.dirname(latest.checkpoint.path)}; it goes on from {to}")
