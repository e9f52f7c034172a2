"""How each row of a replica's batch (`agents.serve.batching`) samples as its request asked: the
per-row tensors and draws the decode step takes (`row_inputs`, `row_uniforms`), and a row's
mirostat, whose mu follows each of its tokens (those steps go one call at a time)."""
from __future__ import annotations

import math

import numpy as np
import torch


def mirostat_rows(logits: torch.Tensor, rows: dict) -> torch.Tensor:
    """`logits` with each row that requested mirostat (rows: batch index -> `_Row`) masked by its
    own mu (kept where its draws run)."""
    from agents.samplers import MASKED, mirostat_mask

    masked = logits.clone()
    for i, row in rows.items():
        spec = dict(row.completion.sampler)
        if row.mu is None:
            row.mu = torch.full((1,), 2.0 * spec["tau"], device=logits.device)
        masked[i] = logits[i].masked_fill(~mirostat_mask(logits[i:i + 1], row.mu)[0], MASKED)
    return masked


def update_mirostat(logits: torch.Tensor, rows: dict, tokens: list) -> None:
    """Each mirostat row's mu after its token: it follows the token's surprise under the policy."""
    from agents.samplers import mirostat_update

    for i, row in rows.items():
        spec = dict(row.completion.sampler)
        surprise = -torch.log_softmax(logits[i], -1)[tokens[i]] / math.log(2)
        row.mu = mirostat_update(row.mu, surprise, spec["tau"], spec["learning_rate"])


def requests_mirostat(c) -> bool:
    """Whether the completion `c` (a `batching.Completion`) samples with mirostat."""
    return not c.greedy and dict(c.sampler).get("name") == "mirostat"


def row_inputs(slots: list, device: torch.device, subsets: bool = False) -> tuple:
    """`samplers.row_tokens`' per-row tensors for the rows (`slots`; idle rows greedy) on `device`,
    and its static choices: the requested samplers present, whether any row samples, whether any
    row's top_p is below 1, `subsets` (a step that is not captured computes each sampler on its own
    rows only). top_p in float64: the nucleus's bound 1 - top_p is then the one a number gives."""
    from agents.samplers import ROW_SAMPLER_CODES, SAMPLERS

    n = len(slots)
    greedy, kind, param = np.ones(n, dtype=bool), np.zeros(n, dtype=np.int64), np.zeros((n, 1), dtype=np.float64)
    temperature, top_p = np.ones((n, 1), dtype=np.float32), np.ones((n, 1), dtype=np.float64)
    for i, row in enumerate(slots):
        if row is not None and not row.completion.greedy:
            c = row.completion
            greedy[i], temperature[i], top_p[i] = False, c.temperature, c.top_p
            spec = dict(c.sampler)
            if spec.get("name") in ROW_SAMPLER_CODES:
                kind[i], param[i] = ROW_SAMPLER_CODES[spec["name"]], spec[SAMPLERS[spec["name"]][1][0]]
    spec = {"kinds": tuple(name for name, code in ROW_SAMPLER_CODES.items() if (kind == code).any()),
            "sampled": not greedy.all(), "nucleus": bool((top_p < 1).any()), "subsets": subsets}
    return tuple(torch.from_numpy(a).to(device) for a in (greedy, temperature, top_p, kind, param)), spec


def row_uniforms(slots: list, k: int, device: torch.device) -> torch.Tensor:
    """(k, rows, 1) float64 on `device`: each sampled row's next k draws from its own generator
    (what k calls of one draw each give), PADDED_ROW_DRAW elsewhere."""
    from agents.modules.decoding import PADDED_ROW_DRAW

    u = torch.full((k, len(slots), 1), PADDED_ROW_DRAW, dtype=torch.float64)
    drawing = [i for i, row in enumerate(slots) if row is not None and not row.completion.greedy]
    if drawing:
        u[:, drawing, 0] = torch.stack([torch.rand(k, dtype=torch.float64, generator=slots[i].generator)
                                        for i in drawing], 1)
    return u.to(device)
