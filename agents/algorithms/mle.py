"""The supervised (MLE) term of the mixed objective: loss = RL loss + coef * NLL(reference | prompt).

The pairs are the task's training prompts with their reference continuations
(`task.targets(example)`: references, or the rest of an IMDB review), tokenized as the env
tokenizes prompts (max_prompt_len, truncation_side) with targets cut to max_new_tokens and
ended by EOS when they fit, the way a generation ends. Each learner update draws
`batch_size` pairs uniformly (seeded) and adds the mean per-token negative log-likelihood of
the target tokens under the policy.
"""
from __future__ import annotations

import numpy as np
import torch

from agents.modules.kv_cache import position_ids_for


class ReferencePairs:
    def __init__(self, env_cfg: dict, tokenizer, *, seed: int = 0, split: str = "train"):
        from env.tasks import make_task

        task = make_task(env_cfg["task"], max_new_tokens=env_cfg["max_new_tokens"])
        if not hasattr(task, "targets"):
            raise ValueError(f"training.mle_coef: task {task.name!r} has no reference texts to learn from")
        max_prompt, max_new = env_cfg["max_prompt_len"], env_cfg["max_new_tokens"]
        left = env_cfg.get("truncation_side", "left") == "left"
        eos = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        self.pairs: list[tuple[list[int], list[int]]] = []
        for ex in task.examples(split):
            prompt = tokenizer(ex["prompt"], add_special_tokens=False)["input_ids"]
            prompt = (prompt[-max_prompt:] if left else prompt[:max_prompt]) if len(prompt) > max_prompt else prompt
            if not prompt:
                continue
            for target in task.targets(ex):
                if not target.strip():
                    continue
                if not target[0].isspace() and not ex["prompt"][-1:].isspace():
                    target = " " + target  # a continuation, as a BPE model would generate it
                ids = tokenizer(target, add_special_tokens=False)["input_ids"][:max_new]
                if len(ids) < max_new and eos is not None:
                    ids = ids + [eos]
                if ids:
                    self.pairs.append((list(prompt), ids))
        if not self.pairs:
            raise ValueError(f"training.mle_coef: task {task.name!r} split {split!r} has no reference texts "
                             f"to learn from")
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return len(self.pairs)

    def batch(self, n: int, device=None, indices=None):
        """`n` pairs drawn uniformly (or the given indices): right-padded ids, mask, and labels
        (-100 except at target tokens, aligned with the ids: label[t] is predicted at t - 1)."""
        if indices is None:
            indices = self.rng.integers(len(self.pairs), size=n)
        rows = [self.pairs[int(i)] for i in indices]
        width = max(len(p) + len(t) for p, t in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        for r, (p, t) in enumerate(rows):
            seq = p + t
            ids[r, :len(seq)] = torch.tensor(seq)
            mask[r, :len(seq)] = 1
            labels[r, len(p):len(seq)] = torch.tensor(t)
        return ids.to(device), mask.to(device), labels.to(device)


def reference_nll(lm, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood per target token of a causal LM (Hugging Face interface)."""
    logits = lm(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask), use_cache=False).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
