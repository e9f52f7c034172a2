"""TRL's GRPOTrainer vs the project's PPO on the quickstart task: completion tokens/s and reward vs wall-clock.

    python benchmarks/peer_trl.py [--seconds 120] [--trl-lr 1e-3 3e-3] [--trl-only | --project-only]
                                  [--set key=value ...] [--threads 2] [--plot reward.png] [--target 0.8]
                                  [--trl-num-generations 64] [--model tiny-gpt2] [--device cpu|cuda]

Needs the optional peers: `.venv/bin/python -m pip install -r benchmarks/requirements-peers.txt`
(TRL 1.16.0; `--project-only` runs without it). Prints measured figures; it never passes or fails on a
wall time. Both systems run one after the other in this process, on the same machine and
`torch.set_num_threads(--threads)`, each for `--seconds` of training wall-clock.

The task is the quickstart's (tune_configs/quickstart.yaml): the prompt is 5 pad tokens, 20 new
tokens over a vocabulary of 50 number tokens + pad + EOS, reward = the fraction of the 19 adjacent
pairs in ascending order, computed by the env's own `TokenGenerationEnv.score` (EOS and pad are
sampled like any other token and decoded away; an early EOS forfeits the missing pairs).

--model (default tiny-gpt2; gpt2-small-shaped for GPT-2-small's shape) and --device (cpu, or cuda:
both systems on the GPU: TRL without use_cpu, the project with learners.num_gpus_per_learner=1, whose
rollouts then run on the learner's GPU (agents/weight_sync.py)) apply to both sides.

(a) TRL `GRPOTrainer` (public API only) on the same randomly initialised --model
    (`agents.models.build_causal_lm({"name_or_path": "tiny-gpt2"}, tokenizer, seed=0,
    max_positions=5 + 20)`, sized to the task's tokenizer; the task comes from --config without the
    --set overrides, which are the project's). Settings:
      * 64 completions per optimizer step: per_device_train_batch_size=64 and
        num_generations=--trl-num-generations (default 64: every prompt is the same, so one group of
        64 gives GRPO's group baseline the most samples; 8 gives 8 groups of 8);
        steps_per_generation=--trl-steps-per-generation (default 1, TRL's default: one gradient step
        per generation batch, so every update is on-policy; 2 generates 128 completions per
        `generate()` call and takes two steps of 64, TRL's way of keeping more rows in flight, the
        counterpart of the project's `num_envs_per_env_runner=128`), num_iterations=1, beta=0.0
        (TRL's default: no reference model, no KL term), loss_type="dapo", scale_rewards="group",
        epsilon=0.2 (all TRL defaults);
      * max_completion_length=20, temperature=1.0, top_k=0, top_p=1.0, min_p=None (no truncation);
        generation through `model.generate()` with its KV cache;
      * AdamW at --trl-lr with a constant schedule (no warm-up, no decay: the run is stopped on a
        wall-clock budget, so a schedule over max_steps would be arbitrary), max_grad_norm=1.0,
        fp32 (--trl-precision; TRL defaults to bf16 mixed precision, which on an H100 at GPT-2-small
        shape made it slower: 8,898 against 10,664 tok/s in two runs, docs/results/gpu.md), gradient_checkpointing=False
        (TRL defaults to True),
        use_cpu=True unless --device cuda, report_to="none", save_strategy="no", no dropout (the project
        model has none);
      * the dataset is an in-memory `datasets.Dataset` whose rows all hold the task's prompt text
        "<pad> <pad> <pad> <pad> <pad>". TRL tokenizes a plain-text prompt with
        `tokenizer(text=prompts)`; the project's word-level tokenizer adds no special tokens and
        does not strip `<pad>`, so the ids are [0, 0, 0, 0, 0], and TRL builds the generation
        attention mask from the prompt's length (not from the pad id), so the model sees the same
        5-token, fully attended prompt the env gives the project's policy. The script checks both
        before training and fails loudly if either ever changes.
    Completion tokens are counted in the reward function from TRL's `completion_ids`: the tokens
    sampled up to and including the first EOS (TRL cuts the rest off), i.e. the same unit as an env
    step on the project side. TRL's own `num_tokens` log counts prompt + completion tokens; the
    script cross-checks its count against `num_tokens - 5 * completions`.
    GRPO learns nothing from a group whose rewards are all equal; on this task it often freezes on
    one deterministic sequence (e.g. 16/19 = 0.842). The report counts such groups from the rewards
    themselves: TRL's `frac_reward_zero_std` misses them (the float32 std of 64 equal rewards is
    ~6e-8, above `torch.isclose`'s 1e-8, so they get uniform advantages of about +-6e-4 instead).

(b) The project's PPO on the quickstart config (plus --set overrides), built with
    `agents.config.algorithm_config(cfg).build_algo()` (no Tune), `algo.train()` until the budget is
    spent. Tokens = env steps sampled (`num_env_steps_sampled_lifetime`), which includes EOS steps.

For both: tokens/s INCLUDING learning = completion tokens generated after the warm-up (first)
step / iteration, divided by the wall time after it (model construction, Ray start and the warm-up
excluded). Reward vs wall-clock: seconds since the first train call started (warm-up included), and
the mean reward of the last 100 episodes (RLlib's `episode_return_mean` uses a 100-episode window by
default; for TRL the trailing 100 completions). The project's return is the task reward only (its
per-token KL penalty, kl_coef 5e-4, and entropy bonus enter the learner's loss, not the return).
Caveats: PPO and GRPO differ (PPO: value baseline, GAE, 4 epochs of minibatch updates on ~2,048 env
steps per iteration; GRPO: group-mean baseline, one step on 64 completions); the budget is the same
wall-clock, not the same number of samples or updates. TRL has an `entropy_coef` (0 by default,
left at 0 here); the project's quickstart uses an entropy bonus of 0.005.

Each run also splits its timed part into microseconds per completion token: generation (TRL's
`model.generate`; the project's module `act` calls), training passes (TRL's `compute_loss`, backward
and optimizer step; the project's `forward_train`, `compute_losses`, `compute_gradients` and
`apply_gradients`), the project's reference pass (the KL penalty's `reference_logp`), and everything
else (TRL: reward calls, advantages, batching, the Trainer loop; the project: the env, episode
records, learner connectors and GAE, weight sync, metrics). The summary then prints what the
project's loop would reach with nothing but its model calls, against TRL's whole loop.

Each run also reports the seconds to reach --target, and the CPU cores this process and the whole
machine kept busy in the timed part: the figures only count when the two agree (nothing else
running). Both collapse under contention: with other CPU-bound work on the 2 cores, TRL ran 20-50x
and the project 3-10x slower than idle.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import shutil
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.static_verify

from agents.config import algorithm_config, env_config, load  # noqa: E402
from agents.env_runner import runner_decode_block  # noqa: E402

# transformers 5.23 renames gradient_checkpointing; TRL 1.16 still passes the old name.
warnings.filterwarnings("ignore", message=".*deprecated and will be removed in v6.*", category=FutureWarning)

MODULE_ID = "default_policy"  # RLlib's single module
WINDOW = 100  # episodes in a reward point (RLlib's default metrics_num_episodes_for_smoothing)


def _fmt_curve(curve, every_s=10.0):
    """About one (seconds, reward) point per `every_s` seconds, plus the last."""
    out, next_t = [], 0.0
    for i, (t, r) in enumerate(curve):
        if t >= next_t or i == len(curve) - 1:
            out.append(f"({t:.0f}s, {r:.3f})")
            next_t = t + every_s
    return " ".join(out)


class Progress:
    """One line about every 15 s while a run trains, with the machine's load average."""

    def __init__(self, name: str, every_s: float = 15.0):
        self.name, self.every_s, self.next_t = name, every_s, 0.0
        print(f"  [{name}] start; load average {loadavg()}", flush=True)

    def __call__(self, t: float, reward: float, tokens: int):
        if t >= self.next_t:
            print(f"  [{self.name}] {t:6.1f} s  reward {reward:.3f}  tokens {tokens:,}  load {loadavg()}", flush=True)
            self.next_t = t + self.every_s


def cpu_snapshot() -> tuple[float, float, float]:
    """(wall s, this process's CPU s, the whole machine's busy CPU s) for a contention check."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    busy = math.nan
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle, iowait
    except (OSError, ValueError, IndexError):
        pass
    return time.perf_counter(), ru.ru_utime + ru.ru_stime, busy


def cpu_use(a, b) -> dict:
    wall = b[0] - a[0]
    return {"own": (b[1] - a[1]) / wall, "machine": (b[2] - a[2]) / wall}


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


PHASES = ("generation", "training passes", "reference pass")


class PhaseTimer:
    """Seconds spent inside chosen methods, by phase (outermost timed call only: a timed method
    that calls another is counted once). `wrap` patches an instance's or a class's attribute;
    `restore` undoes every patch."""

    def __init__(self, sync=None):
        self.s = dict.fromkeys(PHASES, 0.0)
        self._depth = 0
        self._patches = []
        self._sync = sync or (lambda: None)  # on a GPU: wait for the device, so a phase holds its kernels

    def wrap(self, owner, name: str, phase: str):
        orig = getattr(owner, name)
        timer = self

        def timed(*args, **kwargs):
            # inside a CUDA graph's capture a device sync would invalidate the capture (and a
            # captured call's time is its replay's, timed by the outer call)
            if timer._depth or capturing():
                return orig(*args, **kwargs)
            timer._depth += 1
            timer._sync()
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                timer._sync()
                timer._depth -= 1
                timer.s[phase] += time.perf_counter() - t0

        self._patches.append((owner, name, name in vars(owner), vars(owner).get(name)))
        setattr(owner, name, timed)

    def add(self, phase: str, seconds: float):
        self.s[phase] += seconds

    def snapshot(self) -> dict:
        return dict(self.s)

    def restore(self):
        for owner, name, had, old in reversed(self._patches):
            if had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        self._patches = []


def phase_split(start: dict, end: dict, wall: float, tokens: int) -> dict:
    """Microseconds per completion token in each phase between two snapshots, and the rest."""
    us = {k: (end[k] - start[k]) / tokens * 1e6 for k in PHASES}
    us["everything else"] = wall / tokens * 1e6 - sum(us.values())
    return us


# -- (a) TRL ---------------------------------------------------------------------------

def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (never without CUDA)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def device_sync(device: str):
    """A function that waits for `device`'s queued work (None on the CPU)."""
    import torch

    return torch.cuda.synchronize if device == "cuda" else None


def run_trl(cfg: dict, lr: float, seconds: float, num_generations: int, threads: int,
            steps_per_generation: int = 1, model_name: str = "tiny-gpt2", device: str = "cpu",
            precision: str = "fp32") -> dict:
    import torch
    import transformers
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from agents.models import build_causal_lm, build_tokenizer
    from env.text_env import TokenGenerationEnv

    transformers.logging.set_verbosity_error()
    ecfg = env_config(cfg)
    env = TokenGenerationEnv(ecfg)
    tokenizer = build_tokenizer(ecfg)
    prompt_len, new_tokens = ecfg["max_prompt_len"], ecfg["max_new_tokens"]
    model = build_causal_lm({"name_or_path": model_name}, tokenizer, seed=0,
                            max_positions=prompt_len + new_tokens)
    prompt_text = env.examples[0]["prompt"]
    n_rows = 4096  # rows are all the same prompt; the trainer cycles epochs until stopped
    dataset = Dataset.from_dict({"prompt": [prompt_text] * n_rows})

    # Check the prompt TRL will feed the model: TRL calls tokenizer(text=prompts) for plain-text
    # prompts and builds the generation attention mask from each prompt's length.
    trl_ids = tokenizer(text=[prompt_text])["input_ids"][0]
    env_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    if trl_ids != env_ids or len(trl_ids) != prompt_len:
        raise RuntimeError(f"TRL's prompt ids {trl_ids} differ from the env's {env_ids}")

    state = {"tokens": 0, "completions": 0, "recent": [], "seen_prompts": set(),
             "trl_num_tokens": None, "lengths": [],
             "zero_std": [], "distinct": 0}

    def task_reward(prompts, completions, completion_ids, **kwargs):
        scores = env.score(list(prompts), list(completions), [{} for _ in completions])
        state["tokens"] += sum(len(ids) for ids in completion_ids)
        state["completions"] += len(completion_ids)
        state["lengths"].extend(len(ids) for ids in completion_ids)
        state["recent"] = (state["recent"] + scores)[-WINDOW:]
        state["seen_prompts"].update(prompts)
        # Groups are consecutive runs of num_generations completions of one prompt. A group whose
        # rewards are all equal has zero advantage: no policy gradient from it. (TRL's own
        # frac_reward_zero_std misses most of these: its float32 std of 64 equal rewards is ~6e-8,
        # above isclose's 1e-8 tolerance.)
        groups = [scores[i:i + num_generations] for i in range(0, len(scores), num_generations)]
        state["zero_std"].append(sum(len(set(g)) == 1 for g in groups) / len(groups))
        state["distinct"] = len(set(completions))
        return scores

    class Clock(TrainerCallback):
        def __init__(self):
            self.t0 = None
            self.cpu = []
            self.points = []  # (seconds since train start, trailing-100 reward, cumulative tokens)

        def on_pre_optimizer_step(self, args, st, control, **kwargs):
            self.opt_t0 = time.perf_counter()

        def on_optimizer_step(self, args, st, control, **kwargs):
            phases.add("training passes", time.perf_counter() - self.opt_t0)

        def on_step_end(self, args, st, control, **kwargs):
            t = time.perf_counter() - self.t0
            if not self.points:  # the end of the warm-up step: the phase split starts here
                self.phases0 = phases.snapshot()
            self.points.append((t, sum(state["recent"]) / len(state["recent"]), state["tokens"]))
            self.cpu.append(cpu_snapshot())
            del self.cpu[1:-1]  # keep the first (end of the warm-up step) and the latest
            progress(t, *self.points[-1][1:])
            if t >= seconds:
                control.should_training_stop = True
            return control

        def on_log(self, args, st, control, logs=None, **kwargs):
            if logs and "num_tokens" in logs:
                state["trl_num_tokens"] = (logs["num_tokens"], state["completions"], state["tokens"])

    clock = Clock()
    phases = PhaseTimer(device_sync(device))
    progress = Progress(f"TRL lr={lr:g}")
    out_dir = tempfile.mkdtemp(prefix="peer_trl_")
    args = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=64,
        num_generations=num_generations,
        steps_per_generation=steps_per_generation,
        num_iterations=1,
        max_completion_length=new_tokens,
        temperature=1.0, top_k=0, top_p=1.0, min_p=None,
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        max_steps=10**6,
        bf16=precision == "bf16", fp16=False, gradient_checkpointing=False, use_cpu=device == "cpu",
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, log_level="error",
        dataloader_num_workers=0, seed=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=task_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock])
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    gen = trainer.generation_config
    assert gen.do_sample and gen.temperature == 1.0 and not gen.top_k and gen.top_p == 1.0, gen
    assert gen.max_new_tokens == new_tokens, gen
    torch.set_num_threads(threads)
    # Where TRL's time goes: its sampling (`model.generate`, called on the model itself on one CPU
    # process), and its training passes (the loss's forward pass, backward, optimizer step).
    phases.wrap(trainer.model, "generate", "generation")
    phases.wrap(trainer, "compute_loss", "training passes")
    phases.wrap(trainer.accelerator, "backward", "training passes")

    clock.t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        phases.restore()
        shutil.rmtree(out_dir, ignore_errors=True)  # TRL's required output folder; nothing is saved in it
    threads_seen = torch.get_num_threads()
    print(f"  [TRL lr={lr:g}] done; load average {loadavg()}", flush=True)
    pts = clock.points
    if len(pts) < 2:
        raise RuntimeError(f"TRL ran {len(pts)} step(s) in {seconds}s; raise --seconds")
    (t1, _, k1), (tn, _, kn) = pts[0], pts[-1]
    if state["seen_prompts"] != {prompt_text}:
        raise RuntimeError(f"TRL passed prompts {state['seen_prompts']!r}")
    name = f"TRL GRPO lr={lr:g}" + (f" spg={steps_per_generation}" if steps_per_generation > 1 else "")
    res = {
        "name": name, "lr": lr, "steps": len(pts), "tokens": kn, "completions": state["completions"],
        "tok_s": (kn - k1) / (tn - t1), "wall": tn, "timed_wall": tn - t1,
        "curve": [(t, r) for t, r, _ in pts], "final": pts[-1][1], "best": max(r for _, r, _ in pts),
        "first": pts[0][1], "warmup": t1, "threads": threads_seen,
        "mean_len": sum(state["lengths"]) / len(state["lengths"]), "cpu": cpu_use(clock.cpu[0], clock.cpu[-1]),
        "zero_std": state["zero_std"], "distinct": state["distinct"],
        "phases": phase_split(clock.phases0, phases.snapshot(), tn - t1, kn - k1),
    }
    if state["trl_num_tokens"] is not None:  # TRL counts prompt + completion tokens
        num_tokens, n_done, ours = state["trl_num_tokens"]
        res["trl_completion_tokens"] = (num_tokens - prompt_len * n_done, ours)
    return res


# -- (b) the project -------------------------------------------------------------------

def learner_record(algo, result: dict, t: float, reward: float, checks: list = ()) -> dict:
    """One iteration's learner metrics (scalars), the static update's buckets and the replay
    checks made in it (--static-verify-every), for --learner-log."""
    learner = algo.learner_group._learner
    row = {"iteration": result["training_iteration"], "t": round(t, 3), "reward": reward}
    for key, value in result.get("learners", {}).get(MODULE_ID, {}).items():
        if isinstance(value, (int, float)):
            row[key] = float(value)
    graphs = getattr(learner, "_static_graphs", None) or {}
    row["static_buckets"] = len(graphs)
    row["static_graphs"] = sum(1 for entry in graphs.values() if entry.graph)
    last = getattr(learner, "static_last_bucket", None)  # the bucket's place in the order of first use
    row["static_bucket"] = list(graphs).index(last) if last in graphs else None
    if checks:
        row["replay_checks"] = checks
    return row


def report_checks(checked: list) -> None:
    """--static-verify-every: how far the checked replays' updates were from the eager ones."""
    if not checked:
        print("  [project] replay checks: none made (no update was served by a captured graph)", flush=True)
        return
    worst_it, worst = max(checked, key=lambda ic: ic[1]["apart_over_moved"])
    ratios = sorted(c["apart_over_moved"] for _, c in checked)
    print(f"  [project] replay checks: {len(checked)} ({sum(c['replayed'] for _, c in checked)} replays); "
          f"|replay - eager| / |eager update| median {ratios[len(ratios) // 2]:.3g}, largest "
          f"{worst['apart_over_moved']:.3g} at iteration {worst_it} (loss {worst['loss']:.5g} against eager "
          f"{worst['eager_loss']:.5g})", flush=True)


def run_project(cfg: dict, seconds: float, threads: int, device: str = "cpu", learner_log: str | None = None,
                verify_every: int | None = None) -> dict:
    import ray
    import torch

    progress = Progress("project")
    check = None  # --static-verify-every's ReplayCheck
    ray.init(num_cpus=2, num_gpus=1 if device == "cuda" else 0, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    try:
        algo = algorithm_config(cfg).build_algo()
        torch.set_num_threads(threads)
        # Where the project's time goes: its sampling (the module's `act`, one call per vector
        # step, or `act_steps` per block of steps), its training passes (the loss's forward pass,
        # the losses, backward, optimizer step) and the reference pass of the KL penalty. Patched
        # on the classes, so the EnvRunner's and the learner's instances are both timed.
        phases = PhaseTimer(device_sync(device))
        runner = algo.env_runner_group.local_env_runner
        module_cls, learner_cls = type(runner.module), algo.config.learner_class
        print(f"  [project] rollouts on {next(runner.module.parameters()).device}, decode block "
              f"{runner_decode_block(runner)}", flush=True)
        phases.wrap(module_cls, "act", "generation")
        if hasattr(module_cls, "act_steps"):  # env_runners.decode_block > 1: k steps per call
            phases.wrap(module_cls, "act_steps", "generation")
        if cfg["training"].get("static_update"):  # the update is one function, replayed as a CUDA graph
            phases.wrap(learner_cls, "_update", "training passes")
        else:
            for name in ("forward_train",):
                phases.wrap(module_cls, name, "training passes")
            for name in ("compute_losses", "compute_gradients", "apply_gradients"):
                phases.wrap(learner_cls, name, "training passes")
        if hasattr(module_cls, "reference_logp"):
            phases.wrap(module_cls, "reference_logp", "reference pass")
        log = open(learner_log, "w") if learner_log else None  # noqa: SIM115 (closed below)
        checked = []
        if verify_every:
            from benchmarks.static_verify import ReplayCheck

            check = ReplayCheck(verify_every)
            check.install()
        points = []  # (seconds since train start, episode_return_mean, env steps sampled)
        cpu = []
        t0 = time.perf_counter()
        while True:
            result = algo.train()
            t = time.perf_counter() - t0
            er = result["env_runners"]
            points.append((t, er.get("episode_return_mean", math.nan), int(er["num_env_steps_sampled_lifetime"])))
            cpu.append(cpu_snapshot())
            if len(points) == 1:
                phases0 = phases.snapshot()
            progress(t, points[-1][1], points[-1][2])
            checks = check.take() if check else []
            checked += [(len(points), c) for c in checks]
            if log is not None:
                log.write(json.dumps(learner_record(algo, result, t, points[-1][1], checks)) + "\n")
            if t >= seconds:
                break
        phases1 = phases.snapshot()
        phases.restore()
        if check is not None:
            check.remove()
            report_checks(checked)
        if log is not None:
            log.close()
        threads_seen = torch.get_num_threads()
        print(f"  [project] done; load average {loadavg()}", flush=True)
        algo.stop()
    finally:
        if check is not None:
            check.remove()
        ray.shutdown()
    if len(points) < 2:
        raise RuntimeError(f"the project ran {len(points)} iteration(s) in {seconds}s; raise --seconds")
    (t1, _, k1), (tn, _, kn) = points[0], points[-1]
    rewards = [r for _, r, _ in points if not math.isnan(r)]
    return {
        "name": "project PPO", "steps": len(points), "tokens": kn, "tok_s": (kn - k1) / (tn - t1),
        "wall": tn, "timed_wall": tn - t1, "curve": [(t, r) for t, r, _ in points],
        "final": points[-1][1], "best": max(rewards), "first": points[0][1], "warmup": t1, "threads": threads_seen,
        "cpu": cpu_use(cpu[0], cpu[-1]), "phases": phase_split(phases0, phases1, tn - t1, kn - k1),
    }


# -- report ----------------------------------------------------------------------------

def time_to(curve, target: float):
    """Seconds until the reward curve first reaches `target`, or None."""
    return next((t for t, r in curve if r >= target), None)


def report(res: dict, unit: str, target: float):
    print(f"\n== {res['name']}")
    print(f"  {res['steps']} {unit}s in {res['wall']:.1f} s (warm-up {unit} {res['warmup']:.1f} s); "
          f"{res['tokens']:,} completion tokens")
    print(f"  completion tokens/s including learning (after the warm-up {unit}): {res['tok_s']:,.0f} "
          f"({res['timed_wall']:.1f} s timed)")
    print(f"  reward (mean of last {WINDOW} episodes): first {unit} {res['first']:.3f} -> final {res['final']:.3f}, "
          f"best {res['best']:.3f}")
    reached = time_to(res["curve"], target)
    print(f"  mean reward {target:g} " + (f"first reached at {reached:.1f} s" if reached is not None else "not reached"))
    if res.get("zero_std"):
        z = res["zero_std"]
        print(f"  share of groups whose rewards were all equal (zero advantage, no policy gradient): "
              f"{sum(z) / len(z):.2f} over all steps, {sum(z[-10:]) / len(z[-10:]):.2f} over the last 10; "
              f"distinct completions in the last step: {res['distinct']} of 64")
    if "mean_len" in res:
        print(f"  mean completion length {res['mean_len']:.2f} tokens over {res['completions']:,} completions")
    if "trl_completion_tokens" in res:
        theirs, ours = res["trl_completion_tokens"]
        print(f"  cross-check at TRL's last log: its num_tokens - prompt tokens = {theirs:,.0f}, counted here {ours:,}")
    c = res["cpu"]
    print(f"  torch threads after the run: {res['threads']}; CPU cores busy in the timed part: this process "
          f"{c['own']:.2f}, whole machine {c['machine']:.2f} of {os.cpu_count()} (the difference is other load"
          f"{', Ray daemons included' if 'lr' not in res else ''})")
    print(f"  reward vs wall-clock: {_fmt_curve(res['curve'])}")
    if unit == "iteration" and len(res["curve"]) >= 100:  # one point per update: runs compared by updates made
        print("  reward by iteration: " + " ".join(f"({k}, {res['curve'][k - 1][1]:.3f})"
                                                  for k in range(100, len(res["curve"]) + 1, 100)))
    if "phases" in res:
        total = sum(res["phases"].values())
        print("  time per completion token (timed part): " + ", ".join(
            f"{k} {v:.1f} us ({v / total:.0%})" for k, v in res["phases"].items()) + f"; total {total:.1f} us")


def plot(path: str, runs: list[dict], title: str = "increasing-numbers task, tiny GPT-2, CPU"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for res in runs:
        ts, rs = zip(*res["curve"])
        ax.plot(ts, rs, label=f"{res['name']} ({res['tok_s']:,.0f} tok/s)")
    ax.set_xlabel("training wall-clock (s)")
    ax.set_ylabel(f"mean reward (last {WINDOW} episodes)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tune_configs/quickstart.yaml")
    p.add_argument("--seconds", type=float, default=120.0, help="training wall-clock budget per run")
    p.add_argument("--trl-lr", type=float, nargs="+", default=[1e-3])
    p.add_argument("--trl-num-generations", type=int, default=64, help="completions per prompt group (divides 64)")
    p.add_argument("--trl-steps-per-generation", type=int, nargs="+", default=[1],
                   help="TRL's steps_per_generation: each generate() call samples 64 x this many completions, "
                        "then takes this many optimizer steps of 64 (one run per value and lr)")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--trl-only", action="store_true")
    only.add_argument("--project-only", action="store_true")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="project config override")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--plot", default=None, help="save a PNG of reward vs wall-clock here")
    p.add_argument("--target", type=float, default=0.8, help="report the seconds each run took to reach this reward")
    p.add_argument("--model", default="tiny-gpt2", help="both sides' model: a built-in config or a local directory")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="both sides on this device")
    p.add_argument("--trl-precision", default="fp32", choices=("fp32", "bf16"),
                   help="TRL's: fp32, or bf16 mixed precision (TRL's default; needs --device cuda)")
    p.add_argument("--learner-log", default=None,
                   help="write each project iteration's learner metrics (losses, entropy, clip fraction, "
                        "gradient norm, the static update's replays and buckets) here as JSON lines")
    p.add_argument("--static-max-graphs", type=int, default=None,
                   help="with training.static_update: capture at most this many buckets as CUDA graphs "
                        "(0: the static update runs eagerly on the GPU); default the learner's (8)")
    p.add_argument("--static-private-pools", action="store_true",
                   help="with training.static_update: each captured bucket in its own memory pool (default: one "
                        "pool shared by the buckets' graphs)")
    p.add_argument("--static-verify-every", type=int, default=None,
                   help="with training.static_update: check every N-th update a captured graph serves "
                        "against the same update run eagerly (benchmarks/static_verify.py)")
    args = p.parse_args()
    if args.static_verify_every is not None and args.static_verify_every < 1:
        p.error(f"--static-verify-every: must be at least 1 (got {args.static_verify_every})")
    if args.static_max_graphs is not None or args.static_private_pools:
        from agents.algorithms import static_update

        if args.static_max_graphs is not None:
            static_update.MAX_GRAPHS = args.static_max_graphs
        static_update.SHARED_POOL = not args.static_private_pools
    if 64 % args.trl_num_generations:
        p.error("--trl-num-generations must divide 64")

    import torch

    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    if args.trl_precision == "bf16" and args.device != "cuda":
        p.error("--trl-precision bf16: needs --device cuda")
    base_cfg = load(args.config)  # TRL: the task as the config file gives it
    both = [f"model.name_or_path={args.model}"] + (["learners.num_gpus_per_learner=1"] if args.device == "cuda" else [])
    cfg = load(args.config, both + args.overrides)  # the project: with --set overrides
    gpu = f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""
    print(f"config={args.config} overrides={args.overrides} threads={args.threads} seconds={args.seconds:g} "
          f"torch={torch.__version__} model={args.model} device={args.device}{gpu}")

    trl_runs, project = [], None
    if not args.project_only:
        import trl

        print(f"TRL {trl.__version__}: lr {args.trl_lr}, 64 completions per step, "
              f"num_generations={args.trl_num_generations}, {args.trl_precision}")
        for spg in args.trl_steps_per_generation:
            for lr in args.trl_lr:
                res = run_trl(base_cfg, lr, args.seconds, args.trl_num_generations, args.threads, spg,
                              model_name=args.model, device=args.device, precision=args.trl_precision)
                report(res, "step", args.target)
                trl_runs.append(res)
    if not args.trl_only:
        project = run_project(cfg, args.seconds, args.threads, args.device, args.learner_log,
                              args.static_verify_every)
        report(project, "iteration", args.target)

    print("\n== summary")
    rows = trl_runs + ([project] if project else [])
    print(f"  {'run':<24} {'tok/s':>8} {'final reward':>13} {'best':>6} {'s to ' + format(args.target, 'g'):>8} "
          f"{'steps/iters':>12}")
    for res in rows:
        reached = time_to(res["curve"], args.target)
        reached = "never" if reached is None else f"{reached:.1f}"
        print(f"  {res['name']:<24} {res['tok_s']:>8,.0f} {res['final']:>13.3f} {res['best']:>6.3f} {reached:>8} "
              f"{res['steps']:>12}")
    if trl_runs:
        # Ties on the final reward (GRPO often freezes on the same deterministic sequence) go to the
        # run that reached it first.
        by_reward = max(trl_runs, key=lambda r: (round(r["final"], 3), -time_to(r["curve"], r["final"])))
        by_speed = max(trl_runs, key=lambda r: r["tok_s"])
        print(f"  best TRL by final reward: {by_reward['name']} ({by_reward['final']:.3f}); "
              f"by tokens/s: {by_speed['name']} ({by_speed['tok_s']:,.0f})")
        if project:
            print(f"  tokens/s ratio project / TRL: {project['tok_s'] / by_reward['tok_s']:.2f} "
                  f"(vs the best-reward lr), {project['tok_s'] / by_speed['tok_s']:.2f} (vs the fastest lr)")
            print(f"  final reward project {project['final']:.3f} vs TRL (best lr) {by_reward['final']:.3f} "
                  f"after {args.seconds:g} s each")
            # The project's model calls alone (no env, episodes, connectors, weight sync or
            # metrics) against TRL's whole loop: the most the project's loop could reach by
            # cutting its own bookkeeping, with the same passes.
            ph = project["phases"]
            for label, keys in (("generation + training passes + reference pass", PHASES),
                                ("generation + training passes (no reference pass: kl_coef 0)", PHASES[:2])):
                us = sum(ph[k] for k in keys)
                print(f"  project with nothing but its {label}: {us:.1f} us per token = {1e6 / us:,.0f} tok/s, "
                      f"{1e6 / us / by_speed['tok_s']:.2f}x TRL's fastest")
    if args.plot:
        plot(args.plot, rows, f"increasing-numbers task, {args.model}, {args.device}{gpu}")


if __name__ == "__main__":
    main()
