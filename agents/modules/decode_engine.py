"""The decode engine: a ring-buffer KV cache and a decode step of fixed shapes.

`WindowKVCache` keeps each row's keys/values in the env's window layout and shifts them by one
column per step (`torch.cat` per layer: a new tensor and a full copy each step). Here, per layer,
one preallocated (rows, heads, L, head_dim) key and value buffer is written in place: the new
token's column goes to slot `t mod L`, where t counts the engine's steps (one slot for all rows).
GPT-2 adds positions at the input, so the order of the columns in the buffer does not matter to
attention; a boolean (rows, L) ring of real columns rotates with it. A window prefilled for a row
is written rotated so that its newest column sits at the current slot; the next step then
overwrites the window's oldest column, which is padding for every row that continues (the env's
window is longer than any episode's prompt plus generated tokens).

`DecodeEngine.step` is a function of tensors of fixed shapes: no `torch.cat`, no host sync, no
Python branch on data. It returns the hidden state at the new token, or, given a `tail` (the
policy's head, sampler mask and draw from uniforms passed in), whatever the tail returns, so a
whole rollout step (forward, mask, sample, log-prob, value) is one static function. On CUDA that
function is captured once per (batch size, tail) as a `torch.cuda.CUDAGraph` and replayed;
weight syncs copy into the module's tensors in place, so a captured graph stays valid. On the
CPU the same function runs eagerly (and compiles with `torch.compile(fullgraph=True)`: the
tests check it, the precondition for capture). Rows that restart are prefilled inside the same
static step where the engine captures it (`DecodeEngine.restart`: one graph per bucket of
restarting rows), else eagerly, written into the buffers. A decode block's steps after its first
are one static function too (`DecodeEngine.steps`: each step appends the token the one before drew).

Only a plain `GPT2Model` trunk qualifies (`_plain_gpt2_blocks`); others keep `WindowKVCache`.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch._dynamo.exc import TorchDynamoException

from agents.modules.kv_cache import (WindowKVCache, _plain_gpt2_blocks, attention_mask_per_head, gpt2_forward,
                                     gpt2_forward_blocks, lean_forward_verdict, rows_that_continue,
                                     window_attention)
from agents.modules.prefill_store import stack_layers


COMPILE_BACKEND = "inductor"  # compile_step's backend
# Held while a graph is captured: no other thread's CUDA work may run then (a serving replica's
# rewards, scored in a thread of their own, take it).
CAPTURE_LOCK = threading.Lock()


def compiled_once(fn):
    """`fn` through `torch.compile(fullgraph=True)` (`COMPILE_BACKEND`). The first call compiles:
    a compile that fails there (inductor on a CPU with no C++ compiler, a graph break) stops with
    one line naming `env_runners.compile_step` and the compiler's own cause (its error chained);
    any other error passes as it is."""
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=COMPILE_BACKEND)
    compiled_yet = False

    def run(*args):
        nonlocal compiled_yet
        if compiled_yet:
            return compiled(*args)
        try:
            out = compiled(*args)
        except TorchDynamoException as err:  # dynamo's and inductor's own (a graph break, no compiler)
            root = err
            for _ in range(16):  # dynamo wraps the backend's own error
                inner = root.__cause__ or getattr(root, "inner_exception", None)
                if inner is None:
                    break
                root = inner
            cause = next((line for line in f"{type(root).__name__}: {root}".splitlines() if line.strip()))
            raise RuntimeError(f"env_runners.compile_step: compiling the decode step failed ({cause}); "
                               "set env_runners.compile_step: false") from err
        compiled_yet = True
        return out

    return run


class RingBuffers:
    """Ring-buffer keys/values for `rows` rows of `length` columns of a plain GPT-2 trunk, and the
    static functions over them: a one-token step (`step_hidden`), a step with restarting rows
    (`restart_hidden`); and the eager writes of prefilled windows (`load_rows`)."""

    def __init__(self, trunk, rows: int, length: int):
        blocks = _plain_gpt2_blocks(trunk)
        if blocks is None:
            raise TypeError(f"DecodeEngine needs a plain GPT2Model trunk, got {type(trunk).__name__}")
        self.trunk, self.blocks = trunk, blocks
        self.rows, self.length = rows, length
        p = trunk.wte.weight
        self.device, self.dtype = p.device, p.dtype
        c = trunk.config
        self.heads, self.head_dim = c.n_head, trunk.embed_dim // c.n_head
        # keys and values of every layer in one buffer (2, layers, rows, heads, L, hd): restarted
        # rows are written in one op (`load_rows`); self.keys/self.values are its per-layer views
        self.kv = torch.zeros((2, len(blocks), rows, self.heads, length, self.head_dim), dtype=self.dtype,
                              device=self.device)
        self.keys, self.values = list(self.kv[0].unbind(0)), list(self.kv[1].unbind(0))
        self.real = torch.zeros(rows, length, dtype=torch.bool, device=self.device)
        self.slot = torch.zeros(1, dtype=torch.long, device=self.device)  # the newest token's slot
        self.slot_host = 0  # the same, on the host (prefills read it; no sync)

    def __getstate__(self) -> dict:
        """Without the per-layer views of `kv`: a copy makes them again from its own `kv` (pickle
        would copy each view apart from the buffer)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("keys", "values")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.keys, self.values = list(self.kv[0].unbind(0)), list(self.kv[1].unbind(0))

    def matches(self, trunk, rows: int, length: int) -> bool:
        """Whether a call of `rows` rows over `length` columns runs here (the first `rows` of its rows)."""
        p = trunk.wte.weight
        return (trunk is self.trunk and rows <= self.rows and length == self.length
                and p.device == self.device and p.dtype == self.dtype)

    # -- the static step ------------------------------------------------------------------

    def step_hidden(self, token: torch.Tensor) -> torch.Tensor:
        """Appends `token` (B,) to each of the first B rows (B <= rows; the others' keys and values
        at the slot are left as they were, the column marked real: such rows restart before they
        are read): advances the slot, writes each layer's new key and value there, and returns the
        final hidden state at the new token (B, D). Fixed shapes, in-place writes, no host sync."""
        trunk, B, heads, hd = self.trunk, token.shape[0], self.heads, self.head_dim
        D = heads * hd
        slot = self.slot.add_(1).remainder_(self.length)
        real = self.real.index_fill_(1, slot, True)
        layers = zip(self.keys, self.values)
        if B < self.rows:  # the first B rows
            real, layers = real[:B], [(keys[:B], values[:B]) for keys, values in layers]
        position = real.sum(-1) - 1
        h = F.embedding(token, trunk.wte.weight) + F.embedding(position, trunk.wpe.weight)
        attention = attention_mask_per_head(torch.zeros(B, 1, 1, self.length, dtype=h.dtype, device=h.device)
                                            .masked_fill_(~real[:, None, None, :], torch.finfo(h.dtype).min), heads)
        for blk, (keys, values) in zip(self.blocks, layers):
            x = F.layer_norm(h, (D,), blk.ln_1.weight, blk.ln_1.bias, blk.ln_1.eps)
            q, k, v = torch.addmm(blk.attn.c_attn.bias, x, blk.attn.c_attn.weight).view(B, 3, heads, 1, hd).unbind(1)
            keys.index_copy_(2, slot, k.to(keys.dtype))
            values.index_copy_(2, slot, v.to(values.dtype))
            a = window_attention(q, keys, values, attention).reshape(B, D)
            h = h + torch.addmm(blk.attn.c_proj.bias, a.to(h.dtype), blk.attn.c_proj.weight)
            x = F.layer_norm(h, (D,), blk.ln_2.weight, blk.ln_2.bias, blk.ln_2.eps)
            x = blk.mlp.act(torch.addmm(blk.mlp.c_fc.bias, x, blk.mlp.c_fc.weight))
            h = h + torch.addmm(blk.mlp.c_proj.bias, x, blk.mlp.c_proj.weight)
        return F.layer_norm(h, (D,), trunk.ln_f.weight, trunk.ln_f.bias, trunk.ln_f.eps)

    def restart_hidden(self, token: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                       fill: torch.Tensor) -> torch.Tensor:
        """`step_hidden`, then the rows `fill` ((n,) row indices, repeats allowed) restart on their
        windows `ids[fill]`, `mask[fill]` ((rows, L), the env's layout): one pass over those whole
        windows (padding columns included: fixed shapes) whose keys and values are written over
        the rows' ring, rotated so that each window's newest column sits at the new slot. The hidden
        state at every row's newest token. Each layer's keys and values go into the ring as the
        pass computes them (a captured graph's memory pool then holds one layer's activations, not
        every layer's keys and values). Fixed shapes, in-place writes, no host sync: a step
        whose restarts are captured with it, where `WindowKVCache`'s eager prefills (one kernel per
        op, a host read to share prefills by window) cost more host time than the GPU saves by
        computing each window once."""
        hidden = self.step_hidden(token)
        order = (torch.arange(self.length, device=self.device) - self.slot - 1).remainder_(self.length)

        def write(i, k, v):  # each layer's keys and values into the ring as they are computed
            self.keys[i].index_copy_(0, fill, k.index_select(2, order).to(self.dtype))
            self.values[i].index_copy_(0, fill, v.index_select(2, order).to(self.dtype))

        h_fill, _ = gpt2_forward(self.trunk, ids.index_select(0, fill), mask.index_select(0, fill), each_layer=write)
        self.real.index_copy_(0, fill, mask.index_select(0, fill).bool().index_select(1, order))
        return hidden.index_copy(0, fill, h_fill[:, -1].to(hidden.dtype))

    # -- prefills (eager) -----------------------------------------------------------------

    def load_rows(self, rows: torch.Tensor | None, layers, mask: torch.Tensor) -> None:
        """Writes prefilled windows (keys and values stacked (2, layers, n, heads, L, hd), or per
        layer [(keys, values)], in the env's window layout, newest column last) into `rows` (None:
        the first n rows, the others left stale), rotated so that the newest column sits at the
        current slot: a few tensor ops whatever the number of layers. Loading every row starts the
        ring over in the window's own layout (newest column at slot L-1), so what follows a full
        load does not depend on the steps before it (float rounding included)."""
        if rows is None:
            self.slot_host = self.length - 1
            self.slot.fill_(self.slot_host)
        shift = (self.slot_host + 1) % self.length
        kv = torch.roll(stack_layers(layers), shift, -2).to(self.dtype)
        if rows is None:
            self.kv[:, :, :kv.shape[2]].copy_(kv)
            self.real[:len(mask)].copy_(torch.roll(mask.bool(), shift, 1))
        else:
            self.kv.index_copy_(2, rows, kv)
            self.real[rows] = torch.roll(mask.bool(), shift, 1)


class DecodeEngine(RingBuffers):
    """`RingBuffers`' static functions run: eagerly, or where `capture` is on (default: on CUDA
    devices) replayed as a CUDA graph captured per function and shapes. `compile_step`: run the
    step (and a captured graph's contents) through `torch.compile(fullgraph=True)` (inductor: fused
    kernels; compiled on first use, per tail), an experiment measured by
    `benchmarks/decode_step_profile.py --compile`; off by default."""

    def __init__(self, trunk, rows: int, length: int, capture: bool | None = None, compile_step: bool = False):
        super().__init__(trunk, rows, length)
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.compile_step = compile_step
        # name -> (graph, static inputs, static output); names: a step's tail key, ("tail", key),
        # ("restart", rows prefilled, key), ("steps", steps, key); ("part", rows, name) over fewer rows
        self.graphs: dict = {}
        self.compiled: dict = {}  # name -> the compiled eager function (compile_step without capture)
        self.captures = 0  # graphs captured so far (a key dropped and seen again is captured again)

    def __getstate__(self) -> dict:
        """A copy (deepcopy, pickle) keeps the ring but no captured graph or compiled function:
        those run on this engine's own tensors (and a CUDA graph does not copy), so the copy
        captures and compiles its own at its first call."""
        return {**super().__getstate__(), "graphs": {}, "compiled": {}}

    def step(self, token: torch.Tensor, tail=None, tail_inputs: tuple = (), key=None):
        """One decode step: the hidden state at the new token, or `tail(hidden, *tail_inputs)`
        (a function of tensors of fixed shapes; `key` names it among captured graphs). Replays a
        captured CUDA graph where `capture` is on: the outputs are then the graph's own tensors,
        overwritten by its next replay (a caller that keeps them across steps copies them)."""
        return self._run(key if tail is not None else None,
                         lambda token, *inputs: self._whole_step(tail, token, inputs), (token, *tail_inputs))

    def restart(self, token: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, fill: torch.Tensor,
                tail=None, tail_inputs: tuple = (), key=None):
        """`step`, with the rows `fill` restarting on their windows (`restart_hidden`) in the same
        static function: one captured graph per number of rows in `fill` (`restart_bucket`)."""
        name = ("restart", len(fill), key if tail is not None else None)
        return self._run(name, lambda token, ids, mask, fill, *inputs: self._whole_step(
            tail, token, inputs, restart=(ids, mask, fill)), (token, ids, mask, fill, *tail_inputs))

    def steps(self, token: torch.Tensor, tail, tail_inputs: tuple, key, next_token):
        """`n` steps of every row in one static function (one graph per `n` and `key`): step j
        appends `token` (j = 0) or the token step j-1 drew (`next_token(its tail's output)`) and
        takes `tail_inputs`' row j (each input stacked (n, ...)). The tail's outputs, stacked."""
        n = tail_inputs[0].shape[0]
        return self._run(("steps", n, key), lambda token, *inputs: self._steps(tail, token, inputs, next_token),
                         (token, *tail_inputs), n)

    def _steps(self, tail, token: torch.Tensor, tail_inputs: tuple, next_token) -> dict:
        outs = []
        for j in range(tail_inputs[0].shape[0]):
            outs.append(self._whole_step(tail, token, tuple(t[j] for t in tail_inputs)))
            token = next_token(outs[-1])
        return {k: torch.stack([out[k] for out in outs]) for k in outs[0]}

    def start_over(self) -> None:
        """Before a `restart` of every row: the ring then starts over in the window's own layout
        (newest column at slot L-1), as `load_rows(None, ...)` does."""
        self.slot_host = self.length - 2
        self.slot.fill_(self.slot_host)

    def _run(self, name, fn, inputs: tuple, steps: int = 1):
        """`fn(*inputs)` (a function of fixed shapes that takes `steps` steps): eagerly, compiled
        (`compile_step`), or as the CUDA graph captured for `name` at its first call."""
        name = self.part(name, inputs[0].shape[0])
        if not self.capture:
            self.slot_host = (self.slot_host + steps) % self.length
            if not self.compile_step:
                return fn(*inputs)
            if name not in self.compiled:
                self.compiled[name] = self._compiled(fn)
            return self.compiled[name](*inputs)
        graph = self.graphs.get(name)
        if graph is None:
            static_inputs = [t.clone() for t in inputs]
            graph = self.graphs[name] = self._capture(static_inputs, self._compiled(lambda: fn(*static_inputs)),
                                                      steps)
            self.captures += 1
        self.slot_host = (self.slot_host + steps) % self.length
        return self._replay(graph, inputs)

    def part(self, name, rows: int):
        """A graph's or compiled function's name for a call over the first `rows` rows: ("part",
        rows, name) where that is fewer than the engine's (their shapes differ)."""
        return name if rows == self.rows else ("part", rows, name)

    def _whole_step(self, tail, token: torch.Tensor, tail_inputs, restart=None):
        hidden = self.step_hidden(token) if restart is None else self.restart_hidden(token, *restart)
        return hidden if tail is None else tail(hidden, *tail_inputs)

    def _compiled(self, fn):
        return compiled_once(fn) if self.compile_step else fn

    def tail(self, hidden: torch.Tensor, tail=None, tail_inputs: tuple = (), key=None):
        """`tail(hidden, *tail_inputs)` apart from a step: for a step whose restarted rows' hidden
        states come from prefills. Where `capture` is on, a CUDA graph of its own (`key` names it),
        so such a step runs eagerly only the restarted rows' writes, not the head and the draw."""
        if tail is None:
            return hidden
        if not self.capture:
            return tail(hidden, *tail_inputs)
        name = self.part(("tail", key), hidden.shape[0])
        graph = self.graphs.get(name)
        if graph is None:
            static_inputs = [hidden.clone(), *(t.clone() for t in tail_inputs)]
            graph = self.graphs[name] = self._capture(static_inputs, lambda: tail(*static_inputs))
            self.captures += 1
        return self._replay(graph, (hidden, *tail_inputs))

    def _capture(self, static_inputs: list, run, steps: int = 1):
        """A CUDA graph of `run` (a function of `static_inputs` that takes `steps` steps), captured
        after warm-up runs whose effects on the ring are undone: (graph, static inputs, static output)."""
        self._warm_up(run, steps=steps)
        graph = torch.cuda.CUDAGraph()
        with CAPTURE_LOCK, torch.cuda.graph(graph):
            out = run()
        return graph, static_inputs, out

    @staticmethod
    def _replay(graph, given: tuple):
        """Copies `given` into a captured graph's static inputs, replays it, returns its output."""
        cuda_graph, static_inputs, out = graph
        for static, value in zip(static_inputs, given):
            static.copy_(value)
        cuda_graph.replay()
        return out

    def _warm_up(self, run, times: int = 2, steps: int = 1) -> None:
        """Runs `run` (`steps` steps) `times` (on CUDA on a side stream, as capture wants: kernels
        picked and workspaces allocated outside the graph), then puts the ring back as it was: the
        slot, the real columns and the keys/values at the slots the warm-up steps wrote."""
        touched = (self.slot + torch.arange(1, min(times * steps, self.length) + 1, device=self.device)) % self.length
        saved = self.kv.index_select(4, touched)
        saved_slot, saved_real = self.slot.clone(), self.real.clone()
        if self.device.type == "cuda":
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(times):
                    run()
            torch.cuda.current_stream(self.device).wait_stream(stream)
        else:
            for _ in range(times):
                run()
        self.slot.copy_(saved_slot)
        self.real.copy_(saved_real)
        self.kv.index_copy_(4, touched, saved)


RESTART_BUCKET_MIN = 8
# A restart inside the step passes over its rows' whole windows, padding included (fixed shapes);
# an eager prefill starts at the first column any of its rows uses. Past this window length (a long
# window, short prompts: many padding columns) restarts stay eager, as does a graph's memory.
RESTART_MAX_COLUMNS = 256


def restart_bucket(n: int, rows: int) -> int:
    """The number of rows a step that restarts `n` of `rows` rows prefills (the first restarting
    row repeated up to it): the next power of two, at least RESTART_BUCKET_MIN, at most `rows`.
    So a captured engine holds a few restart graphs (5 at 128 rows) whatever `n` is."""
    return min(rows, max(RESTART_BUCKET_MIN, 1 << (n - 1).bit_length()))


class RingKVCache(WindowKVCache):
    """`WindowKVCache`'s interface over a `DecodeEngine` where the trunk is a plain GPT-2 (other
    trunks: `WindowKVCache` itself). Rows that continue take the engine's static step; rows that
    (re)start are prefilled and written into the ring: inside the static step where the engine
    captures it (`static_restarts`), else eagerly, shared and stored by window as in
    `WindowKVCache`. `cont` given on the CPU (the fast EnvRunner's `ROW_CONTINUES`) costs
    no device sync."""

    def __init__(self, *args, capture: bool | None = None, compile_step: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.capture, self.compile_step = capture, compile_step
        self.engine: DecodeEngine | None = None
        self.use_engine = True  # False: always WindowKVCache's path
        # restarting rows prefilled inside the static step (True), eagerly and shared by window
        # (False), or where the engine captures its step (None: on a GPU)
        self.static_restarts: bool | None = None
        self.static_blocks = True  # a block's steps after the first as one static function (`continue_block`)
        self.tail_keys: list = []  # tails whose graphs are kept, oldest first (`decoding.keep_graphs_of`)
        # rows an engine is made with, at least a call's, set by a serving batch that steps only
        # its first rows in use on the same ring (calls of fewer rows, `DecodeEngine.part`)
        self.engine_rows = 0

    def invalidate(self) -> None:
        super().invalidate()
        self.loaded = False  # no row of the engine holds a window computed by the current weights

    def forget_rows(self) -> None:
        super().forget_rows()
        self.loaded = False

    def _engine_for(self, trunk, ids):
        if not (self.use_engine and self.use_lean_step):
            return None
        rows, length = ids.shape
        if self.engine is not None and self.engine.matches(trunk, rows, length):
            return self.engine
        if _plain_gpt2_blocks(trunk) is None:
            return None
        self.engine = DecodeEngine(trunk, max(rows, self.engine_rows), length, capture=self.capture,
                                   compile_step=self.compile_step)
        self.loaded = False
        return self.engine

    def steps_row_prefixes(self, trunk) -> bool:
        """Whether calls over the first rows of `engine_rows` keep the other rows' ring (an engine
        serves `trunk`); elsewhere a call of another number of rows restarts every row."""
        return self.use_engine and self.use_lean_step and _plain_gpt2_blocks(trunk) is not None

    @property
    def restarts_in_step(self) -> bool:
        """Whether rows that restart on the engine take `DecodeEngine.restart` (prefilled inside the
        static step, no eager prefill: the fast EnvRunner then restarts finished rows at once, as it
        does where their prefills are stored): `static_restarts`, by default where the engine
        captures its step (a GPU) over windows of at most RESTART_MAX_COLUMNS, once the trunk's
        tensor-op pass is known to match transformers' forward."""
        engine = self.engine
        if engine is None or not self.use_engine:
            return False
        wanted = (engine.capture and engine.length <= RESTART_MAX_COLUMNS if self.static_restarts is None
                  else self.static_restarts)
        return (wanted and lean_forward_verdict(engine.trunk) is True and gpt2_forward_blocks(engine.trunk) is not None
                and not torch.is_autocast_enabled(engine.device.type))

    @torch.no_grad()
    def continue_block(self, trunk, token: torch.Tensor, n: int, draw, tail, key, next_token):
        """`n` more steps of every row after the last call, in one static function
        (`DecodeEngine.steps`): the first appends `token`, each later one the token its previous
        step drew. `draw()` gives the tail's inputs, each stacked (n, ...), called only where this
        applies. The tail's outputs stacked (n, rows), or None where it does not apply (no engine
        holding every row of the last call's windows): the caller then steps one call at a time."""
        engine, ids = self.engine, self.ids
        if (not self.static_blocks or engine is None or not self.loaded or ids is None or not 0 < n < ids.shape[1]
                or not engine.matches(trunk, *ids.shape)):
            return None
        out = engine.steps(token, tail, draw(), key, next_token)
        tokens = torch.cat([token[None], next_token(out)[:-1]]).T.to(ids.dtype)  # the n tokens appended
        self.ids, self.mask = torch.cat([ids[:, n:], tokens], 1), F.pad(self.mask[:, n:], (0, n), value=1)
        self.stats["incremental_rows"] += n * ids.shape[0]
        return out

    def _continuing(self, ids, mask, cont) -> torch.Tensor:
        """Which rows continue, on the CPU. A call over another number of rows than the last one's
        restarts every row, unless a caller that set `engine_rows` gives `cont` (a serving batch:
        rows the last call did not step are idle ones, whose tokens are not read, or restart)."""
        if not self.loaded or self.ids is None or self.ids.shape[1] != ids.shape[1]:
            return torch.zeros(ids.shape[0], dtype=torch.bool)
        if self.ids.shape[0] != ids.shape[0]:
            return (torch.as_tensor(cont, dtype=torch.bool, device="cpu") if self.engine_rows and cont is not None
                    else torch.zeros(ids.shape[0], dtype=torch.bool))
        return rows_that_continue(self.ids, self.mask, ids, mask, cont, host=True)

    @torch.no_grad()
    def hidden_at_last_token(self, trunk, obs: dict, cont=None, tail=None, tail_inputs: tuple = (), key=None):
        """The hidden state at each row's newest token (or `tail` of it, see `DecodeEngine.step`)."""
        ids, mask = obs["input_ids"], obs["attention_mask"]
        engine = self._engine_for(trunk, ids)
        if engine is None:
            self.loaded = False  # the engine's ring (if any) holds none of these windows
            hidden = super().hidden_at_last_token(trunk, obs, cont)
            return hidden if tail is None else tail(hidden, *tail_inputs)
        cont = self._continuing(ids, mask, cont)
        n, n_step = ids.shape[0], int(cont.sum())
        self.stats["prefill_rows"] += n - n_step
        self.stats["incremental_rows"] += n_step
        self.ids, self.mask = ids, mask
        if n_step == n:  # the usual step: static, captured where the engine captures
            return engine.step(ids[:, -1], tail, tail_inputs, key)
        if self.restarts_in_step:  # `engine` is self.engine
            fill = torch.nonzero(~cont)[:, 0]
            self.stats["prefill_computed_rows"] += len(fill)
            if n_step == 0:
                engine.start_over()
                self.loaded = True
            fill = torch.cat([fill, fill[:1].expand(restart_bucket(len(fill), n) - len(fill))]).to(ids.device)
            return engine.restart(ids[:, -1], ids, mask, fill, tail, tail_inputs, key)
        if n_step == 0:
            hidden, kv = self._prefill(trunk, ids, mask)
            engine.load_rows(None, kv, mask)
            self.loaded = True
        else:  # every row steps (a row that starts computes a throwaway token), then restarts are written over
            hidden = engine.step(ids[:, -1]).clone()
            fill_rows = torch.nonzero(~cont)[:, 0].to(ids.device)
            h_fill, filled = self._prefill(trunk, ids[fill_rows], mask[fill_rows])
            engine.load_rows(fill_rows, filled, mask[fill_rows])
            hidden[fill_rows] = h_fill.to(hidden.dtype)
        return engine.tail(hidden, tail, tail_inputs, key)
