"""benchmarks/learner_log.py reads what `peer_trl.py --learner-log` writes: captures, the iteration
from which every batch had one shape, the buckets and replays after it, the reward's falls, and
where same-seed runs part."""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from benchmarks.learner_log import LogError, first_difference, load, summarize
from benchmarks.peer_trl import learner_record
from tests.conftest import ROOT


def _row(it, reward, batch=2560.0, graphs=0, replays=0.0, bucket=None, kl=0.01):
    return {"iteration": it, "reward": reward, "module_train_batch_size_mean": batch, "static_graphs": graphs,
            "static_update_replays": replays, "static_bucket": bucket, "mean_kl_loss": kl,
            "gradients_default_optimizer_global_norm": 2.0, "entropy": 0.1}


def _run():
    return [_row(1, 0.3, batch=2840.0), _row(2, 0.4), _row(3, 0.45, graphs=1, replays=1.0, bucket=0),
            _row(4, 0.5, batch=3338.0, graphs=1, bucket=1), _row(5, 0.6, batch=3338.0, graphs=2, replays=1.0, bucket=1),
            _row(6, 0.84, graphs=2, replays=1.0, bucket=0), _row(7, 0.70, graphs=2, replays=1.0, bucket=0, kl=0.4),
            _row(8, 0.84, graphs=2, replays=1.0, bucket=0)]


def test_a_run_is_summarized_as_its_log_says():
    s = summarize(_run(), fall=0.05)
    assert s["captures"] == [(3, 1, 2560.0), (5, 2, 3338.0)]
    assert s["usual_batch"] == 2560.0 and s["settled_from"] == 6  # the last other shape at iteration 5
    assert (s["iterations_after"], s["replayed_after"], s["buckets_after"]) == (3, 3, [0])
    assert [(f["iteration"], f["kl"]) for f in s["falls"]] == [(7, 0.4)]
    assert (s["final"], s["best"]) == (0.84, 0.84)


def test_a_run_whose_batch_shape_never_holds_says_so(capsys):
    from benchmarks.learner_log import report

    rows = _run()
    rows[-1] = {**rows[-1], "module_train_batch_size_mean": 2562.0}  # carried episodes: a few steps more
    s = summarize(rows)
    assert s["iterations_after"] == 0
    report("x.jsonl", s)
    assert "the batch shape never held to the end" in capsys.readouterr().out


def test_replay_checks_are_summarized_and_named_at_a_fall():
    rows = _run()
    rows[6] = {**rows[6], "replay_checks": [{"apart_over_moved": 0.002}, {"apart_over_moved": 0.9}]}
    rows[7] = {**rows[7], "replay_checks": [{"apart_over_moved": 0.001}]}
    s = summarize(rows, fall=0.05)
    assert s["checks"] == [(8, 0.001), (7, 0.9)]
    assert s["falls"][0]["check"] == 0.9  # the fall's iteration had a replay far from the eager update


def test_runs_of_one_seed_part_where_their_reward_loss_or_gradient_norm_first_differs():
    a, b = _run(), _run()
    assert first_difference([a, b]) is None
    b[3] = {**b[3], "reward": 0.51}
    assert first_difference([a, b]) == (4, "reward")
    b[2] = {**b[2], "total_loss": 0.1270653}  # the same reward, another loss
    assert first_difference([a, b]) == (3, "total_loss")


def test_the_script_prints_the_summary_and_names_a_log_it_cannot_read(tmp_path):
    good, cut, bad = tmp_path / "a.jsonl", tmp_path / "cut.jsonl", tmp_path / "b.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in _run()))
    cut.write_text("".join(json.dumps(r) + "\n" for r in _run()) + '{"iteration": 9, "rew')  # stopped mid-line
    bad.write_text(json.dumps(_row(1, 0.3)) + "\n{not json\n" + json.dumps(_row(2, 0.3)) + "\n")
    out = subprocess.run([sys.executable, "benchmarks/learner_log.py", str(good), str(tmp_path / "gone.jsonl"),
                          str(cut)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1  # a log could not be read; the others were summarized all the same
    assert "gone.jsonl: No such file or directory" in out.stderr and "cut.jsonl:9: the last line is cut short" in out.stderr
    assert "graph 2 captured at iteration 5 (batch of 3338 steps)" in out.stdout
    assert "every batch 2560 steps from iteration 6: 3 of its 3 iterations replayed a graph, bucket(s) [0]" in out.stdout
    assert "the runs are equal throughout (reward, loss, gradient norm)" in out.stdout  # good and cut
    assert "Traceback" not in out.stderr
    with pytest.raises(LogError, match=r"b.jsonl:2: not a JSON line"):
        load(str(bad))


def test_a_learner_record_names_the_bucket_the_last_update_took():
    buckets = {("a",): SimpleNamespace(graph=object()), ("b",): SimpleNamespace(graph=None)}
    learner = SimpleNamespace(_static_graphs=buckets, static_last_bucket=("b",))
    algo = SimpleNamespace(learner_group=SimpleNamespace(_learner=learner))
    row = learner_record(algo, {"training_iteration": 7, "learners": {}}, 1.0, 0.5)
    assert (row["static_buckets"], row["static_graphs"], row["static_bucket"]) == (2, 1, 1)
    learner.static_last_bucket = ("c",)  # an eager bucket (more than the learner captures) has no place
    assert learner_record(algo, {"training_iteration": 8, "learners": {}}, 1.0, 0.5)["static_bucket"] is None


def test_a_nearly_deterministic_policys_large_updates_are_counted_from_where_its_entropy_fell():
    rows = _run()
    assert summarize(rows)["plateau"] is None  # entropy 0.1 throughout: never nearly deterministic
    for row in rows[4:]:
        row["entropy"] = 0.01
    rows[4]["t"] = 7.5
    rows[5]["mean_kl_loss"] = float("nan")  # a metric missing in one iteration is left out
    s = summarize(rows)
    pl = s["plateau"]
    assert (pl["iteration"], pl["t"], pl["reward"], pl["iterations"]) == (5, 7.5, 0.6, 4)
    assert (pl["spikes"], pl["max_kl"], pl["lowest"]) == (1, 0.4, 0.6)  # iteration 7's KL of 0.4


def test_the_plateau_is_reported_in_one_line(capsys):
    from benchmarks.learner_log import report

    rows = _run()
    for row in rows[4:]:
        row["entropy"] = 0.01
    report("run.jsonl", summarize(rows))
    out = capsys.readouterr().out
    assert ("nearly deterministic (entropy < 0.05) from iteration 5, reward 0.600: over its 4 iterations "
            "1 updates with a KL above 0.1 (largest 0.4), lowest reward 0.600") in out


def test_update_clipping_on_the_plateau_is_counted_where_the_log_has_it(capsys):
    from benchmarks.learner_log import report

    rows = _run()
    for row in rows[4:]:
        row["entropy"] = 0.01
    assert summarize(rows)["plateau"]["clipped"] is None  # a run without training.update_clipping
    for row, scale in zip(rows, (1.0, 0.2, 1.0, 1.0, 1.0, 0.9, 0.3, 0.45)):
        row["update_clip_scale"] = scale
    pl = summarize(rows)["plateau"]
    assert (pl["clipped"], pl["smallest_scale"]) == (2, 0.3)  # iterations 7 and 8; iteration 2's was before
    report("run.jsonl", summarize(rows))
    assert "update clipping there: 2 updates with a tensor's step scaled below 0.5 (smallest scale 0.3)" in (
        capsys.readouterr().out)
