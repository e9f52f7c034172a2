"""The server's settings as its command line checks them: the replicas' batching defaults,
the requests a replica takes at a time (`max_ongoing_requests`) and the replicas' Serve options
(`replica_options`). The standard library only, so that `python -m agents.serve` refuses a bad
flag, port or checkpoint before it imports Ray, torch or FastAPI (`agents.serve.cli`).
"""
from __future__ import annotations

BATCH_ROWS = 16  # rows stepping together in a replica (--batch-rows)
MAX_QUEUE = 256  # completions that may wait for a row before a request is refused with 429 (--max-queue)
# Decode steps per block: rows join, leave and stream between blocks, and the host reads the
# tokens once per block (on a GPU the block's steps replay captured graphs with the head, each
# row's sampler and the draw inside).
BATCH_BLOCK = 8
MAX_ONGOING_REQUESTS = 8  # per replica without batching: validation answers while a generation runs


def max_ongoing_requests(batch_rows: int = BATCH_ROWS, max_queue: int = MAX_QUEUE) -> int:
    """Requests Serve lets into one replica at a time: every row and queue place, and some more,
    so that the replica (not Serve's proxy) answers a full queue with 429; without batching, 8."""
    return batch_rows + max_queue + MAX_ONGOING_REQUESTS if batch_rows > 0 else MAX_ONGOING_REQUESTS


def replica_options(num_replicas: int | None = None, min_replicas: int | None = None,
                    max_replicas: int | None = None, target_ongoing_requests: float | None = None, *,
                    max_ongoing: int = MAX_ONGOING_REQUESTS, default_target: float = 2.0) -> dict:
    """Serve deployment options for a fixed number of replicas or for autoscaling (when
    `max_replicas` is given); raises ValueError naming the flag for a combination that cannot work.
    `max_ongoing`: the requests a replica takes at a time (`max_ongoing_requests`);
    `default_target`: the autoscaling target when none is given."""
    if max_replicas is None:
        for flag, value in (("--min-replicas", min_replicas), ("--target-ongoing-requests", target_ongoing_requests)):
            if value is not None:
                raise ValueError(f"{flag} needs --max-replicas (autoscaling runs between --min-replicas and it)")
        n = 1 if num_replicas is None else num_replicas
        if n < 1:
            raise ValueError(f"--num-replicas must be >= 1 (got {n})")
        return {"num_replicas": n}
    lo = 1 if min_replicas is None else min_replicas
    if lo < 0:
        raise ValueError(f"--min-replicas must be >= 0 (got {lo})")
    if max_replicas < max(lo, 1):
        raise ValueError(f"--max-replicas must be >= 1 and >= --min-replicas {lo} (got {max_replicas})")
    start = max(lo, 1) if num_replicas is None else num_replicas
    if not lo <= start <= max_replicas:
        raise ValueError(f"--num-replicas (the replicas to start with when autoscaling) must lie in "
                         f"[--min-replicas, --max-replicas] = [{lo}, {max_replicas}] (got {start})")
    target = default_target if target_ongoing_requests is None else target_ongoing_requests
    if not 0 < target <= max_ongoing:
        raise ValueError(f"--target-ongoing-requests must be in (0, {max_ongoing}] (a replica takes "
                         f"{max_ongoing} requests at a time; got {target:g})")
    return {"autoscaling_config": {"min_replicas": lo, "max_replicas": max_replicas, "initial_replicas": start,
                                   "target_ongoing_requests": target}}
