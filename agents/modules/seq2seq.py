"""Actor-critic RLModule around a Hugging Face encoder-decoder LM (T5, BART, ...).

Same MDP as the causal policy: the state is the source plus the decoder tokens
so far, the action the next decoder token. The env's observation (with
`encoder_decoder: true`) holds the source (`encoder_input_ids`,
`encoder_attention_mask`, right-padded) and the generated tokens
(`input_ids`, `attention_mask`, left-padded, newest last). The module puts its
decoder start token before the generated tokens, so the decoder window is one
column wider than the observation.

Rollouts (EnvRunners) keep, per vector-env row, the encoder's output and the
decoder's self- and cross-attention keys/values (`EncoderDecoderKVCache`): the
encoder runs once per episode (once per distinct source per row) and a token
step costs one incremental decoder step. The learner runs the encoder and the
whole decoder once per sequence (`seq_id`, see sequence_batching.py). The
action distribution is the LM's next-token logits; the value head reads the
decoder's final hidden state (shared trunk, or a separate copy of the model
with `model.value_model: separate`). Truncation samplers, learned masking,
the frozen reference model and inference-only EnvRunners work as in
`CausalLMActorCritic`.

Positions: a left-padded window must give each token the position it has in
unpadded text. T5's relative positions only see distances, which padding does
not change. BART-style learned absolute positions are computed by the decoder
from the cache length alone, so their embedding is given each row's positions
explicitly (`_RowPositions`). At setup the module checks that a padded,
windowed pass reproduces the model's own logits, and refuses models where it
does not.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers import DynamicCache, EncoderDecoderCache

from ray.rllib.core.columns import Columns

from agents.core import SEQ_ID
from agents.models import build_seq2seq_lm, decoder_start_id
from agents.modules.actor_critic import CausalLMActorCritic
from agents.modules.kv_cache import (first_used_column, merge_rows, pad_front, position_ids_for,
                                     rows_that_continue, sequence_pass_rows)

ENC_IDS, ENC_MASK = "encoder_input_ids", "encoder_attention_mask"


# -- positions ---------------------------------------------------------------------------

class _RowPositionsMixin:
    """Learned absolute positions taken per row from `row_positions` when it is set."""

    row_positions = None

    def forward(self, input_ids, past_key_values_length: int = 0, position_ids=None):
        if self.row_positions is None:
            return super().forward(input_ids, past_key_values_length, position_ids=position_ids)
        return nn.Embedding.forward(self, self.row_positions + getattr(self, "offset", 0))


def _position_embeddings(model) -> list:
    """The decoder's learned position embeddings, switched to per-row positions (empty for T5)."""
    emb = getattr(model.get_decoder(), "embed_positions", None)
    if emb is None:
        return []
    if not isinstance(emb, nn.Embedding):
        raise ValueError(f"model.name_or_path: {type(model).__name__} decoders use position embeddings of type "
                         f"{type(emb).__name__}, which this module cannot place per row (supported: T5-style "
                         f"relative and BART-style learned positions)")
    if not isinstance(emb, _RowPositionsMixin):  # same parameters, same state-dict keys
        emb.__class__ = type(f"RowPositions{type(emb).__name__}", (_RowPositionsMixin, type(emb)), {})
    return [emb]


@contextlib.contextmanager
def row_positions(model, positions: torch.Tensor):
    embs = _position_embeddings(model)
    for emb in embs:
        emb.row_positions = positions
    try:
        yield
    finally:
        for emb in embs:
            emb.row_positions = None


# -- forward pieces ----------------------------------------------------------------------

def decoder_window(obs: dict, start_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's input: the start token, then the generated tokens, left-padded, one column
    wider than the observation."""
    ids, mask = obs["input_ids"], obs["attention_mask"]
    rows, width = ids.shape
    ids = torch.cat([ids[:, :1], ids], 1)  # padding like the observation's, so shifted windows still match
    mask = torch.cat([mask.new_zeros((rows, 1)), mask], 1)
    col = width - mask.sum(-1)  # the column just before the first generated token
    r = torch.arange(rows, device=ids.device)
    ids[r, col] = start_id
    mask[r, col] = 1
    return ids, mask


def lm_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head on decoder hidden states, as the model's own forward applies it."""
    if getattr(model.config, "scale_decoder_outputs", False):  # T5 with tied embeddings
        hidden = hidden * (model.config.d_model ** -0.5)
    logits = model.get_output_embeddings()(hidden)
    bias = getattr(model, "final_logits_bias", None)  # BART
    return logits + bias if bias is not None else logits


def encode(model, enc_ids: torch.Tensor, enc_mask: torch.Tensor) -> torch.Tensor:
    return model.get_encoder()(input_ids=enc_ids, attention_mask=enc_mask).last_hidden_state


def decoder_hidden(model, obs: dict, start_id: int, seq_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The decoder's final hidden state at each row's newest token, shape (rows, hidden); the
    encoder and decoder run once per sequence when `seq_ids` groups rows of one episode."""
    ids, mask = decoder_window(obs, start_id)
    enc_ids, enc_mask = obs[ENC_IDS], obs[ENC_MASK]
    rep, ids, mask, inverse, column = sequence_pass_rows(ids, mask, seq_ids)
    enc = encode(model, enc_ids[rep], enc_mask[rep])
    with row_positions(model, position_ids_for(mask)):
        out = model.get_decoder()(input_ids=ids, attention_mask=mask, encoder_hidden_states=enc,
                                  encoder_attention_mask=enc_mask[rep], use_cache=False)
    return out.last_hidden_state[inverse, column]


def check_windowed_logits(model, start_id: int) -> None:
    """Refuses a model whose logits from a left-padded decoder window differ from its own forward."""
    model_was_training = model.training
    model.eval()
    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(2, vocab, (1, 4), generator=gen)
    tgt = torch.randint(2, vocab, (1, 3), generator=gen)
    with torch.no_grad():
        ref = model(input_ids=src, attention_mask=torch.ones_like(src),
                    decoder_input_ids=torch.cat([torch.tensor([[start_id]]), tgt], 1)).logits[:, -1]
        # Row 0 is left-padded; row 1 fills the window, so the pass keeps row 0's padding columns.
        full = torch.randint(2, vocab, (1, 5), generator=gen)
        obs = {"input_ids": torch.cat([torch.cat([torch.zeros((1, 2), dtype=torch.long), tgt], 1), full]),
               "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]),
               ENC_IDS: src.repeat(2, 1), ENC_MASK: torch.ones_like(src).repeat(2, 1)}
        ours = lm_logits(model, decoder_hidden(model, obs, start_id))[:1]
    model.train(model_was_training)
    if not torch.allclose(ours, ref, atol=1e-4, rtol=1e-4):
        raise ValueError(f"model.name_or_path: {type(model).__name__} gives different logits on a left-padded "
                         f"decoder window (max difference {(ours - ref).abs().max():.2e}); not supported")


class EncoderDecoderKVCache:
    """Per-row encoder outputs and decoder keys/values for token-by-token rollouts.

    Decoder keys/values are kept in the column layout of the decoder window, as
    `WindowKVCache` does for causal LMs: a row continues when its new window is
    its old one shifted by one appended token and its source is unchanged; it
    then costs one decoder step. Other rows (resets, restarts, reordered rows)
    run the decoder over their whole window. The encoder runs only for rows
    whose source differs from the one cached for that row.
    """

    def __init__(self):
        self.invalidate()
        self.stats = {"encoder_rows": 0, "prefill_rows": 0, "incremental_rows": 0}

    def invalidate(self) -> None:
        self.ids = self.mask = self.enc_ids = self.enc_mask = self.enc_hidden = None
        self.self_kv = self.cross_kv = None

    @torch.no_grad()
    def hidden_at_last_token(self, model, obs: dict, start_id: int, cont=None) -> torch.Tensor:
        ids, mask = decoder_window(obs, start_id)
        enc_ids, enc_mask = obs[ENC_IDS], obs[ENC_MASK]
        rows = torch.arange(ids.shape[0], device=ids.device)
        same_source = torch.zeros(len(rows), dtype=torch.bool, device=ids.device)
        if self.enc_ids is not None and self.enc_ids.shape == enc_ids.shape:
            same_source = (enc_ids == self.enc_ids).all(-1) & (enc_mask == self.enc_mask).all(-1)
        cont = rows_that_continue(self.ids, self.mask, ids, mask, cont) & same_source

        # Encoder: once per new source in a row.
        new_src = rows[~same_source]
        if len(new_src) == len(rows):
            enc_hidden = encode(model, enc_ids, enc_mask)
        else:
            enc_hidden = self.enc_hidden.clone()
            if len(new_src):
                enc_hidden[new_src] = encode(model, enc_ids[new_src], enc_mask[new_src])
        self.stats["encoder_rows"] += len(new_src)

        step_rows, fill_rows = rows[cont], rows[~cont]
        hidden = self_kv = cross_kv = None
        decoder = model.get_decoder()
        if len(step_rows):
            sel = slice(None) if len(step_rows) == len(rows) else step_rows
            self_cache, cross_cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
            for cache, layers, drop_first in ((self_cache, self.self_kv, True), (cross_cache, self.cross_kv, False)):
                for layer, (k, v) in zip(cache.layers, layers):
                    k, v = k[sel], v[sel]
                    if drop_first:  # the column shifted out of the window is padding
                        k, v = k[:, :, 1:], v[:, :, 1:]
                    layer.lazy_initialization(k, v)
                    layer.keys, layer.values = k, v
            m = mask[step_rows]
            with row_positions(model, m.sum(-1, keepdim=True) - 1):
                out = decoder(input_ids=ids[step_rows, -1:], attention_mask=m, encoder_hidden_states=enc_hidden[sel],
                              encoder_attention_mask=enc_mask[step_rows],
                              past_key_values=EncoderDecoderCache(self_cache, cross_cache), use_cache=True)
            hidden = out.last_hidden_state[:, -1]
            self_kv = [(l.keys, l.values) for l in out.past_key_values.self_attention_cache.layers]
            cross_kv = [(l.keys, l.values) for l in out.past_key_values.cross_attention_cache.layers]
        if len(fill_rows):
            # The decoder runs from the first column a starting row uses (a fresh row's window is
            # its start token alone); the skipped columns' keys/values are zeros, masked either way.
            m = mask[fill_rows]
            start = first_used_column(m)
            m = m[:, start:]
            with row_positions(model, position_ids_for(m)):
                out = decoder(input_ids=ids[fill_rows, start:], attention_mask=m,
                              encoder_hidden_states=enc_hidden[fill_rows], encoder_attention_mask=enc_mask[fill_rows],
                              use_cache=True)
            h = out.last_hidden_state[:, -1]
            hidden = h if hidden is None else merge_rows(hidden, h, step_rows, fill_rows)
            fill_self = pad_front([(l.keys, l.values) for l in out.past_key_values.self_attention_cache.layers], start)
            fill_cross = [(l.keys, l.values) for l in out.past_key_values.cross_attention_cache.layers]
            if self_kv is None:
                self_kv, cross_kv = fill_self, fill_cross
            else:
                self_kv = _merge(self_kv, fill_self, step_rows, fill_rows)
                cross_kv = _merge(cross_kv, fill_cross, step_rows, fill_rows)
        self.ids, self.mask, self.enc_ids, self.enc_mask = ids.clone(), mask.clone(), enc_ids.clone(), enc_mask.clone()
        self.enc_hidden, self.self_kv, self.cross_kv = enc_hidden, self_kv, cross_kv
        self.stats["prefill_rows"] += len(fill_rows)
        self.stats["incremental_rows"] += len(step_rows)
        return hidden


def _merge(step_layers, fill_layers, step_rows, fill_rows):
    """Step rows' and prefilled rows' keys/values back in batch order."""
    return [(merge_rows(ks, kf, step_rows, fill_rows), merge_rows(vs, vf, step_rows, fill_rows))
            for (ks, vs), (kf, vf) in zip(step_layers, fill_layers)]


@torch.no_grad()
def seq2seq_reference_logp(ref_model, start_id: int, batch) -> torch.Tensor:
    """log p_ref(a_t | s_t) of the batch's actions under a frozen encoder-decoder LM."""
    hidden = decoder_hidden(ref_model, batch[Columns.OBS], start_id, batch.get(SEQ_ID))
    logits = lm_logits(ref_model, hidden)
    return torch.log_softmax(logits.float(), -1).gather(-1, batch[Columns.ACTIONS].long()[:, None])[:, 0]


class Seq2SeqActorCritic(CausalLMActorCritic):
    """`CausalLMActorCritic` with an encoder-decoder LM: the same acting, sampling, training
    and value passes, with the decoder's hidden states (encoder output cached per row)."""

    serves_static_update = False  # the decoder's pass reads the encoder's output: not the static update's

    def _build_lm(self, cfg: dict, seq_len: int) -> nn.Module:
        lm = build_seq2seq_lm(cfg["model"], self.tokenizer, seed=cfg.get("seed", 0))
        self.start_id = decoder_start_id(lm)
        check_windowed_logits(lm, self.start_id)
        return lm

    def _new_cache(self):
        return EncoderDecoderKVCache()

    @staticmethod
    def _trunk(lm: nn.Module) -> nn.Module:
        return lm  # encoder and decoder both: the decoder's hidden states need the encoder's output

    def _hidden(self, trunk: nn.Module, obs: dict, seq_ids=None, cache=None, cont=None,
                pass_rows=None) -> torch.Tensor:
        # pass_rows: never given (serves_static_update is False)
        if cache is not None:
            return cache.hidden_at_last_token(trunk, obs, self.start_id, cont)
        return decoder_hidden(trunk, obs, self.start_id, seq_ids)

    @staticmethod
    def _logits(lm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return lm_logits(lm, hidden)

    def _reference_logp(self, lm, batch) -> torch.Tensor:
        return seq2seq_reference_logp(lm, self.start_id, batch)
