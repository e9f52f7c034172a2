"""A rollout step's copies between the host and a CUDA device (`HostTransfers`)."""
import numpy as np
import torch


class HostTransfers:
    """A rollout step's copies between the host and a CUDA device through pinned buffers (kept per
    name, reused each step): observations go up without blocking, outputs come down with one
    sync per step. The arrays returned are views of the pinned buffers, valid until the next
    step (the runner copies them into its episode buffers first). On the CPU, plain tensors."""

    def __init__(self):
        self.up, self.down = {}, {}

    @staticmethod
    def _pinned(cache: dict, name: str, like: torch.Tensor) -> torch.Tensor:
        buf = cache.get(name)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = cache[name] = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        return buf

    def to_device(self, name: str, array: np.ndarray, device: torch.device) -> torch.Tensor:
        host = torch.from_numpy(array)
        if device.type != "cuda":
            return host.to(device)
        pinned = self._pinned(self.up, name, host)
        pinned.copy_(host)  # the last step's copy out of this buffer finished: its outputs were synced
        return pinned.to(device, non_blocking=True)

    def to_host(self, out: dict) -> dict:
        devices = {v.device for v in out.values()}
        if not any(d.type == "cuda" for d in devices):
            return {k: v.cpu().numpy() for k, v in out.items()}
        pinned = {k: self._pinned(self.down, k, v) for k, v in out.items()}
        for k, v in out.items():
            pinned[k].copy_(v, non_blocking=True)
        for d in devices:
            if d.type == "cuda":
                torch.cuda.current_stream(d).synchronize()
        return {k: p.numpy() for k, p in pinned.items()}
