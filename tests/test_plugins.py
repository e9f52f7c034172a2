"""Your own rewards and tasks by name (`module:attr`, installed entry points) and the `tokenmdp`
command: they build, score and train as a built-in does, and every mistake is one line."""
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from env.rewards import RewardConfigError, RewardError, make_reward
from env.tasks import make_task
from env.text_env import TokenGenerationEnv
from tests.conftest import QUICKSTART, one_line_cli_error

PLUGINS = textwrap.dedent('''
    import math
    import random

    from env.tokenization import word_level_tokenizer

    CALLS = []


    def politeness(prompts, generations, metas, *, word: str = "please", bonus: float = 1.0):
        CALLS.append(len(generations))
        return [bonus * text.split().count(word) for text in generations]


    def one_argument(generations):
        return [0.0 for _ in generations]


    class Reverse:
        """Write the prompt's words reversed; `reward` (a reward spec, e.g. a function of yours) is added."""
        name = "reverse"

        def __init__(self, length: int = 3, vocabulary: int = 6, seed: int = 0, max_new_tokens: int = 0,
                     reward: dict | None = None):
            from env.rewards import make_reward

            if length < 2:
                raise ValueError("task.length: expected an integer >= 2")
            self.extra = make_reward(reward, path="task.reward") if reward else None
            self.length, self.max_new_tokens = length, max_new_tokens
            self.words = [f"w{i}" for i in range(vocabulary)]
            rng = random.Random(seed)
            self.prompts = [" ".join(rng.choice(self.words) for _ in range(length)) for _ in range(50)]

        def tokenizer(self):
            return word_level_tokenizer([*self.words, "=", "please"])

        def examples(self, split="train"):
            return [{"prompt": p + " =", "meta": {"target": p.split()[::-1]}} for p in self.prompts]

        def reward(self, prompts, generations, metas):
            own = [sum(a == b for a, b in zip(t.split(), m["target"])) / self.length
                   for t, m in zip(generations, metas)]
            extra = self.extra(prompts, generations, metas) if self.extra else [0.0] * len(own)
            return [a + b for a, b in zip(own, extra)]


    class NeedsSize:
        def __init__(self, size):
            self.size = size

        def tokenizer(self): return None
        def examples(self, split="train"): return []
        def reward(self, prompts, generations, metas): return []


    class NoReward:
        def tokenizer(self): return None
        def examples(self, split="train"): return []


    class BadExamples(Reverse):
        def examples(self, split="train"):
            return [{"prompt": 3}]


    class NanReward(Reverse):
        def reward(self, prompts, generations, metas):
            return [math.nan for _ in generations]


    class Explodes:
        def __init__(self):
            raise RuntimeError("no data here")

        def tokenizer(self): return None
        def examples(self, split="train"): return []
        def reward(self, prompts, generations, metas): return []
''')


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """A user's module `my_plugins` in a folder on the path; its name."""
    (tmp_path / "my_plugins.py").write_text(PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_plugins", None)
    yield "my_plugins"
    sys.modules.pop("my_plugins", None)


def env_config(task: dict) -> dict:
    return {"task": task, "max_prompt_len": 4, "max_new_tokens": 3, "tokenizer": None, "dense_reward": False,
            "split": "train", "truncation_side": "left", "encoder_decoder": False}


def test_a_task_class_by_import_path_runs_in_the_env_and_its_reward_scores_the_text(plugins):
    env = TokenGenerationEnv(env_config({"name": f"{plugins}:Reverse", "length": 3}))
    assert env.task.name == "reverse" and env.task.max_new_tokens == 3  # the env's, given to the constructor
    obs, _ = env.reset(seed=0)
    target = env.example["meta"]["target"]
    ids = env.tokenizer.convert_tokens_to_ids(target)
    rewards = []
    for t in ids:
        obs, reward, terminated, truncated, info = env.step(t)
        rewards.append(reward)
    assert terminated and info["generation"] == " ".join(target) and rewards[-1] == 1.0


def test_a_reward_function_by_import_path_is_called_once_per_batch_with_its_fields(plugins):
    reward = make_reward({"name": f"{plugins}:politeness", "word": "w1", "bonus": 2.0})
    assert reward(["p", "p"], ["w1 w2 w1", "w3"], None) == [4.0, 0.0]
    assert sys.modules[plugins].CALLS == [2]


@pytest.mark.parametrize("task, message", [
    ({"name": "no_such_module_xyz:Task"}, r"^task\.name: cannot import module 'no_such_module_xyz' "
                                          r"\(not found on the Python path\)$"),
    ({"name": "{mod}:Missing"}, r"^task\.name: module '{mod}' has no task class 'Missing'$"),
    ({"name": "{mod}:"}, r"^task\.name: expected a known task or 'module:Class', got '{mod}:'$"),
    ({"name": "{mod}:NoReward"}, r"^task\.name: '{mod}:NoReward' is not a task: it has no reward\(\) "),
    ({"name": "{mod}:Reverse", "lenght": 3}, r"^task\.lenght: unknown key for task '{mod}:Reverse' "
                                             r"\(did you mean 'length'\?\)$"),
    ({"name": "{mod}:NeedsSize"}, r"^task\.size: missing \(task '{mod}:NeedsSize' needs it\)$"),
    ({"name": "{mod}:Reverse", "length": 1}, r"^task\.length: expected an integer >= 2$"),
    ({"name": "{mod}:Explodes"}, r"^task '{mod}:Explodes': could not be built: RuntimeError: no data here$"),
    ({"name": "nosuchtask"}, r"^task\.name: unknown task 'nosuchtask' \(known: .*increasing_numbers.*; "
                             r"or your own class as 'module:Class'\)$"),
])
def test_a_bad_task_name_or_field_is_one_line_naming_it(plugins, task, message):
    task = {k: v.format(mod=plugins) if isinstance(v, str) else v for k, v in task.items()}
    with pytest.raises(ValueError, match=message.format(mod=plugins)) as info:
        make_task(task, max_new_tokens=3)
    assert "\n" not in str(info.value)


def test_a_tasks_malformed_examples_and_nan_reward_stop_with_the_task_named(plugins):
    with pytest.raises(ValueError, match=r"^task 'reverse': examples\('train'\)\[0\]: expected "
                                         r"\{'prompt': str, 'meta': dict\}, got \{'prompt': 3\}$"):
        TokenGenerationEnv(env_config({"name": f"{plugins}:BadExamples"}))
    env = TokenGenerationEnv(env_config({"name": f"{plugins}:NanReward"}))
    env.reset(seed=0)
    with pytest.raises(RewardError, match=r"task 'reverse'.*returned nan for generation"):
        for _ in range(3):
            env.step(2)


def test_a_reward_that_cannot_take_the_batch_is_refused_naming_its_signature(plugins):
    with pytest.raises(RewardConfigError, match=r"^task\.reward\.name: '{0}:one_argument' must take \(prompts, "
                                                r"generations, metas\) and its config fields as keyword-only "
                                                r"parameters; it takes \(generations\)$".format(plugins)):
        make_reward({"name": f"{plugins}:one_argument"}, path="task.reward")


@pytest.fixture
def installed(plugins, tmp_path, monkeypatch):
    """An installed distribution (its metadata on the path) registering a reward and a task."""
    dist = tmp_path / "my_plugins_pkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-plugins-pkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        f"[tokenmdp.rewards]\npoliteness = {plugins}:politeness\nbroken = {plugins}:missing_function\n\n"
        f"[tokenmdp.tasks]\nreverse_words = {plugins}:Reverse\n")
    return plugins


def test_rewards_and_tasks_registered_by_an_installed_package_build_by_short_name(installed):
    assert make_reward({"name": "politeness", "word": "w2"})(["p"], ["w2 w2"], None) == [2.0]
    task = make_task({"name": "reverse_words", "length": 2}, max_new_tokens=2)
    assert task.name == "reverse" and len(task.examples("train")) == 50
    with pytest.raises(RewardConfigError, match=r"^reward\.name: the installed reward 'broken' \(my_plugins:"
                                                r"missing_function\) does not load: AttributeError"):
        make_reward({"name": "broken"})
    with pytest.raises(RewardConfigError, match=r"^reward\.name: unknown reward 'politenes' "
                                                r"\(did you mean 'politeness'\?\)$"):
        make_reward({"name": "politenes"})


def test_train_refuses_a_bad_plugin_before_ray_starts_in_one_line(plugins, tmp_path, capsys):
    from agents.train import main

    config = plugin_experiment(tmp_path, "refused")
    err = one_line_cli_error(capsys, main, config, "--set", "task.lenght=3")
    assert err == f"error: task.lenght: unknown key for task '{plugins}:Reverse' (did you mean 'length'?)"
    cfg = yaml.safe_load(open(config))
    cfg["task"] = {"name": f"{plugins}:NoReward"}
    (tmp_path / "no_reward.yaml").write_text(yaml.safe_dump(cfg))
    err = one_line_cli_error(capsys, main, str(tmp_path / "no_reward.yaml"))
    assert err.startswith(f"error: task.name: '{plugins}:NoReward' is not a task: it has no reward()")


def test_the_command_lists_its_subcommands_and_refuses_an_unknown_one(capsys):
    from agents.cli import COMMANDS, main

    assert main([]) == 2
    listed = capsys.readouterr().err
    assert all(f"\n  {name} " in listed for name in COMMANDS)
    assert main(["trian"]) == 2
    assert capsys.readouterr().err.strip() == "tokenmdp: error: unknown command 'trian' (did you mean 'train'?)"
    with pytest.raises(SystemExit) as info:
        main(["export", "--help"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("usage: tokenmdp export")


def plugin_experiment(folder, name: str) -> str:
    """A quickstart-shaped experiment in `folder`: the user's Reverse task plus their `politeness`
    reward (how many words are `w0`: the sum stays a multiple of 1/3)."""
    cfg = yaml.safe_load(open(QUICKSTART))
    cfg["task"] = {"name": "my_plugins:Reverse", "length": 3,
                   "reward": {"name": "my_plugins:politeness", "word": "w0", "bonus": 1.0}}
    cfg["env"] = {"max_prompt_len": 4, "max_new_tokens": 3}
    cfg["training"].update(train_batch_size=512, minibatch_size=128, lr=2.0e-3)
    cfg["stop"] = {"training_iteration": 3}
    cfg["checkpoint"] = {"frequency": 0, "at_end": True}
    cfg["tune"] = {"name": name, "storage_path": str(folder / "results"), "dashboard": False}
    cfg["generate"] = {"num_samples": 1}
    path = folder / "plugins.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def command_path() -> str:
    """The installed `tokenmdp` script next to this interpreter."""
    script = os.path.join(os.path.dirname(sys.executable), "tokenmdp")
    if not os.path.exists(script):
        pytest.skip("the package is not installed in this interpreter's environment (pip install -e .)")
    return script


@pytest.mark.slow
def test_a_users_own_task_trains_through_the_installed_command_from_its_folder(tmp_path):
    """`tokenmdp train` run in a folder holding the user's module: the driver and Tune's trial
    (another process, another working directory) both import it."""
    (tmp_path / "my_plugins.py").write_text(PLUGINS)
    config = plugin_experiment(tmp_path, "cli")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    run = subprocess.run([command_path(), "train", config], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert "Training PPO on task 'my_plugins:Reverse'" in run.stdout
    assert "Summary (1 trial" in run.stdout and "iteration 3" in run.stdout
    assert list((tmp_path / "results" / "cli").glob("*/checkpoint_000000"))
    rewards = [float(line.split("[reward ")[1].split("]")[0]) for line in run.stdout.splitlines() if "[reward " in line]
    assert rewards and all(abs(r * 3 - round(r * 3)) < 0.01 for r in rewards)  # the task's thirds, printed to 3 places
