"""The machinery every token-level learner shares (PPO, A2C/A3C, REINFORCE, the guided family)."""
from __future__ import annotations

import torch


class LossScaler(torch.amp.GradScaler):
    """fp16's loss scaler (RLlib's `_torch_grad_scaler_class`) on the learner's device type."""

    def __init__(self):
        super().__init__("cuda" if torch.cuda.is_available() else "cpu")
