import json
import os

import pytest
import torch

from agents.config import ConfigError, algorithm_config, load, to_tune, validate
from tests.conftest import QUICKSTART, ROOT, one_line_cli_error
from tests.conftest import run_module as run_cli


def test_quickstart_config_is_valid_and_builds_an_rllib_config():
    cfg = load(QUICKSTART)
    assert cfg["training"]["lr"] == pytest.approx(1e-3)
    algo = algorithm_config(cfg)
    assert algo.num_envs_per_env_runner == 64
    assert algo.ref_kl_coef == cfg["reward"]["kl_coef"]


@pytest.mark.parametrize(
    "raw,message",
    [
        ({"training": {"lrr": 0.1}}, "training.lrr: unknown key (did you mean 'lr'?)"),
        ({"trainng": {}}, "trainng: unknown key (did you mean 'training'?)"),
        ({"training": {"lr": "fast"}}, "training.lr: expected a number > 0.0, got 'fast'"),
        ({"training": {"lr": -1}}, "training.lr: expected a number > 0.0, got -1"),
        ({"training": {"num_epochs": 2.5}}, "training.num_epochs: expected an integer >= 1, got 2.5"),
        ({"training": {"gamma": 1.5}}, "training.gamma: expected a number in [0.0, 1.0], got 1.5"),
        ({"env": {"truncation_side": "middle"}}, "env.truncation_side: expected one of 'left', 'right', got 'middle'"),
        ({"training": {"minibatch_size": 4096, "train_batch_size": 2048}}, "training.minibatch_size: 4096 is larger than training.train_batch_size=2048"),
        ({"reward": {"kl_adaptive": True}}, "reward.kl_adaptive: needs reward.kl_coef > 0"),
        ({"algorithm": "sac"}, "algorithm: expected one of 'ppo', 'a3c', 'dqn', 'ppo_pp', 'aggrevated', 'lols', 'dlols', 'reinforce', "
                                  "'self_critical', got 'sac'"),
        ({"env": {"max_new_tokens": {"grid_search": [10, 20]}}}, "env.max_new_tokens: search spaces are supported"),
        ({"training": {"lr": {"loguniform": [1e-3, 1e-5]}}}, "training.lr.loguniform: expected [low, high]: two numbers, low < high"),
        ({"training": {"lr": {"uniform": ["a", 1]}}}, "training.lr.uniform: expected [low, high]: two numbers, low < high; got ['a', 1]"),
        ({"stop": {"training_iteration": 2}, "tune": {"scheduler": "asha"}},
         "tune.grace_period: 10 is more than stop.training_iteration (2); ASHA's first rung must come before"),
        ({"training": {"lr": {"grid_search": [1e-3, -1]}}}, "training.lr: expected a number > 0.0, got -1"),
        ({"sampler": {"name": "nucleus"}}, "sampler.name: expected one of 'none', 'top_k', 'top_p'"),
        ({"sampler": {"name": "top_p", "p": 1.5}}, "sampler.p: expected a number in (0.0, 1.0], got 1.5"),
        ({"sampler": {"name": "top_p", "p": 0}}, "sampler.p: expected a number in (0.0, 1.0], got 0"),
        ({"sampler": {"name": "top_p"}}, "sampler.p: the 'top_p' sampler needs it"),
        ({"sampler": {"name": "epsilon", "epsilon": -1e-4}}, "sampler.epsilon: expected a number in (0.0, 1.0], got -0.0001"),
        ({"sampler": {"name": "epsilon", "epsilon": 1}}, "sampler.epsilon: expected a number in (0, 1), got 1.0"),
        ({"sampler": {"name": "eta", "p": 0.9}}, "sampler.p: not a parameter of the 'eta' sampler (it takes eta)"),
        ({"sampler": {"name": "typical", "p": 1.0}}, "sampler.p: typical sampling needs p < 1, got 1.0"),
        ({"sampler": {"name": "mirostat"}}, "sampler.tau: the 'mirostat' sampler needs it"),
        ({"sampler": {"name": "top_k", "k": 0}}, "sampler.k: expected an integer >= 1, got 0"),
        ({"sampler": {"name": "top_p", "p": 0.9, "masking": "delayed"}}, "sampler.masking: expected one of 'current', 'learned'"),
        ({"sampler": {"grid_search": [{"name": "top_p", "p": 0.9}, {"name": "eta"}]}}, "sampler[1].eta: the 'eta' sampler needs it"),
        ({"sampler": {"uniform": [0, 1]}}, "sampler.uniform: a whole section can only be searched with grid_search or choice"),
        ({"sampler": {"name": "top_p", "p": {"grid_search": [0.9, 2]}}}, "sampler.p: expected a number in (0.0, 1.0], got 2"),
        ({"model": {"overrides": {"n_layer": -1}}}, "model.overrides.n_layer: expected an integer >= 1, got -1"),
        ({"model": {"overrides": {"n_layers": 3}}}, "model.overrides.n_layers: not a field of GPT2Config"),
        ({"model": {"overrides": {"n_head": 5}}}, "model.overrides: n_embd (64) must be a multiple of n_head (5)"),
        ({"model": {"name_or_path": "tiny-t5", "overrides": {"d_model": 0}}}, "model.overrides.d_model: expected an integer >= 1"),
        ({"model": {"overrides": {"n_positions": 16}}}, "model.overrides.n_positions: set from the tokenizer and the env's"),
        ({"model": {"overrides": {"activation_function": "foo"}}}, "model.overrides.activation_function: unknown activation 'foo' (one of "),
        ({"model": {"overrides": {"resid_pdrop": 2}}}, "model.overrides.resid_pdrop: expected a probability in [0, 1], got 2"),
        ({"model": {"overrides": {"layer_norm_epsilon": -1}}}, "model.overrides.layer_norm_epsilon: expected a number > 0, got -1"),
        ({"model": {"overrides": {"layer_norm_epsilon": "tiny"}}}, "model.overrides.layer_norm_epsilon: expected a number, got 'tiny'"),
        ({"model": {"overrides": {"scale_attn_weights": "yes"}}}, "model.overrides.scale_attn_weights: expected true or false"),
        ({"model": {"overrides": {"n_inner": "x"}}}, "model.overrides: the model does not build with them: "),
        ({"model": {"name_or_path": "tiny-t5", "overrides": {"feed_forward_proj": "banana"}}},
         "model.overrides: the model does not build with them: "),
    ],
)
def test_bad_values_name_the_field(raw, message):
    with pytest.raises(ConfigError) as e:
        validate(raw)
    assert str(e.value).startswith(message)
    assert "\n" not in str(e.value)


def test_sampler_search_spaces_over_whole_samplers_and_over_parameters():
    from ray import tune

    cfg = validate({"sampler": {"grid_search": [{"name": "none"}, {"name": "top_p", "p": 0.9, "masking": "learned"}]}})
    candidates = to_tune(cfg)["sampler"]
    assert candidates == tune.grid_search([cfg["sampler"]["grid_search"][0], cfg["sampler"]["grid_search"][1]])
    assert candidates["grid_search"][1]["sync_every"] == 100  # defaults filled in per candidate
    cfg = validate({"sampler": {"name": "eta", "eta": {"grid_search": [0.004, 0.0003]}}})
    assert to_tune(cfg)["sampler"]["eta"] == tune.grid_search([0.004, 0.0003])


def test_numbers_written_without_a_dot_are_numbers():
    assert validate({"training": {"lr": "1e-3"}})["training"]["lr"] == pytest.approx(1e-3)
    # a float field of a built-in shape's config too (YAML 1.1 reads 1e-5 as a string)
    assert validate({"model": {"overrides": {"layer_norm_epsilon": "1e-5"}}})["model"]["overrides"] == {"layer_norm_epsilon": 1e-5}


def test_overrides_and_search_spaces(tmp_path):
    cfg = load(QUICKSTART, ["training.lr=3e-4", "training.num_epochs=2", "tune.name=x"])
    assert cfg["training"]["lr"] == pytest.approx(3e-4) and cfg["training"]["num_epochs"] == 2
    from ray import tune

    space = to_tune(validate({"training": {"lr": {"grid_search": [1e-3, 1e-4]}, "entropy_coeff": {"uniform": [0, 0.1]}}}))
    assert space["training"]["lr"] == tune.grid_search([1e-3, 1e-4])
    assert isinstance(space["training"]["entropy_coeff"], tune.search.sample.Float)
    with pytest.raises(ConfigError, match="expected key=value"):
        load(QUICKSTART, ["training.lr"])


@pytest.mark.parametrize(
    "yaml_text,expected",
    [
        ("training:\n  lr: -0.5\n", "error: training.lr: expected a number > 0.0, got -0.5"),
        ("model:\n  name_or_path: ./no/such/dir\n", "error: model.name_or_path: no such directory './no/such/dir'"),
        ("task:\n  name: imdbb\n", "error: task.name: unknown task 'imdbb'"),
        ("training: [1, 2\n", "not valid YAML"),
        ("sampler:\n  name: eta\n  eta: -3.0e-4\n", "error: sampler.eta: expected a number in (0.0, 1.0], got -0.0003"),
        ("sampler:\n  name: nucleus\n", "error: sampler.name: expected one of"),
    ],
)
def test_cli_rejects_bad_config_with_one_line_and_no_traceback(tmp_path, capsys, yaml_text, expected):
    # The CLI's main in-process (the config is refused before Ray starts); a real process runs below.
    from agents.train import main

    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    assert main([str(path)]) == 2
    out = capsys.readouterr()
    assert expected in out.err
    assert "Traceback" not in out.err + out.out
    assert len(out.err.strip().splitlines()) == 1


def test_cli_rejects_missing_file_and_bad_override():
    out = run_cli("agents.train", "nope.yaml")
    assert out.returncode == 2 and out.stderr.strip() == "error: nope.yaml: no such config file"
    out = run_cli("agents.train", QUICKSTART, "--set", "training.clip_param=0")
    assert out.returncode == 2 and "training.clip_param: expected a number > 0.0, got 0" in out.stderr


def test_a_config_that_is_not_a_readable_yaml_mapping_is_refused_in_one_line(tmp_path, capsys):
    from agents.train import main

    not_utf8 = tmp_path / "latin1.yaml"
    not_utf8.write_bytes(b"\xff\xfe bad: 1\n")
    assert one_line_cli_error(capsys, main, str(not_utf8)) == f"error: {not_utf8}: not UTF-8 text (byte 0); a config is a YAML file"
    assert one_line_cli_error(capsys, main, str(tmp_path)) == f"error: {tmp_path}: a directory, not a config file"
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    for argv in ([], ["--set", "training.lr=1"]):  # --set needs sections to write into
        assert one_line_cli_error(capsys, main, str(listed), *argv).startswith(
            f"error: {listed}: the YAML file must hold a mapping at the top level")
    # a storage path under a file cannot become a directory: refused before Ray starts
    assert one_line_cli_error(capsys, main, QUICKSTART, "--set", f"tune.storage_path={listed}/runs") == (
        f"error: tune.storage_path: {listed} is a file, so {listed}/runs cannot be a directory")
    # a directory that cannot be made (a virtual file system here), and a seed RLlib cannot take
    assert one_line_cli_error(capsys, main, QUICKSTART, "--set", "tune.storage_path=/proc/runs") == (
        "error: tune.storage_path: cannot write the run's results in /proc/runs (No such file or directory)")
    assert one_line_cli_error(capsys, main, QUICKSTART, "--set", "seed=4294967296") == (
        "error: seed: expected an integer in [0, 2147483647], got 4294967296")
    # a URI would become a local folder named s3: (Tune's copies here are to a file system), with
    # --resume too
    for argv in ([], ["--resume", "--set", "tune.name=run"]):
        assert one_line_cli_error(capsys, main, QUICKSTART, "--set", "tune.storage_path=s3://bucket/runs", *argv) == (
            "error: tune.storage_path: s3://bucket/runs is a URI; give a directory (on a cluster, one on a file "
            "system every node mounts)")
    # an experiment name that would leave the storage path
    assert one_line_cli_error(capsys, main, QUICKSTART, "--set", f"tune.storage_path={tmp_path / 'runs'}",
                              "--set", "tune.name=../../elsewhere") == (
        "error: tune.name: the experiment's directory name inside tune.storage_path (no '/', not '.' or '..'), "
        "got '../../elsewhere'")


def test_lora_modules_the_model_lacks_are_refused_before_ray_starts(capsys):
    from agents.train import main

    assert one_line_cli_error(capsys, main, QUICKSTART, "--set", "model.lora={target_modules: [nosuchmod]}") == (
        "error: model.lora.target_modules: Target modules {'nosuchmod'} not found in the base model. "
        "Please check the target modules and try again.")
    assert one_line_cli_error(capsys, main, QUICKSTART, "--set", "model.lora={modules_to_save: [nosuch]}") == (
        "error: model.lora.modules_to_save: the model has no module named 'nosuch'")
    # a valid LoRA section passes the same check (on the meta device: no weights made)
    from agents.config import env_config
    from agents.models import check_lora
    from env.text_env import TokenGenerationEnv

    cfg = load(QUICKSTART, ["model.lora={r: 4}", "model.overrides={initializer_range: 0.1}"])
    check_lora(cfg["model"], TokenGenerationEnv(env_config(cfg)).tokenizer)


def test_a_truncated_checkpoint_is_refused_in_one_line_naming_it(tmp_path, capsys):
    from agents.config import algorithm_config, load
    from agents.export import main as export
    from agents.generate import main as generate
    from agents.saved_policy import MODULE_SUBDIR
    from env.text_env import TokenGenerationEnv

    algo_config = algorithm_config(load(QUICKSTART, []))
    module = algo_config.get_rl_module_spec(env=TokenGenerationEnv(algo_config.env_config)).build()
    where = tmp_path / "ckpt" / MODULE_SUBDIR
    module.save_to_path(str(where))
    state = where / "module_state.pkl"
    state.write_bytes(state.read_bytes()[:100])  # a copy cut short
    capsys.readouterr()  # RLlib's warning on building a module (logged once per process)
    want = f"error: --checkpoint: the policy in {where} cannot be loaded (UnpicklingError: pickle data was truncated)"
    assert one_line_cli_error(capsys, generate, "--checkpoint", str(tmp_path / "ckpt")) == want
    assert one_line_cli_error(capsys, export, "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")) == want
    assert not (tmp_path / "out").exists()
    # evaluate takes the checkpoint as its positional MODEL: the same line without "--checkpoint:"
    from agents.evaluate import main as evaluate

    assert one_line_cli_error(capsys, evaluate, str(tmp_path / "ckpt"), "--out", str(tmp_path / "eval")) == \
        want.replace("--checkpoint: ", "")
    assert not (tmp_path / "eval").exists()


def test_generate_refuses_prompt_words_outside_the_vocabulary_naming_the_prompt(tmp_path, capsys):
    """A word-level task encodes an unknown word as EOS: the prompt would silently end there."""
    from agents.config import algorithm_config, load
    from agents.generate import main as generate
    from agents.saved_policy import MODULE_SUBDIR
    from env.text_env import TokenGenerationEnv

    algo_config = algorithm_config(load(QUICKSTART, []))
    env = TokenGenerationEnv(algo_config.env_config)
    module = algo_config.get_rl_module_spec(env=env).build()
    module.save_to_path(str(tmp_path / MODULE_SUBDIR))
    capsys.readouterr()  # RLlib's warning on building a module (logged once per process)
    known = env.tokenizer.convert_ids_to_tokens(4)
    ckpt = ["--checkpoint", str(tmp_path), "-n", "1"]
    assert one_line_cli_error(capsys, generate, *ckpt, "--prompt", f"{known} zebra") == \
        f"error: --prompt '{known} zebra': 'zebra' is not in the task's vocabulary"
    assert one_line_cli_error(capsys, generate, *ckpt, "--prompt", known, "--prompt", "  ") == \
        "error: --prompt #2 ('  '): empty after tokenization"
    assert one_line_cli_error(capsys, generate, *ckpt, "--seed", "-1") == \
        "error: --seed: expected an integer in [0, 2147483647], got -1"
    assert one_line_cli_error(capsys, generate, *ckpt, "--device", "tpu") == \
        "error: --device: expected cpu or cuda[:N], got 'tpu'"
    if not torch.cuda.is_available():
        assert one_line_cli_error(capsys, generate, *ckpt, "--device", "cuda") == \
            "error: --device cuda: torch sees no CUDA device here"
    assert generate([*ckpt, "--prompt", known, "--device", "cpu"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and f"] {known}||" in out[0], out
    assert one_line_cli_error(capsys, generate, *ckpt, "--precision", "fp16") == \
        "error: --precision: expected one of fp32, bf16, got 'fp16'"
    assert generate([*ckpt, "--prompt", known, "--precision", "bf16"]) == 0  # decodes in bf16 on the CPU too
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and f"] {known}||" in out[0], out
    if torch.cuda.is_available():  # the same text decoded on the GPU (greedy: no draw to differ)
        assert generate([*ckpt, "--prompt", known, "--greedy"]) == 0
        on_cpu = capsys.readouterr().out
        assert generate([*ckpt, "--prompt", known, "--greedy", "--device", "cuda"]) == 0
        assert capsys.readouterr().out == on_cpu
        assert generate([*ckpt, "--prompt", known, "--device", "cuda", "--precision", "bf16"]) == 0
        out = capsys.readouterr().out.strip().splitlines()
        assert len(out) == 1 and f"] {known}||" in out[0], out
    assert generate([*ckpt, "--prompt", known]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and f"] {known}||" in out[0], out


def test_generate_rejects_a_path_without_a_policy(tmp_path, capsys):
    from agents.generate import main

    assert main(["--checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds no policy" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    # an experiment directory: its newest checkpoint is named
    import time

    from agents.saved_policy import MODULE_SUBDIR

    for n in (5, 10):
        policy = tmp_path / "exp" / "trial_0" / f"checkpoint_{n:06d}" / MODULE_SUBDIR
        policy.mkdir(parents=True)
        (policy / "module_state.pt").write_bytes(b"")
        time.sleep(0.01)
    assert one_line_cli_error(capsys, main, "--checkpoint", str(tmp_path / "exp")) == (
        f"error: --checkpoint: {tmp_path / 'exp'} is a run directory, not a checkpoint; its newest checkpoint is "
        f"{tmp_path / 'exp' / 'trial_0' / 'checkpoint_000010'} (and 1 older)")
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(tmp_path), "-n", "1001"])
    assert "-n: expected an integer in [1, 1000]" in capsys.readouterr().err


def test_a_time_or_step_budget_is_not_cut_at_the_default_100_iterations():
    assert validate({})["stop"]["training_iteration"] == 100  # nothing given: the default cap
    assert validate({"stop": {"time_total_s": 3600}})["stop"]["training_iteration"] is None
    assert validate({"stop": {"num_env_steps_sampled_lifetime": 10**6}})["stop"]["training_iteration"] is None
    # A reward target alone could run forever: the cap stays; an explicit one is kept.
    assert validate({"stop": {"episode_return_mean": 0.9}})["stop"]["training_iteration"] == 100
    assert validate({"stop": {"time_total_s": 60, "training_iteration": 7}})["stop"]["training_iteration"] == 7
    with pytest.raises(ConfigError, match="guide.switch_fraction: DLOLS takes it of stop.training_iteration"):
        validate({"algorithm": "dlols", "stop": {"time_total_s": 60},
                  "guide": {"callable": "agents.guides:noisy_increasing_numbers"}})


@pytest.mark.parametrize("algorithm, key, value", [
    ("a3c", "clip_param", 0.1), ("a3c", "num_epochs", 2), ("reinforce", "lambda", 0.9),
    ("self_critical", "vf_loss_coeff", 0.5), ("dqn", "entropy_coeff", 0.01)])
def test_training_keys_an_algorithm_does_not_read_are_refused_in_one_line(algorithm, key, value):
    with pytest.raises(ConfigError) as err:
        validate({"algorithm": algorithm, "training": {key: value}})
    assert str(err.value).startswith(f"training.{key}: not used by algorithm {algorithm!r} (it reads ")
    assert "\n" not in str(err.value)


def test_config_class_defaults_are_the_schema_defaults():
    """The algorithms' typed hyperparameters default to what the YAML schema documents."""
    from agents.algorithms.dqn import LMDQNConfig
    from agents.algorithms.guided import GuidedPPOConfig
    from agents.algorithms.ppo import LMPPOConfig
    from agents.algorithms.reinforce import ReinforceConfig

    cfg = validate({"algorithm": "reinforce"})
    ppo, rw, t = LMPPOConfig(), cfg["reward"], cfg["training"]
    assert (ppo.ref_kl_coef, ppo.ref_kl_adaptive, ppo.ref_kl_target, ppo.ref_kl_horizon) == (
        rw["kl_coef"], rw["kl_adaptive"], rw["kl_target"], rw["kl_horizon"])
    assert (ppo.mle_coef, ppo.mle_batch_size) == (t["mle_coef"], t["mle_batch_size"])
    assert LMDQNConfig().ref_kl_coef == rw["kl_coef"]
    assert ReinforceConfig().num_samples == cfg["reinforce"]["num_samples"]
    assert GuidedPPOConfig().lols_prob == validate({"algorithm": "lols", "guide": {"callable": "a:b"}})["guide"]["lols_prob"]


TOY_ALGORITHM = '''
from agents.algorithms.ppo import LMPPOConfig, PPOSpec
from env.validation import Field


class ToyConfig(LMPPOConfig):
    pass


class ToySpec(PPOSpec):
    names = ("toy",)
    training_keys = ("minibatch_size", "num_epochs", "entropy_coeff")
    section = "toy"
    schema = {"temperature": Field(float, 1.0, lo=0.0, lo_open=True)}

    def config_class(self):
        return ToyConfig

    def training(self, cfg, c):
        return {**super().training(cfg, c), "entropy_coeff": c["toy"]["temperature"] * c["training"]["entropy_coeff"]}


SPEC = ToySpec()
'''


def test_a_new_algorithm_is_its_module_plus_one_registration_line(tmp_path, monkeypatch):
    import agents.algorithms as registry
    import agents.schema as config_module

    (tmp_path / "toy_algorithm.py").write_text(TOY_ALGORITHM)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "MODULES", registry.MODULES + ("toy_algorithm",))  # the one line
    monkeypatch.setattr(registry, "_SPECS", {})
    monkeypatch.setattr(config_module, "_SCHEMA", {})

    cfg = validate({"algorithm": "toy", "toy": {"temperature": 2.0}, "training": {"entropy_coeff": 0.01}})
    algo = algorithm_config(cfg)
    assert type(algo).__name__ == "ToyConfig" and algo.entropy_coeff == pytest.approx(0.02)
    with pytest.raises(ConfigError, match=r"^toy\.temperature: expected a number > 0"):
        validate({"algorithm": "toy", "toy": {"temperature": 0}})
    with pytest.raises(ConfigError, match=r"^toy: only used by algorithm toy \(this config's algorithm is 'ppo'\)"):
        validate({"algorithm": "ppo", "toy": {"temperature": 2.0}})
    with pytest.raises(ConfigError, match=r"^training\.clip_param: not used by algorithm 'toy'"):
        validate({"algorithm": "toy", "training": {"clip_param": 0.1}})


def test_relative_data_paths_reach_tune_trials_as_absolute_paths(tmp_path, monkeypatch):
    """Tune trials run in their own directory: a task's local data files go absolute."""
    (tmp_path / "data").mkdir()
    for split in ("train", "validation"):
        (tmp_path / "data" / f"{split}.jsonl").write_text('{"prompt": "a", "reference": "b"}\n')
    monkeypatch.chdir(tmp_path)
    raw = {"task": {"name": "text", "dataset": {"train": "data/train.jsonl", "validation": "data/validation.jsonl"},
                    "prompt_field": "prompt", "reward": {"name": "bleu"}, "reference_field": "reference"}}
    algo = algorithm_config(validate(raw))
    assert algo.env_config["task"]["dataset"] == {"train": str(tmp_path / "data" / "train.jsonl"),
                                                  "validation": str(tmp_path / "data" / "validation.jsonl")}
    single = algorithm_config(validate({"task": {**raw["task"], "dataset": "data/train.jsonl"}}))
    assert single.env_config["task"]["dataset"] == str(tmp_path / "data" / "train.jsonl")
    # a reward's model directories (a sum's terms too) and the tokenizer: absolute where they exist here
    for name in ("fwd", "bwd", "tok"):
        (tmp_path / name).mkdir()
    reward = {"sum": [{"name": "bleu", "weight": 1.0},
                      {"name": "mmi", "weight": 0.1, "forward_model": "fwd", "backward_model": "bwd"}]}
    from agents.config import with_absolute_paths

    cfg = with_absolute_paths(validate({"task": {**raw["task"], "reward": reward}, "env": {"tokenizer": "tok"}}))
    assert cfg["task"]["reward"]["sum"][1] == {"name": "mmi", "weight": 0.1, "forward_model": str(tmp_path / "fwd"),
                                               "backward_model": str(tmp_path / "bwd")}
    assert cfg["task"]["reward"]["sum"][0] == {"name": "bleu", "weight": 1.0}
    assert cfg["env"]["tokenizer"] == str(tmp_path / "tok")


def test_a_search_over_algorithms_stays_within_a_family_that_supports_it():
    spec_cfg = validate({"algorithm": {"grid_search": ["ppo", "ppo_pp"]}, "guide": {"callable": "a:b"}})
    assert algorithm_config(spec_cfg).guided_algorithm == {"grid_search": ["ppo", "ppo_pp"]}
    # reinforce and self_critical need different env set-ups (repeated prompts), so no search mixes them
    with pytest.raises(ConfigError, match=r"^algorithm: a search over algorithms may list the algorithms of one family"):
        validate({"algorithm": {"grid_search": ["reinforce", "self_critical"]}})


def test_an_empty_config_and_a_model_directory_that_is_not_there_are_refused_in_one_line(tmp_path, capsys):
    from agents.train import main

    empty = tmp_path / "empty.yaml"
    empty.write_text("# an experiment, some day\n\n")
    assert one_line_cli_error(capsys, main, str(empty)) == (
        f"error: {empty}: the file is empty (or only comments); write the experiment in it, "
        "e.g. starting from tune_configs/quickstart.yaml")
    for path in ("results/no_such_run/warm_start", "./warm_start_nowhere", str(tmp_path / "gone")):
        assert one_line_cli_error(capsys, main, QUICKSTART, "--set", f"model.name_or_path={path}") == (
            f"error: model.name_or_path: no such directory {path!r}")
    assert one_line_cli_error(capsys, main, QUICKSTART, "--set", f"env.tokenizer={tmp_path}/tok/") == (
        f"error: env.tokenizer: no such directory '{tmp_path}/tok/'")
    err = one_line_cli_error(capsys, main, QUICKSTART, "--set", "model.name_or_path=nobody/no-such-model")
    assert err.startswith("error: model.name_or_path: cannot load 'nobody/no-such-model': not a local directory; ")
    # a checkpoint or run directory of agents.train where a model goes: export names the way
    from agents.pretrain import main as pretrain
    from tests.conftest import run_directory

    run, checkpoint = run_directory(tmp_path)
    for path, what, newest in ((checkpoint, "a checkpoint", checkpoint), (run, "a run directory", checkpoint)):
        for command, config in ((main, QUICKSTART), (pretrain, "tune_configs/pretrain_reviews.yaml")):
            assert one_line_cli_error(capsys, command, config, "--set", f"model.name_or_path={path}") == (
                f"error: model.name_or_path: {path} is {what} of agents.train, not a model directory; write its policy "
                f"out as one with `tokenmdp export --checkpoint {newest} --out DIR`")


def test_a_hyperparameter_added_to_an_algorithm_spec_in_one_place_is_validated_defaulted_and_reaches_rllib(
        monkeypatch):
    """One `Param` added to the token learners' table (agents/algorithms/token_learner.py) and
    nothing else: the YAML refuses a bad value naming it, fills its default, and RLlib's config
    carries the value given, under its RLlib name; an algorithm that does not read it refuses it."""
    import agents.schema
    from agents.algorithms import token_learner
    from agents.algorithms.base import Param
    from env.validation import Field

    monkeypatch.setitem(token_learner.TOKEN_TRAINING, "ratio_floor", Param(Field(float, 0.25, lo=0.0), "ratio_floor_"))
    monkeypatch.setattr(agents.schema, "_SCHEMA", {})
    with pytest.raises(ConfigError, match=r"^training\.ratio_floor: expected a number >= 0\.0, got -1\.0"):
        validate({"training": {"ratio_floor": -1.0}})
    assert validate({})["training"]["ratio_floor"] == 0.25
    assert algorithm_config(validate({})).ratio_floor_ == 0.25
    assert algorithm_config(validate({"training": {"ratio_floor": 0.5}})).ratio_floor_ == 0.5
    assert token_learner.TokenLearnerConfig().ratio_floor_ == 0.25  # RLlib's config default, from the same Param
    with pytest.raises(ConfigError, match=r"^training\.ratio_floor: not used by algorithm 'a3c'"):
        validate({"algorithm": "a3c", "training": {"ratio_floor": 0.5}})


def test_a_tune_metric_the_results_lack_stops_the_run_in_one_line_with_a_hint(tmp_path, capsys):
    """Nothing could rank the trials: the run stops at the first result, not at its end."""
    from agents.train import main

    code = main([QUICKSTART, "--set", f"tune.storage_path={tmp_path}", "--set", "generate.num_samples=0",
                 "--set", "training.train_batch_size=256", "--set", "training.minibatch_size=256",
                 "--set", "tune.metric=env_runners/episode_retrun_mean"])
    out = capsys.readouterr()
    assert code == 2, out.err[-3000:]
    assert out.err.strip().splitlines()[-1] == (
        "error: tune.metric: 'env_runners/episode_retrun_mean' is not a number in the trials' results, so nothing "
        "ranks the trials (did you mean 'env_runners/episode_return_mean'?)")
    assert "Traceback" not in out.err and "iter " not in out.out  # stopped before printing iteration 1


def test_the_tune_metric_check_waits_for_a_full_result_the_first_evaluation_and_the_first_update():
    from agents.progress import MetricNotReported, metric_error, unreported_metric

    full = {"env_runners": {"episode_return_mean": 0.5, "episode_len_mean": 19.0}, "training_iteration": 1}
    assert unreported_metric("env_runners/episode_len_mean", full) is None
    assert unreported_metric("training_iteration", full) is None
    # an iteration that ended before any episode did: nothing to judge yet
    assert unreported_metric("env_runners/nope", {"env_runners": {}, "training_iteration": 1}) is None
    # an evaluation metric waits for the first evaluation; then it must be there
    assert unreported_metric("evaluation/env_runners/episode_return_mean", full) is None
    evaluated = {**full, "evaluation": {"env_runners": {"episode_return_mean": 0.7}}}
    assert unreported_metric("evaluation/env_runners/episode_return_mean", evaluated) is None
    assert "did you mean 'evaluation/env_runners/episode_return_mean'" in unreported_metric(
        "evaluation/env_runners/episode_return", evaluated)
    # DQN's learner reports nothing before dqn.learning_starts: a learner metric waits for it
    assert unreported_metric("learners/default_policy/qf_mean", {**full, "learners": {}}) is None
    updated = {**full, "learners": {"default_policy": {"qf_mean": 0.1}}}
    assert unreported_metric("learners/default_policy/qf_mean", updated) is None
    assert "did you mean 'learners/default_policy/qf_mean'" in unreported_metric("learners/default_policy/q_mean", updated)
    assert "did you mean 'env_runners/episode_return_mean'" in unreported_metric("env_runner/episode_return_mean", full)
    assert unreported_metric("env_runners", full).startswith("tune.metric: 'env_runners' is not a number")
    # Tune wraps the callback's error; its own check for a scheduler's metric reads the same way
    try:
        try:
            raise MetricNotReported("tune.metric: x")
        except MetricNotReported:
            raise RuntimeError("wrapped")
    except RuntimeError as e:
        assert str(metric_error(e, "x")) == "tune.metric: x"
    tune_says = ValueError("Trial returned a result which did not include the specified metric(s) `env_runners/rew` "
                           "that `AsyncHyperBandScheduler` expects. ... Result: {'env_runners/episode_return_mean': 0.4}")
    assert str(metric_error(tune_says, "env_runners/rew")).endswith("(did you mean 'env_runners/episode_return_mean'?)")
    assert metric_error(RuntimeError("another failure"), "x") is None


def test_a_saved_model_the_episodes_do_not_fit_is_refused_before_ray(tmp_path, capsys):
    import os
    import shutil

    """Its vocabulary, its positions, its config and its weights' header, each in one line."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from agents.train import main

    def saved(name, **config):
        path = tmp_path / name
        GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, **config)).save_pretrained(path)
        return path

    fits = saved("fits", vocab_size=52, n_positions=32)  # the quickstart: 52 tokens, 5 + 20 positions
    padded = saved("padded", vocab_size=64, n_positions=32)  # more outputs than tokens (T5's are padded)
    narrow, short = saved("narrow", vocab_size=40, n_positions=32), saved("short", vocab_size=52, n_positions=16)
    other = saved("other", vocab_size=59, n_positions=32)  # trained with another tokenizer, saved beside it
    from tests.test_tasks import save_tokenizer

    other_tokenizer = save_tokenizer(tmp_path / "tok", ["a b c d e f g"])
    for f in os.listdir(other_tokenizer):
        shutil.copy(os.path.join(other_tokenizer, f), other / f)
    cut = saved("cut", vocab_size=52, n_positions=32)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    (tmp_path / "noconfig").mkdir()
    capsys.readouterr()  # the saves' progress bars
    run = lambda model: one_line_cli_error(capsys, main, QUICKSTART, "--set", f"model.name_or_path={model}",  # noqa: E731
                                           "--set", f"tune.storage_path={tmp_path / 'runs'}")
    assert run(narrow) == (f"error: model.name_or_path: '{narrow}' has 40 output tokens but the env's tokenizer "
                           "(env.tokenizer, else the task's or the model's own) has 52")
    assert run(other).startswith(f"error: model.name_or_path: '{other}' was saved with a ")
    assert run(other).endswith("-token tokenizer, but the env's (env.tokenizer, else the task's) has 52: "
                               "its outputs would mean other tokens")
    assert run(short) == f"error: env.max_prompt_len + env.max_new_tokens: 25 tokens, more than the 16 positions of '{short}'"
    assert run(cut).startswith(f"error: model.name_or_path: cannot read {weights}: ")
    assert run(tmp_path / "noconfig").startswith(f"error: model.name_or_path: cannot load '{tmp_path / 'noconfig'}''s config")
    from agents.config import load
    from agents.train import check_model_fits
    from env.text_env import TokenGenerationEnv
    from agents.config import env_config

    env = TokenGenerationEnv(env_config(load(QUICKSTART, [])))
    check_model_fits(str(fits), env)  # these pass
    check_model_fits(str(padded), env)


def test_resume_refuses_a_config_that_differs_from_the_runs_own(tmp_path, capsys):
    """Tune resumes a run with the settings it started with: a changed config would be ignored
    silently, so it is refused in one line naming what changed (what the resuming process applies
    itself, such as the closing samples, may change)."""
    from agents.resume import experiment_dir, resume_differences, save_run_config
    from agents.train import main

    sets = ["tune.name=r", f"tune.storage_path={tmp_path}"]
    cfg = load(QUICKSTART, sets)
    assert resume_differences(cfg) == []  # an experiment from before run_config.json: nothing to compare
    save_run_config(cfg, experiment_dir(cfg))
    assert resume_differences(load(QUICKSTART, sets)) == []
    assert resume_differences(load(QUICKSTART, sets + ["generate.num_samples=0", "tune.metric=x/y"])) == []
    moved = tmp_path / "moved"  # the experiment's storage copied elsewhere, then resumed there
    save_run_config(cfg, str(moved / "r"))
    assert resume_differences(load(QUICKSTART, ["tune.name=r", f"tune.storage_path={moved}"])) == []
    changed = ["training.lr=0.5", "training.num_epochs=3", "stop.training_iteration=7"]  # the stop may change
    assert resume_differences(load(QUICKSTART, sets + changed)) == [
        "training.lr (0.001 -> 0.5)", "training.num_epochs (4 -> 3)"]
    # a run saved by an earlier version: it lacks a key added since and has one since dropped
    with open(os.path.join(experiment_dir(cfg), "run_config.json")) as f:
        older = json.load(f)
    del older["training"]["update_clipping"], older["env_runners"]["compile_step"]
    older["training"]["a_dropped_field"] = 3
    with open(os.path.join(experiment_dir(cfg), "run_config.json"), "w") as f:
        json.dump(older, f)
    assert resume_differences(load(QUICKSTART, sets)) == []  # the new keys at their defaults
    assert resume_differences(load(QUICKSTART, sets + ["training.update_clipping=true"])) == [
        "training.update_clipping ('(unset)' -> True)"]  # not the run's behaviour: refused
    older["model"]["overrides"] = {"n_layer": 4}  # a value inside a free-form field, dropped now: refused
    with open(os.path.join(experiment_dir(cfg), "run_config.json"), "w") as f:
        json.dump(older, f)
    assert resume_differences(load(QUICKSTART, sets)) == ["model.overrides.n_layer (4 -> '(unset)')"]
    save_run_config(cfg, experiment_dir(cfg))
    argv = [QUICKSTART, "--resume", *sum((["--set", s] for s in sets + changed), [])]
    assert one_line_cli_error(capsys, main, *argv) == (
        "error: --resume: the run goes on with the config it started with, and this one differs: "
        "training.lr (0.001 -> 0.5), training.num_epochs (4 -> 3); give the run's own config "
        "(or a new tune.name for a new run)")
    # the same config, and no experiment state beside it: said before Ray starts
    same = [QUICKSTART, "--resume", *sum((["--set", s] for s in sets), [])]
    assert one_line_cli_error(capsys, main, *same) == f"error: --resume: no experiment to resume at {tmp_path / 'r'}"
    with open(os.path.join(experiment_dir(cfg), "run_config.json"), "w") as f:
        f.write('{"training": {')  # damaged: named, with what to do
    assert one_line_cli_error(capsys, main, *same) == (
        f"error: --resume: the run's saved config {tmp_path / 'r' / 'run_config.json'} cannot be read (Expecting "
        "property name enclosed in double quotes: line 1 column 15 (char 14)); remove it to resume without "
        "checking the config against the run's own")


def test_a_run_records_what_code_made_it_and_a_resume_with_other_code_says_what_changed(tmp_path, monkeypatch):
    """Beside its config, a run saves the project's version and commit and the libraries'
    versions (versions.json); a --resume under other code (an upgrade, a new commit) goes on,
    and says first what differs."""
    import subprocess

    from agents.resume import VERSIONS, code_versions, experiment_dir, save_run_config, version_changes

    cfg = load(QUICKSTART, ["tune.name=r", f"tune.storage_path={tmp_path}"])
    save_run_config(cfg, experiment_dir(cfg))
    with open(os.path.join(experiment_dir(cfg), VERSIONS)) as f:
        saved = json.load(f)
    now = code_versions()
    assert saved == now and now["tokenmdp"] and now["torch"] == torch.__version__ and now["python"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:  # run from a git checkout (an editable install)
        assert now["commit"].split("+")[0] == head.stdout.strip()
    assert version_changes(cfg) == []
    saved.update(torch="2.0.0", commit="0123abc")
    with open(os.path.join(experiment_dir(cfg), VERSIONS), "w") as f:
        json.dump(saved, f)
    assert version_changes(cfg) == [f"commit 0123abc -> {now['commit']}", f"torch 2.0.0 -> {torch.__version__}"]
    os.remove(os.path.join(experiment_dir(cfg), VERSIONS))  # a run from before versions.json
    assert version_changes(cfg) == []
    import importlib.metadata

    installed = importlib.metadata.version  # run from a checkout that was not installed: recorded as None

    def version(name):
        if name == "tokenmdp":
            raise importlib.metadata.PackageNotFoundError(name)
        return installed(name)
    monkeypatch.setattr(importlib.metadata, "version", version)
    assert code_versions()["tokenmdp"] is None and code_versions()["torch"] == torch.__version__


def test_a_fresh_run_under_an_interrupted_runs_name_is_refused_in_one_line(tmp_path, capsys):
    """Without --resume, a run under the name of an interrupted one would take over its experiment
    (config, state) and the interrupted run could not resume: refused, naming what to do. A name
    whose run finished may be used again, as Tune allows."""
    from agents.resume import unfinished_trials
    from agents.train import main

    experiment = tmp_path / "r"
    experiment.mkdir()

    def saved_state(*statuses):  # Tune's experiment state: one JSON string per trial, then its runtime
        trials = [[json.dumps({"trial_id": f"t{i}", "status": s}), "{}"] for i, s in enumerate(statuses)]
        (experiment / "experiment_state-2026-11-29_00-00-00.json").write_text(
            json.dumps({"trial_data": trials, "runner_data": {}, "stats": {}}))

    saved_state("TERMINATED", "RUNNING")
    assert unfinished_trials(str(experiment)) == 1
    assert one_line_cli_error(capsys, main, QUICKSTART, "--set", f"tune.storage_path={tmp_path}", "--set",
                              "tune.name=r") == (
        f"error: tune.name: {experiment} holds an interrupted run; go on with it with --resume, or give a new "
        "tune.name (or remove that directory) to start another")
    saved_state("TERMINATED", "ERROR")
    assert unfinished_trials(str(experiment)) == 0
    (experiment / "experiment_state-2026-11-29_00-00-00.json").write_text("{")  # cut short: --resume says so
    assert unfinished_trials(str(experiment)) == 0


def test_progress_prints_a_value_that_rounds_to_zero_as_zero():
    from agents.progress import three_places

    assert [three_places(v) for v in (-0.0002, 0.0, 0.0004, -0.0006, 0.1234, -1.5)] == [
        "0.000", "0.000", "0.000", "-0.001", "0.123", "-1.500"]


def test_a_resume_with_other_stop_criteria_goes_on_with_them_and_a_later_plain_resume_keeps_them(tmp_path):
    """Train longer: `--resume` with a later stop is taken (and said), kept beside the run's config,
    and a later `--resume` with the run's own config goes on with it."""
    from agents.resume import RESUME_STOP, experiment_dir, resume_stop, save_run_config

    sets = ["tune.name=r", f"tune.storage_path={tmp_path}", "stop.training_iteration=3"]
    # a run that saved no config (an older version's): each trial takes the config's stop criteria
    assert resume_stop(load(QUICKSTART, sets))[1:] == (True, None)
    save_run_config(load(QUICKSTART, sets), experiment_dir(load(QUICKSTART, sets)))
    stop, other, line = resume_stop(load(QUICKSTART, sets))
    assert (stop["training_iteration"], other, line) == (3, False, None)  # the run's own
    stop, other, line = resume_stop(load(QUICKSTART, sets + ["stop.training_iteration=8", "stop.time_total_s=60"]))
    assert stop["training_iteration"] == 8 and stop["time_total_s"] == 60 and other
    assert line == ("--resume: the run goes on with other stop criteria: stop.time_total_s 540.0 -> 60.0, "
                    "stop.training_iteration 3 -> 8")
    assert os.path.isfile(os.path.join(tmp_path, "r", RESUME_STOP))
    stop, other, line = resume_stop(load(QUICKSTART, sets))  # the run's own config: the last stop stands
    assert (stop["training_iteration"], stop["time_total_s"], other, line) == (8, 60, True, None)
    stop, other, line = resume_stop(load(QUICKSTART, sets + ["stop.training_iteration=12"]))
    assert (stop["training_iteration"], stop["time_total_s"]) == (12, 540)  # the config's stop, whole
    assert line == ("--resume: the run goes on with other stop criteria: stop.time_total_s 60.0 -> 540.0, "
                    "stop.training_iteration 8 -> 12")
    # a fresh run under the finished run's name starts from its own stop, not the old run's last one
    save_run_config(load(QUICKSTART, sets), experiment_dir(load(QUICKSTART, sets)))
    assert not os.path.exists(os.path.join(tmp_path, "r", RESUME_STOP))
    stop, other, line = resume_stop(load(QUICKSTART, sets))
    assert (stop["training_iteration"], other, line) == (3, False, None)


def test_an_asha_run_refuses_other_stop_criteria_and_a_pending_copy_counts_as_an_interrupted_run(tmp_path):
    """ASHA's rungs end at the run's first stop.training_iteration (its max_t): training such a run
    longer is refused in one line, before Ray starts. An experiment whose only state waits in a
    killed copy's journal is an interrupted run: a fresh run under its name is refused."""
    from agents.experiment_store import PLACING
    from agents.resume import check_fresh_run, check_resume_config, experiment_dir, resume_stop, save_run_config

    sets = ["tune.name=r", f"tune.storage_path={tmp_path}", "tune.scheduler=asha", "stop.training_iteration=4",
            "tune.grace_period=1",
            "sampler={grid_search: [{name: none}, {name: top_k, k: 1}]}"]
    save_run_config(load(QUICKSTART, sets), experiment_dir(load(QUICKSTART, sets)))
    with pytest.raises(ValueError, match=r"^--resume: an ASHA run \(tune.scheduler: asha\) goes on with its own stop"):
        check_resume_config(load(QUICKSTART, sets + ["stop.training_iteration=8"]))
    (tmp_path / "r" / "stop.json").write_text('{"training_iteration": 8}')  # left by an earlier version
    assert resume_stop(load(QUICKSTART, sets))[:2] == (load(QUICKSTART, sets)["stop"], False)  # its own
    (tmp_path / "r" / PLACING).write_text("[]")
    check_resume_config(load(QUICKSTART, sets))  # its own config, and a state the journal may place: goes on
    with pytest.raises(ValueError, match=r"^tune.name: .* holds an interrupted run; go on with it with --resume"):
        check_fresh_run(load(QUICKSTART, sets))


def test_a_trial_that_ended_at_its_stop_goes_on_under_a_later_one_and_one_a_scheduler_ended_does_not():
    from types import SimpleNamespace

    from ray.tune.experiment import Trial

    from agents.experiment_store import goes_on

    def trial(iteration, status=Trial.TERMINATED, checkpoint="ck", criteria=None):
        return SimpleNamespace(status=status, checkpoint=checkpoint, last_result={"training_iteration": iteration,
                               "env_runners": {"episode_return_mean": 0.5}},
                               stopping_criterion=criteria or {"training_iteration": 3})

    later = {"training_iteration": 6}
    assert goes_on(trial(3), later)  # ended at its stop
    assert not goes_on(trial(1), later)  # ended before it: a scheduler stopped it (ASHA's first rung)
    assert not goes_on(trial(3, checkpoint=None), later)  # nothing to go on from
    assert not goes_on(trial(6), later)  # meets the new stop too
    assert not goes_on(trial(2, status=Trial.PAUSED), later)  # not ended: resumed as it is anyway
    reward = {"env_runners/episode_return_mean": 0.5}  # a nested result meets a flattened key
    assert goes_on(trial(4, criteria=reward), {"env_runners/episode_return_mean": 0.9})
    assert not goes_on(trial(4, criteria=reward), {"env_runners/episode_return_mean": 0.4})


def test_a_dqn_resume_without_its_replay_buffer_says_so():
    from agents.resume import unsaved_state_note

    dqn = os.path.join(ROOT, "tune_configs", "dqn_synthetic.yaml")
    assert unsaved_state_note(load(dqn)).startswith("--resume: DQN's replay buffer starts empty (dqn.checkpoint_buffer")
    assert unsaved_state_note(load(dqn, ["dqn.checkpoint_buffer=true"])) is None
    assert unsaved_state_note(load(QUICKSTART)) is None
