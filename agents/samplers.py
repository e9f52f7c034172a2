"""Truncation samplers as keep-masks over the vocabulary.

Each function takes logits of shape (..., V) and returns a boolean mask of
the same shape: True for tokens the sampler keeps. The policy then samples
from (and PPO trains on) its own distribution renormalised over the kept
tokens. All of them are batched and vectorised over the vocabulary.

top-k, top-p, typical, epsilon and eta keep exactly what the `transformers`
logits warpers of the same names keep, including their `min_tokens_to_keep`
and tie rules. Mirostat (Basu et al., 2021) is an adaptive top-k whose `mu`
(the maximum surprise, in bits) is state carried through an episode:

    s  = sum_i t_i b_i / sum_i t_i^2,   t_i = ln((i+1)/i),  b_i = ln(p_i / p_{i+1}),  i = 1..m
    k  = round(((s-1) 2^mu / (1 - V^-(s-1)))^(1/s)) + 1
    mu <- mu - learning_rate * (surprise(x) - tau),   surprise(x) = -log2 p(x),  mu_0 = 2 tau

with p sorted in decreasing order and m = 100 (fewer for small vocabularies),
as in the paper's Algorithm 1 and its reference implementation.
"""
from __future__ import annotations

import math

import torch

# Logit given to masked-out tokens: exp() of it underflows to exactly 0, and
# unlike -inf it keeps log-softmax, entropy and their gradients finite.
MASKED = torch.finfo(torch.float32).min


def sample_rows(probs: torch.Tensor, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """One index per row of `probs` (rows, n; non-negative, each row with a positive entry), drawn
    with probability proportional to its entry: what `torch.multinomial(probs, 1)[:, 0]` draws, by
    inverting each row's cumulative sum (float64) at one uniform draw, a binary search: one random
    number per row instead of multinomial's per-entry work (2 cores, 768 rows of 50,257: 184 ms
    against multinomial's 951 ms; the binary searches took 1.3x to 2.4x less time than counting
    the entries at most the draw and an argmax, at 64 rows of 52 to 768 rows of 50,257). An entry
    of 0 (a masked token) is never drawn: the index is the first whose cumulative sum exceeds the
    draw, and a draw at the top of a row (float rounding) takes the row's last positive entry.
    `uniform` (rows, 1), float64 in [0, 1): the draws, made by the caller (a static decode step
    takes them as an input); default: drawn here from torch's generator. Rows go `SAMPLE_CHUNK`
    entries at a time."""
    if uniform is None:
        uniform = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device)
    rows = max(1, SAMPLE_CHUNK[probs.device.type == "cpu"] // max(1, probs.shape[-1]))
    if len(probs) <= rows:
        return _invert(probs, uniform)
    return torch.cat([_invert(probs[i:i + rows], uniform[i:i + rows]) for i in range(0, len(probs), rows)])


# Entries (rows x vocabulary) `sample_rows` inverts at once: (other devices, CPU). On the CPU, a few
# rows at a time keep the float64 copy and cumulative sum in cache: 64 rows of 50,257 took 2.4 ms
# in chunks of 16 or 4 rows against 4.0-8.5 ms whole (2 cores); elsewhere, to bound the memory.
SAMPLE_CHUNK = (1 << 24, 1 << 20)


def _invert(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    cum = probs.double().cumsum(-1)
    total = cum[:, -1:].contiguous()
    index = torch.minimum(torch.searchsorted(cum, uniform * total, right=True), torch.searchsorted(cum, total))
    return index[:, 0].clamp(max=probs.shape[-1] - 1)  # a row holding NaN finds no place: its last index


def _kth_largest(logits: torch.Tensor, k: torch.Tensor | int) -> torch.Tensor:
    """The k-th largest logit of each row (k >= 1, per row or shared), shape (..., 1)."""
    V = logits.shape[-1]
    if isinstance(k, int):
        return torch.topk(logits, min(k, V), dim=-1).values[..., -1:]
    sorted_desc = torch.sort(logits, dim=-1, descending=True).values
    return sorted_desc.gather(-1, (k.clamp(1, V) - 1).long()[..., None])


def _at_least(keep: torch.Tensor, logits: torch.Tensor, min_tokens_to_keep: int) -> torch.Tensor:
    """Also keeps the `min_tokens_to_keep` highest-logit tokens (ties included)."""
    return keep | (logits >= _kth_largest(logits, min_tokens_to_keep))


def top_k_mask(logits: torch.Tensor, k: int | torch.Tensor, min_tokens_to_keep: int = 1) -> torch.Tensor:
    """The k most likely tokens (ties with the k-th included). k may be a tensor, one per row."""
    if isinstance(k, int):
        k = max(k, min_tokens_to_keep)
    else:
        k = k.clamp(min=min_tokens_to_keep)
    return logits >= _kth_largest(logits, k)


def _per_row(value, dtype: torch.dtype):
    """A parameter as the masks compare with it: a number as it is (torch casts it to the logits'
    dtype), a tensor of per-row values (rows, 1) cast to `dtype`, so a float64 tensor of a row's
    number gives that number's mask exactly."""
    return value.to(dtype) if torch.is_tensor(value) else value


def top_p_mask(logits: torch.Tensor, p, min_tokens_to_keep: int = 1) -> torch.Tensor:
    """Nucleus: the most likely tokens whose probability mass first reaches p (a number, or a
    (rows, 1) tensor of per-row values)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    remove = cumulative <= _per_row(1 - p, cumulative.dtype)
    remove[..., -min_tokens_to_keep:] = False
    return ~remove.scatter(-1, order, remove)


def typical_mask(logits: torch.Tensor, p, min_tokens_to_keep: int = 1) -> torch.Tensor:
    """Locally typical: tokens whose surprise is closest to the entropy, covering mass p (a number,
    or per-row values)."""
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp * logp.exp()).nansum(-1, keepdim=True)
    distance = (-logp - entropy).abs()
    sorted_distance, order = torch.sort(distance, dim=-1, descending=False)
    cumulative = logits.gather(-1, order).softmax(-1).cumsum(-1)
    last = (cumulative < _per_row(p, cumulative.dtype)).sum(-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    remove = sorted_distance > sorted_distance.gather(-1, last)
    remove[..., :min_tokens_to_keep] = False
    return ~remove.scatter(-1, order, remove)


def epsilon_mask(logits: torch.Tensor, epsilon, min_tokens_to_keep: int = 1) -> torch.Tensor:
    """Tokens with probability >= epsilon (a number, or per-row values)."""
    return _at_least(logits.softmax(-1) >= _per_row(epsilon, logits.dtype), logits, min_tokens_to_keep)


def eta_mask(logits: torch.Tensor, eta, min_tokens_to_keep: int = 1) -> torch.Tensor:
    """Tokens with probability >= min(eta, sqrt(eta) * exp(-entropy)) (eta a number, or per-row values)."""
    # Categorical(logits=logits).entropy(), written out (its argument checks branch on data)
    logp = logits - logits.logsumexp(-1, keepdim=True)
    entropy = -(logp.clamp(min=torch.finfo(logp.dtype).min) * logp.softmax(-1)).sum(-1, keepdim=True)
    if torch.is_tensor(eta):  # the square root in float64, as math.sqrt takes it
        threshold = torch.minimum(eta.double().sqrt().to(logits.dtype) * torch.exp(-entropy), eta.to(logits.dtype))
    else:
        threshold = torch.clamp(math.sqrt(eta) * torch.exp(-entropy), max=eta)
    return _at_least(logits.softmax(-1) >= threshold, logits, min_tokens_to_keep)


def zipf_exponent(logits: torch.Tensor, m: int = 100) -> torch.Tensor:
    """Mirostat's least-squares estimate of the Zipf exponent s from the top m+1 probabilities."""
    m = min(m, logits.shape[-1] - 1)
    top = torch.topk(torch.log_softmax(logits.float(), -1), m + 1, dim=-1).values
    i = torch.arange(1, m + 1, dtype=top.dtype, device=top.device)
    t = torch.log((i + 1) / i)
    b = torch.nan_to_num(top[..., :-1] - top[..., 1:], nan=0.0, posinf=0.0)
    return (t * b).sum(-1) / (t * t).sum()


def mirostat_k(logits: torch.Tensor, mu: torch.Tensor, m: int = 100) -> torch.Tensor:
    """Mirostat's k for each row, given its current mu (bits), as a long tensor in [1, V].

    For a distribution with no Zipf decay (estimated s <= 0, e.g. uniform) k
    takes its limit as s -> 0+: the whole vocabulary if 2^mu >= V - 1 (the
    target allows a uniform draw's surprise), else 1.
    """
    V = logits.shape[-1]
    s = zipf_exponent(logits, m).double()
    mu = torch.as_tensor(mu, dtype=torch.float64, device=logits.device)
    zipfian = s > 1e-6
    s_ = torch.where(zipfian, s, 1.0)
    eps = s_ - 1
    # eps / (1 - V^-eps) -> 1 / ln V as eps -> 0
    near_one = eps.abs() < 1e-8
    ratio = torch.where(near_one, 1 / math.log(V), eps / (1 - V ** (-torch.where(near_one, 1.0, eps))))
    k = torch.nan_to_num((ratio * 2.0 ** mu) ** (1 / s_), nan=float(V), posinf=float(V)).clamp(max=V)
    k = torch.round(k) + 1
    flat = torch.where(2.0 ** mu >= V - 1, float(V), 1.0)
    return torch.where(zipfian, k, flat).clamp(1, V).long()


def mirostat_mask(logits: torch.Tensor, mu: torch.Tensor, min_tokens_to_keep: int = 1, m: int = 100) -> torch.Tensor:
    return top_k_mask(logits, mirostat_k(logits, mu, m), min_tokens_to_keep)


def mirostat_update(mu: torch.Tensor, surprise_bits: torch.Tensor, tau: float, learning_rate: float) -> torch.Tensor:
    return mu - learning_rate * (surprise_bits - tau)


# -- configured samplers -------------------------------------------------------------

# name -> (mask function, its parameter names in config order)
SAMPLERS = {
    "none": (None, ()),
    "top_k": (top_k_mask, ("k",)),
    "top_p": (top_p_mask, ("p",)),
    "typical": (typical_mask, ("p",)),
    "epsilon": (epsilon_mask, ("epsilon",)),
    "eta": (eta_mask, ("eta",)),
    "mirostat": (mirostat_mask, ("tau", "learning_rate")),
}


class Sampler:
    """A configured sampler: `keep(logits, state)` and, for mirostat, the per-row state rule.

    `spec` is the validated `sampler` config section, e.g.
    `{"name": "eta", "eta": 3e-4, "masking": "learned", "sync_every": 100, "min_tokens_to_keep": 1}`.
    """

    def __init__(self, spec: dict):
        self.name = spec.get("name", "none")
        if self.name not in SAMPLERS:
            raise ValueError(f"sampler.name: unknown sampler {self.name!r} (known: {', '.join(SAMPLERS)})")
        self.fn, names = SAMPLERS[self.name]
        self.params = {n: spec[n] for n in names}
        self.min_tokens_to_keep = int(spec.get("min_tokens_to_keep", 1))
        self.masking = spec.get("masking", "current")
        self.sync_every = int(spec.get("sync_every", 100))

    @property
    def active(self) -> bool:
        return self.fn is not None

    @property
    def stateful(self) -> bool:
        return self.name == "mirostat"

    @property
    def learned(self) -> bool:
        return self.active and self.masking == "learned"

    def initial_state(self, rows: int, device=None) -> torch.Tensor:
        return torch.full((rows,), 2.0 * self.params["tau"], device=device) if self.stateful else None

    def next_state(self, state: torch.Tensor, source_logits: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """Mirostat's mu after the rows emitted `actions`, from the unmasked source distribution."""
        logp = torch.log_softmax(source_logits.float(), -1).gather(-1, actions.long()[..., None])[..., 0]
        return mirostat_update(state, -logp / math.log(2), self.params["tau"], self.params["learning_rate"])

    def keep(self, logits: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        if self.name == "mirostat":
            return mirostat_mask(logits, state, self.min_tokens_to_keep)
        return self.fn(logits, *self.params.values(), self.min_tokens_to_keep)


def sampler_value_error(name: str, param: str, value) -> str | None:
    """What a sampler's parameter needs beyond its field's range ("param: ..."), or None; the
    configs' samplers and a served request's take the same check."""
    if name == "typical" and param == "p" and value >= 1.0:
        return f"p: typical sampling needs p < 1, got {value!r}"
    if param in ("epsilon", "eta") and value >= 1.0:
        return f"{param}: expected a number in (0, 1), got {value!r}"
    return None


# A positive temperature below this is argmax where a request may give it (the completions routes),
# and refused by `agents.generate.generate`: float32 logits divided by less could overflow (or, as a
# row's float32 temperature, round to 0) and sample one token over and over.
MIN_TEMPERATURE = 1e-5


def warp_logits(logits: torch.Tensor, temperature=1.0, top_p=1.0) -> torch.Tensor:
    """`logits` (masked entries at `MASKED`) divided by `temperature`, cut to the nucleus of mass
    `top_p`: numbers, or (rows, 1) tensors of per-row values (a row at 1.0 and 1.0 is left as it is)."""
    if torch.is_tensor(temperature) or temperature != 1.0:
        logits = torch.where(logits > MASKED, logits / temperature, MASKED)
    if torch.is_tensor(top_p):
        logits = logits.masked_fill(~(top_p_mask(logits, top_p) | (top_p >= 1)), MASKED)
    elif top_p < 1.0:
        logits = logits.masked_fill(~top_p_mask(logits, top_p), MASKED)
    return logits


# -- per-row requested samplers (a serving batch: every row its own) ----------------------------

# The stateless samplers a row may request, by code (0: none): one parameter each, per row.
ROW_SAMPLERS = ("top_k", "top_p", "typical", "epsilon", "eta")
ROW_SAMPLER_CODES = {name: code for code, name in enumerate(ROW_SAMPLERS, 1)}


def row_sampler_keep(logits: torch.Tensor, name: str, param: torch.Tensor) -> torch.Tensor:
    """The keep-mask of sampler `name` (one of ROW_SAMPLERS) at each row's own parameter (`param`,
    (rows, 1), float64): for each row the mask its number gives alone."""
    if name == "top_k":
        return top_k_mask(logits, param[:, 0].long())
    return SAMPLERS[name][0](logits, param)


def row_tokens(logits: torch.Tensor, uniform: torch.Tensor, greedy: torch.Tensor, temperature: torch.Tensor,
               top_p: torch.Tensor, kind: torch.Tensor, param: torch.Tensor, kinds: tuple = (),
               sampled: bool = True, nucleus: bool = True, subsets: bool = False) -> torch.Tensor:
    """Each row's token from `logits` (rows, V; float32, the policy's own sampler applied): the
    argmax where `greedy` (rows,), else drawn at `uniform` ((rows, 1), float64) from the softmax of
    the logits with the row's requested sampler's mask (`kind` (rows,): its ROW_SAMPLER_CODES code,
    0 for none; `param` (rows, 1) float64), warped by its `temperature` and `top_p` ((rows, 1)
    each, `warp_logits`). `kinds`: the requested samplers present, each computed over every row and
    kept where it is the row's; `sampled` False: every row greedy; `nucleus` False: no row's top_p
    is below 1 (the nucleus's sort is skipped). A top_p in float64 bounds the nucleus at the
    1 - top_p a number gives. Fixed shapes and no host read:
    a serving batch's decode step's tail, captured with the step on a GPU. `subsets`: each requested
    sampler computed on its own rows only (the same tokens; shapes that follow the data, for a
    step that is not captured: on a CPU, where a mask's sort over every row is the cost)."""
    tokens = logits.argmax(-1)
    if not sampled:
        return tokens
    warped = logits
    for name in kinds:
        mine = kind == ROW_SAMPLER_CODES[name]
        if subsets:
            rows = torch.nonzero(mine)[:, 0]
            drop = torch.zeros_like(logits, dtype=torch.bool)
            drop[rows] = ~row_sampler_keep(logits[rows], name, param[rows])
        else:
            drop = mine[:, None] & ~row_sampler_keep(logits, name, param)
        warped = warped.masked_fill(drop, MASKED)
    probs = torch.softmax(warp_logits(warped, temperature, top_p if nucleus else 1.0), -1)
    return torch.where(greedy, tokens, sample_rows(probs, uniform))
