"""Truncation samplers keep what the transformers warpers keep; mirostat follows the paper."""
import math

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper, EtaLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper,
)

from agents import samplers

CASES = [  # (ours, transformers warper, parameter values)
    (samplers.top_k_mask, TopKLogitsWarper, [1, 3, 10, 40]),
    (samplers.top_p_mask, TopPLogitsWarper, [0.1, 0.5, 0.89, 0.95, 0.99, 1.0]),
    (samplers.typical_mask, TypicalLogitsWarper, [0.2, 0.5, 0.9, 0.95]),
    (samplers.epsilon_mask, EpsilonLogitsWarper, [1e-1, 1e-2, 3e-4, 1e-7]),
    (samplers.eta_mask, EtaLogitsWarper, [0.004, 0.0009, 0.0003, 0.05]),
]


@pytest.mark.parametrize("ours, warper, values", CASES, ids=lambda x: getattr(x, "__name__", ""))
@pytest.mark.parametrize("shape", [(1, 7), (5, 52), (16, 1000), (3, 50257)])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0])
@pytest.mark.parametrize("min_keep", [1, 3])
def test_mask_keeps_exactly_what_the_transformers_warper_keeps(ours, warper, values, shape, temperature, min_keep):
    gen = torch.Generator().manual_seed(hash((shape, temperature, min_keep)) % 2**31)
    logits = torch.randn(shape, generator=gen) * 4 / temperature
    for value in values:
        expected = torch.isfinite(warper(value, min_tokens_to_keep=min_keep)(None, logits.clone()))
        keep = ours(logits, value, min_keep)
        assert keep.dtype == torch.bool and keep.shape == logits.shape
        assert torch.equal(keep, expected), (ours.__name__, value, (keep != expected).sum())
        assert (keep.sum(-1) >= min(min_keep, shape[-1])).all()


def test_masks_are_batched_over_leading_dimensions():
    logits = torch.randn(2, 3, 40)
    for fn, value in [(samplers.top_p_mask, 0.9), (samplers.typical_mask, 0.9), (samplers.eta_mask, 0.004)]:
        assert torch.equal(fn(logits, value), fn(logits.reshape(6, 40), value).reshape(2, 3, 40))


def zipf_logits(V, s, perm=None):
    logits = -s * torch.log(torch.arange(1, V + 1, dtype=torch.float64))
    return logits if perm is None else logits[perm]


def reference_mirostat_k(probs_sorted, V, mu, m=100):
    """The paper's Algorithm 1 / reference code, written out with Python floats."""
    num = den = 0.0
    for i in range(min(m, V - 1)):
        t = math.log((i + 2) / (i + 1))
        num += math.log(probs_sorted[i] / probs_sorted[i + 1]) * t
        den += t * t
    s = num / den
    eps = s - 1
    return round(((eps * 2 ** mu) / (1 - V ** (-eps))) ** (1 / s)) + 1, s


@pytest.mark.parametrize("V, s, mu", [(50257, 1.1, 6.0), (50257, 1.4, 3.0), (1000, 0.8, 4.0), (120, 2.0, 2.0)])
def test_mirostat_k_matches_the_papers_formula_on_zipf_distributions(V, s, mu):
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(0))
    logits = zipf_logits(V, s, perm)
    # A pure Zipf distribution: the least-squares estimate recovers its exponent.
    assert samplers.zipf_exponent(logits[None])[0].item() == pytest.approx(s, rel=1e-6)
    probs = sorted(torch.softmax(logits, -1).tolist(), reverse=True)
    k_ref, s_ref = reference_mirostat_k(probs, V, mu)
    assert s_ref == pytest.approx(s, rel=1e-9)
    k = samplers.mirostat_k(logits[None], torch.tensor([mu]))
    assert k.item() == min(k_ref, V)
    keep = samplers.mirostat_mask(logits[None], torch.tensor([mu]))[0]
    assert keep.sum().item() == k.item()
    assert torch.equal(keep, logits >= torch.sort(logits, descending=True).values[k.item() - 1])


def test_mirostat_hand_computed_case():
    # p proportional to 1/i over 4 tokens: s = 1 exactly, so k = (2^mu / ln 4)^1 rounded, + 1.
    logits = zipf_logits(4, 1.0)[None]
    assert samplers.zipf_exponent(logits).item() == pytest.approx(1.0)
    assert samplers.mirostat_k(logits, torch.tensor([1.0])).item() == round(2 / math.log(4)) + 1 == 2
    assert samplers.mirostat_k(logits, torch.tensor([0.0])).item() == round(1 / math.log(4)) + 1 == 2
    assert samplers.mirostat_k(logits, torch.tensor([-3.0])).item() == 1
    # mu update: surprise 5 bits against a target of 3 with learning rate 0.1 lowers mu by 0.2.
    assert samplers.mirostat_update(torch.tensor(6.0), torch.tensor(5.0), 3.0, 0.1).item() == pytest.approx(5.8)
    # A flat distribution (s = 0): everything if 2^mu >= V - 1 allows a uniform draw, else one token.
    assert samplers.mirostat_k(torch.zeros(1, 10), torch.tensor([4.0])).item() == 10
    assert samplers.mirostat_k(torch.zeros(1, 10), torch.tensor([3.0])).item() == 1


@pytest.mark.parametrize("tau", [2.5, 3.0, 3.5])
def test_mirostat_keeps_the_observed_surprise_near_tau(tau):
    spec = {"name": "mirostat", "tau": tau, "learning_rate": 0.1}
    sampler = samplers.Sampler(spec)
    gen = torch.Generator().manual_seed(1)
    rows, V, steps = 8, 5000, 600
    mu = sampler.initial_state(rows)
    assert torch.allclose(mu, torch.full((rows,), 2 * tau))
    surprises, entropies = [], []
    for _ in range(steps):
        s = 1.2 + 0.6 * torch.rand(rows, 1, generator=gen, dtype=torch.float64)
        ranks = torch.argsort(torch.rand(rows, V, generator=gen), -1).double() + 1
        logits = (-s * torch.log(ranks) + 0.3 * torch.randn(rows, V, generator=gen, dtype=torch.float64)).float()
        entropies.append(torch.distributions.Categorical(logits=logits).entropy().mean().item() / math.log(2))
        keep = sampler.keep(logits, mu)
        probs = torch.softmax(logits.masked_fill(~keep, samplers.MASKED), -1)
        actions = torch.multinomial(probs, 1, generator=gen)[:, 0]
        assert keep.gather(-1, actions[:, None]).all()
        surprises.append((-torch.log_softmax(logits, -1).gather(-1, actions[:, None])[:, 0] / math.log(2)).numpy())
        mu = sampler.next_state(mu, logits, actions)
    late = np.stack(surprises[steps // 3:])
    assert abs(late.mean() - tau) < 0.25, late.mean()
    # Untruncated sampling from the same distributions would be far more surprising.
    assert np.mean(entropies) > tau + 1.0, np.mean(entropies)


def test_masked_out_tokens_get_zero_probability_and_finite_log_probs():
    logits = torch.randn(4, 30)
    keep = samplers.top_p_mask(logits, 0.5)
    masked = logits.masked_fill(~keep, samplers.MASKED)
    probs = torch.softmax(masked, -1)
    assert (probs[~keep] == 0).all() and torch.isfinite(torch.log_softmax(masked, -1)).all()
    draws = torch.multinomial(probs, 2000, replacement=True)
    assert keep.gather(-1, draws).all()


def test_sample_rows_draws_each_index_with_its_probability_and_never_a_zero_one():
    from agents.samplers import sample_rows

    torch.manual_seed(0)
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    draws = sample_rows(probs.repeat(100_000, 1)).view(100_000, 2)
    freq = torch.bincount(draws[:, 0], minlength=6).float() / 100_000
    assert torch.allclose(freq, probs[0], atol=0.006), freq  # ~4 standard errors
    assert (draws[:, 1] == 0).all()
    # unnormalised rows, and draws at the very bottom and the very top of a row (0, and 1: a draw
    # that float rounding puts at the row's total, past every cumulative sum)
    weights = torch.tensor([[0.0, 3.0, 0.0, 1.0, 0.0], [0.0, 0.0, 2.0, 0.0, 0.0]])
    original = torch.rand
    for edge in (0.0, 1.0):
        torch.rand = lambda *shape, **kw: torch.full(shape, edge, **kw)  # noqa: E731
        try:
            got = sample_rows(weights)
        finally:
            torch.rand = original
        assert got.tolist() == ([1, 2] if edge == 0.0 else [3, 2])


def test_sample_rows_inverts_the_cumulative_sum_and_stays_in_range():
    """The first index whose cumulative sum exceeds the draw (a binary search), never a masked
    (zero) entry, the last positive entry at the top of a row, and an index in range for a row
    holding NaN (which a caller's checks then meet, not an out-of-range gather)."""
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2],
                          [float("nan")] * 5])
    draws = {0.0: [1, 0, 0], 0.49: [1, 0, 2], 0.5: [3, 0, 2], 0.99: [3, 0, 4], 1.0: [3, 0, 4]}
    for u, want in draws.items():
        got = samplers.sample_rows(probs, torch.full((4, 1), u, dtype=torch.float64))
        assert got[:3].tolist() == want and 0 <= int(got[3]) < 5
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, 11, generator=gen), -1)
    u = torch.rand(6, 1, dtype=torch.float64, generator=gen)
    counted = (p.double().cumsum(-1) <= u * p.double().sum(-1, keepdim=True)).sum(-1)  # a full pass
    assert torch.equal(samplers.sample_rows(p, u), counted)
