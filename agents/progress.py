"""What a training run prints as it goes: one line per iteration (`make_progress_callback`), and
the check that `tune.metric` names a number the results hold (`unreported_metric`: a run whose
metric ranks nothing stops at its first result with a one-line error, not at its end)."""
from __future__ import annotations

import json
import math
import os


def _lookup(result: dict, path: str):
    """The value at an "a/b/c" path of a result, None where the path leads nowhere."""
    node = result
    for part in path.split("/"):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def three_places(value: float) -> str:
    """`value` to three decimals, a value that rounds to zero as 0.000 (a sampled KL estimate just
    below zero is not printed as -0.000)."""
    return f"{round(value, 3) + 0.0:.3f}"


def _metric(result: dict, path: str):
    node = _lookup(result, path)
    try:
        value = float(node)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def _numeric_paths(result: dict, prefix: str = "") -> list[str]:
    """The "a/b/c" paths of a result's numeric values."""
    paths = []
    for key, value in result.items():
        if isinstance(value, dict):
            paths += _numeric_paths(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            paths.append(f"{prefix}{key}")
    return paths


# Result sections that appear only after a while: evaluation at its first interval, the
# learner's at its first update (DQN samples until `dqn.learning_starts` before updating).
LATE_SECTIONS = ("evaluation", "learners")


def metric_can_be_judged(metric: str, result: dict) -> bool:
    """Whether `result` should hold `metric` if the metric exists: the result holds the episode
    return (an iteration may end before any episode does), and the metric's section, if it is
    one that appears late, has appeared."""
    section = metric.split("/", 1)[0]
    return _metric(result, "env_runners/episode_return_mean") is not None and (
        section not in LATE_SECTIONS or bool(result.get(section)))


def unreported_metric(metric: str, result: dict) -> str | None:
    """The one-line error for a `tune.metric` that a result able to judge it
    (`metric_can_be_judged`) lacks, or None."""
    if not metric_can_be_judged(metric, result):
        return None
    node = _lookup(result, metric)
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return None
    return _unknown_metric_line(metric, _numeric_paths(result))


def _unknown_metric_line(metric: str, paths: list[str]) -> str:
    """The tune.metric error, with the closest of the results' `paths` as a hint."""
    import difflib

    hint = difflib.get_close_matches(metric, paths, n=1, cutoff=0.5)
    return (f"tune.metric: {metric!r} is not a number in the trials' results, so nothing ranks the trials"
            + (f" (did you mean {hint[0]!r}?)" if hint else " (e.g. 'env_runners/episode_return_mean')"))


def metric_error(error: BaseException, metric: str) -> ValueError | None:
    """The one-line tune.metric error behind a failed `tuner.fit()`, or None: the progress
    callback's, or Tune's own check for a scheduler's metric (ASHA, PBT) worded the same way."""
    seen = []
    while error is not None and error not in seen:
        seen.append(error)
        if isinstance(error, MetricNotReported):
            return ValueError(str(error))
        if "did not include the specified metric" in str(error):
            import re

            # the hint from the flat result's keys Tune's message quotes
            return ValueError(_unknown_metric_line(metric, re.findall(r"'([A-Za-z0-9_/.-]+)': ", str(error))))
        error = error.__cause__ or error.__context__
    return None


class MetricNotReported(ValueError):
    """tune.metric names no value of the results: raised out of the run at the first full result."""


def make_progress_callback(eval_interval: int = 0, quiet: bool = False, metric: str | None = None,
                           trials: int = 1):
    from ray.tune import Callback

    class ProgressPrinter(Callback):
        """One line per training iteration (prefixed with the trial's id where the experiment has
        several: `trials`, or more made); remembers each trial's first and last reward. The
        first full result that lacks `metric` (tune.metric) stops the run with a one-line error."""

        def __init__(self):
            self.first, self.last, self.best, self.mask, self.evals = {}, {}, {}, {}, {}
            self.guided = set()  # trials whose tracked reward is that of the policy-alone episodes
            self.metric_checked = metric is None

        def on_trial_result(self, iteration, trials, trial, result, **info):
            if not self.metric_checked:
                error = unreported_metric(metric, result)
                if error:
                    raise MetricNotReported(error)
                self.metric_checked = metric_can_be_judged(metric, result)
            reward, policy, greedy = self.remember(trial.trial_id, result)
            fields = [
                f"iter {result['training_iteration']:4d}",
                f"steps {int(_metric(result, 'env_runners/num_env_steps_sampled_lifetime') or 0):>9,}",
                f"reward {reward:.3f}" if reward is not None else "reward   n/a",
            ]
            if greedy is not None:
                fields.append(f"greedy {greedy:.3f}")
            if policy is not None:  # guided runs: episodes the policy wrote alone
                fields.append(f"policy {policy:.3f}")
            for key, label in (("ref_kl", "kl"), ("entropy", "entropy"), ("mask_size", "mask"),
                               ("qf_mean", "q"), ("td_error_mean", "td")):
                value = _metric(result, f"learners/default_policy/{key}")
                if value is not None:
                    fields.append(f"{label} {three_places(value)}")
            fields.append(f"{result.get('time_total_s', 0):.0f}s")
            prefix = f"[{trial.trial_id}] " if max(len(trials), many) > 1 else ""
            if not quiet:
                print(prefix + "  ".join(fields), flush=True)

        def remember(self, trial_id: str, result: dict):
            """Adds a result to the trial's first/last/best reward, evaluations and mask sizes;
            returns its (episode reward, policy-alone reward, fresh greedy evaluation reward)."""
            reward = _metric(result, "env_runners/episode_return_mean")
            # Guided runs: the summary follows the episodes the policy wrote alone (no guide token).
            policy = _metric(result, "env_runners/policy_return_mean")
            tracked = policy if "guide_mode_aggrevated" in result else reward
            if "guide_mode_aggrevated" in result:
                self.guided.add(trial_id)
            if tracked is not None:
                self.first.setdefault(trial_id, (result["training_iteration"], tracked))
                self.last[trial_id] = (result["training_iteration"], tracked)
                self.best[trial_id] = max(tracked, self.best.get(trial_id, -math.inf))
            # RLlib repeats the last evaluation's results in the iterations after it; keep fresh ones.
            fresh = eval_interval and result["training_iteration"] % eval_interval == 0
            greedy = _metric(result, "evaluation/env_runners/episode_return_mean") if fresh else None
            if greedy is not None:
                self.evals.setdefault(trial_id, []).append((result["training_iteration"], greedy))
            mask = _metric(result, "learners/default_policy/mask_size")
            if mask is not None:
                self.mask.setdefault(trial_id, []).append(mask)
            return reward, policy, greedy

        def replay(self, trial_id: str, trial_dir: str, filesystem=None) -> None:
            """Rebuilds the trial's figures from every row its result.json holds: a resumed run's
            summary covers the iterations before the resume, and trials that had finished by then,
            and a summary leaves out the rows a retried or PBT-exploited trial ran again (the
            file keeps each iteration's last run; this process saw both). `filesystem`: the
            storage path's (pyarrow), where `trial_dir` is on it; else a local path."""
            try:
                if filesystem is None:
                    with open(os.path.join(trial_dir, "result.json"), "rb") as f:
                        text = f.read()
                else:  # the storage path's own (pyarrow) filesystem: a bucket too
                    with filesystem.open_input_stream(f"{trial_dir.rstrip('/')}/result.json") as f:
                        text = f.read()
                rows = [json.loads(line) for line in text.decode("utf-8").splitlines() if line.strip()]
            except (OSError, ValueError):
                return  # no stored rows (the trial never reported): keep what this process saw
            rows = [r for r in rows if "training_iteration" in r]
            seen = self.last.get(trial_id, (0,))[0]
            if not rows or max(r["training_iteration"] for r in rows) < seen:  # a copy behind this process
                return
            for figures in (self.first, self.last, self.best, self.mask, self.evals):
                figures.pop(trial_id, None)
            self.guided.discard(trial_id)
            for row in sorted(rows, key=lambda r: r["training_iteration"]):
                self.remember(trial_id, row)

    many = trials  # a sweep run one trial at a time has one trial made when its first reports
    return ProgressPrinter()
