"""LoRA policies (the KL reference is the base model with the adapters off), reduced precision
and gradient checkpointing on learners and EnvRunners."""
import copy
import os

import pytest
import torch
from ray.rllib.core.columns import Columns

from agents.config import ConfigError, validate
from agents.modules import CausalLMActorCritic
from env.text_env import TokenGenerationEnv
from tests.test_module import ENV_CFG, rollout_obs

LORA = {"r": 4, "alpha": 8.0}
LORA_LN = {**LORA, "modules_to_save": ["ln_f"]}  # the final layer norm trained whole


def make(inference_only=False, model=None, **cfg):
    env = TokenGenerationEnv(ENV_CFG)
    module = CausalLMActorCritic(
        observation_space=env.observation_space, action_space=env.action_space, inference_only=inference_only,
        model_config={"model": {"name_or_path": "tiny-gpt2", **(model or {})}, "env": ENV_CFG, "seed": 0,
                      "reference_model": True, **cfg})
    return env, module


def train_batch(env, episodes=3):
    obs, seq, actions = rollout_obs(env, episodes)
    return {Columns.OBS: obs, Columns.ACTIONS: actions, "seq_id": seq}


def logp(module, batch):
    logits = module.forward_train(batch)[Columns.ACTION_DIST_INPUTS]
    return torch.log_softmax(logits, -1).gather(-1, batch[Columns.ACTIONS][:, None])[:, 0]


def perturb_adapters(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.lm.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif ".modules_to_save." in name:
                p.mul_(1.5)


# -- LoRA ----------------------------------------------------------------------------------

def test_lora_learner_trains_only_adapters_and_the_value_head_and_keeps_no_reference_copy():
    env, full = make()
    _, lora = make(model={"lora": LORA})
    assert hasattr(full, "ref_model") and not hasattr(lora, "ref_model")
    n_full = sum(p.numel() for p in full.parameters())
    n_lm = sum(p.numel() for p in full.lm.parameters())
    n_lora = sum(p.numel() for p in lora.parameters())
    n_adapters = sum(p.numel() for n, p in lora.named_parameters() if ".lora_" in n)
    n_value = sum(p.numel() for p in lora.value_head.parameters())
    assert n_full == 2 * n_lm + n_value  # the policy and its frozen copy
    assert n_lora == n_lm + n_adapters + n_value  # one copy of the LM's weights, plus the adapters
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or n.startswith("value_head.") for n in trainable)
    _, ln = make(model={"lora": LORA_LN})
    trained_ln = {n for n, p in ln.named_parameters() if p.requires_grad} - trainable
    assert trained_ln == {"lm.transformer.ln_f.modules_to_save.default.weight",
                          "lm.transformer.ln_f.modules_to_save.default.bias"}
    assert sum(b.numel() for b in lora.buffers()) == sum(b.numel() for b in lora.lm.buffers())


@pytest.mark.parametrize("spec", [LORA, LORA_LN], ids=["adapters", "adapters+ln_f"])
def test_lora_reference_is_the_base_model_with_the_adapters_off(spec):
    env, lora = make(model={"lora": spec})
    _, base = make()
    batch = train_batch(env)
    with torch.no_grad():
        # adapters start as a no-op: policy == reference == the plain model of the same seed
        torch.testing.assert_close(logp(lora, batch), logp(base, batch))
        perturb_adapters(lora)
        moved = logp(lora, batch)
        ref = lora.reference_logp(batch)
    assert (moved - ref).abs().max() > 1e-2  # the policy moved ...
    torch.testing.assert_close(ref, base.reference_logp(batch))  # ... its reference did not
    with torch.no_grad():  # and the adapters are back on after the reference pass
        torch.testing.assert_close(logp(lora, batch), moved)


def test_envrunners_receive_only_the_adapters_and_act_like_the_learner():
    env, learner = make(model={"lora": LORA_LN})
    perturb_adapters(learner)
    _, full = make()
    sent = learner.get_state(inference_only=True)
    sent_full = full.get_state(inference_only=True)
    # what trains: the adapters, the trained copy of ln_f, and the value head (rollouts store V(s))
    assert sent and all(".lora_" in k or ".ln_f.modules_to_save." in k or k.startswith("value_head.") for k in sent)
    nbytes = sum(v.nbytes for v in sent.values())
    assert nbytes * 5 < sum(v.nbytes for v in sent_full.values())
    _, runner = make(inference_only=True, model={"lora": LORA_LN})
    runner.set_state(sent)
    batch = train_batch(env)
    runner.kv_cache = None  # full-window passes, to compare with the learner's
    with torch.no_grad():
        acting = runner._forward({Columns.OBS: batch[Columns.OBS]})[Columns.ACTION_DIST_INPUTS]
        torch.testing.assert_close(torch.log_softmax(acting, -1).gather(-1, batch[Columns.ACTIONS][:, None])[:, 0],
                                   logp(learner, batch), atol=1e-5, rtol=1e-5)


def test_a_full_state_still_loads_into_a_lora_envrunner():
    env, learner = make(model={"lora": LORA})
    perturb_adapters(learner)
    _, runner = make(inference_only=True, model={"lora": LORA})
    runner.set_state(learner.get_state())  # e.g. a checkpoint's whole module
    for k, v in runner.lm.state_dict().items():
        torch.testing.assert_close(v, learner.lm.state_dict()[k])


def test_lora_gradient_reaches_only_adapters():
    env, lora = make(model={"lora": LORA})
    perturb_adapters(lora)
    lora.train()
    logp(lora, train_batch(env)).sum().backward()
    grads = {n for n, p in lora.named_parameters() if p.grad is not None}
    assert grads and all(".lora_" in n for n in grads)


@pytest.mark.parametrize("spec", [LORA_LN, {**LORA, "modules_to_save": ["wte", "lm_head", "ln_f"]}],
                         ids=["ln_f", "untied-embeddings"])
def test_merged_lora_is_a_plain_model_with_the_same_logits(spec):
    import warnings

    from agents.models import without_adapters

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env, lora = make(model={"lora": spec})
    # PEFT's warning that tied embeddings in modules_to_save untie on export: handled (below), not said
    assert not [w for w in caught if "tie_word_embeddings" in str(w.message)]
    perturb_adapters(lora)
    ids = torch.randint(2, env.vocab_size, (3, 7))
    with torch.no_grad():
        want = lora.lm(input_ids=ids).logits
        plain = without_adapters(lora.lm, merge=True)
        got = plain(input_ids=ids).logits
    assert not any(".lora_" in n for n, _ in plain.named_parameters())
    assert type(plain).__name__ == "GPT2LMHeadModel" and not getattr(plain, "peft_config", None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # without merging: the base model
        torch.testing.assert_close(without_adapters(lora.lm, merge=False)(input_ids=ids).logits,
                                   make()[1].lm(input_ids=ids).logits)
        torch.testing.assert_close(lora.lm(input_ids=ids).logits, want)  # the policy is left as it was


# -- precision -----------------------------------------------------------------------------

# bf16 keeps 8 bits of mantissa: a log-prob computed by two different bf16 passes (the rollout's
# cached incremental one and the learner's full-window one) agrees to about this much.
BF16_LOGP_ATOL = 0.05


@pytest.mark.parametrize("model", [{}, {"lora": LORA}], ids=["full", "lora"])
def test_bf16_rollout_and_bf16_learner_log_probs_agree_and_the_first_ratio_is_one(model):
    env, learner = make(model=model, train_precision="bf16")
    with learner.autocast():  # the learner's passes run in bf16
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    _, runner = make(inference_only=True, model=model, rollout_precision="bf16")
    assert next(runner.lm.parameters()).dtype == torch.bfloat16
    runner.set_state(learner.get_state(inference_only=True))
    # roll out through the runner's KV cache, as an EnvRunner does, storing each step's log-prob
    obs, _ = env.reset(seed=0, options={"prompt": "1 2"})
    steps, rollout_logp, actions = [], [], []
    done = False
    while not done:
        batch = {Columns.OBS: {k: torch.as_tensor(v)[None] for k, v in obs.items()}}
        out = runner.act(batch)
        a = int(out[Columns.ACTIONS][0])
        steps.append(obs)
        actions.append(a)
        rollout_logp.append(float(out[Columns.ACTION_LOGP][0]))
        obs, _, done, _, _ = env.step(a)
    assert out[Columns.ACTION_LOGP].dtype == torch.float32
    train = {Columns.OBS: {k: torch.as_tensor([s[k] for s in steps]) for k in steps[0]},
             Columns.ACTIONS: torch.as_tensor(actions), "seq_id": torch.zeros(len(steps), dtype=torch.long)}
    with torch.no_grad():
        fwd = learner.forward_train(train)
        assert fwd[Columns.ACTION_DIST_INPUTS].dtype == torch.float32  # the loss's logits are float32
        learner_logp = torch.log_softmax(fwd[Columns.ACTION_DIST_INPUTS], -1).gather(
            -1, train[Columns.ACTIONS][:, None])[:, 0]
    ratio = torch.exp(learner_logp - torch.as_tensor(rollout_logp))
    torch.testing.assert_close(learner_logp, torch.as_tensor(rollout_logp), atol=BF16_LOGP_ATOL, rtol=0)
    assert (ratio - 1).abs().max() < BF16_LOGP_ATOL * 1.1
    # the check can fail: an fp32 learner's log-probs differ from the bf16 learner's by more than
    # float32 rounding (so the learner above did not run in fp32)
    _, fp32 = make(model=model)
    with torch.no_grad():
        assert (logp(fp32, train) - learner_logp).abs().max() > 1e-4


@pytest.mark.parametrize("spec", [LORA, {**LORA, "modules_to_save": ["wte", "lm_head", "ln_f"]}],
                         ids=["adapters", "adapters+embeddings"])
@pytest.mark.parametrize("ckpt", [False, True], ids=["", "checkpointed"])
def test_lora_bf16_learner_stores_the_frozen_base_in_bf16_and_trains_float32_adapters(spec, ckpt):
    env, m = make(model={"lora": spec}, train_precision="bf16", gradient_checkpointing=ckpt)
    params = dict(m.named_parameters())
    assert all(p.dtype == torch.float32 for p in params.values() if p.requires_grad)
    frozen = [p for p in params.values() if not p.requires_grad]
    assert all(p.dtype == (torch.bfloat16 if p.dim() >= 2 else torch.float32) for p in frozen)
    assert sum(p.numel() for p in frozen if p.dtype == torch.bfloat16) > 0.9 * sum(p.numel() for p in frozen)
    perturb_adapters(m)
    m.train()
    with torch.no_grad():  # the passes before the update: values for GAE, the reference
        assert m.compute_values(train_batch(env)).dtype == torch.float32
        assert m.reference_logp(train_batch(env)).dtype == torch.float32
    loss = logp(m, train_batch(env)).sum() + m.compute_values(train_batch(env)).sum()
    assert loss.dtype == torch.float32
    loss.backward()
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in m.parameters())


# -- gradient checkpointing ----------------------------------------------------------------

@pytest.mark.parametrize("model", [{}, {"lora": LORA}, {"value_model": "separate"}], ids=["full", "lora", "separate"])
def test_gradient_checkpointing_gives_the_same_gradients(model):
    grads = []
    for ckpt in (False, True):
        env, m = make(model=model, gradient_checkpointing=ckpt)
        if "lora" in model:
            perturb_adapters(m)
        m.train()
        batch = train_batch(env)
        out = m.forward_train(batch)
        lp = torch.log_softmax(out[Columns.ACTION_DIST_INPUTS], -1).gather(-1, batch[Columns.ACTIONS][:, None])
        (lp.sum() + m.compute_values(batch, out[Columns.EMBEDDINGS]).pow(2).sum()).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert m.lm.is_activation_checkpointing
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 2
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5)


# -- config --------------------------------------------------------------------------------

def test_lora_section_is_checked_by_name():
    cfg = validate({"model": {"lora": {"r": 4}}})
    assert cfg["model"]["lora"] == {"r": 4, "alpha": 16.0, "dropout": 0.0, "target_modules": None,
                                    "modules_to_save": None}
    with pytest.raises(ConfigError, match=r"model\.lora\.alpah: unknown key \(did you mean 'alpha'\?\)"):
        validate({"model": {"lora": {"alpah": 4}}})
    with pytest.raises(ConfigError, match=r"model\.lora\.r: expected an integer >= 1, got 0"):
        validate({"model": {"lora": {"r": 0}}})
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules: expected a list"):
        validate({"model": {"lora": {"target_modules": "c_attn"}}})


def test_precision_and_checkpointing_are_refused_for_dqn_and_precision_is_not_searched():
    for raw, field in (({"model": {"lora": {}}}, "model.lora"),
                       ({"training": {"precision": "bf16"}}, "training.precision"),
                       ({"env_runners": {"precision": "bf16"}}, "env_runners.precision")):
        with pytest.raises(ConfigError, match=rf"^{field}: not supported by algorithm 'dqn': DQN's Q-network"):
            validate({"algorithm": "dqn", **raw})
    with pytest.raises(ConfigError, match=r"training\.precision: expected one of 'auto', 'fp32', 'bf16', 'fp16'"):
        validate({"training": {"precision": "int8"}})
    with pytest.raises(ConfigError, match=r"training\.precision: not searchable"):
        validate({"training": {"precision": {"grid_search": ["fp32", "bf16"]}}})


def test_a_missing_target_module_is_one_line():
    with pytest.raises(ValueError, match=r"^model\.lora\.target_modules: .*nope"):
        make(model={"lora": {"target_modules": ["nope"]}})
    with pytest.raises(ValueError, match=r"^model\.lora\.modules_to_save: the model has no module named 'ln_x'"):
        make(model={"lora": {"modules_to_save": ["ln_x"]}})


# -- a LoRA checkpoint: export (merged or adapter), generate, serve ------------------------

@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory):
    from agents.config import algorithm_config, load
    from agents.saved_policy import MODULE_SUBDIR
    from tests.conftest import QUICKSTART

    cfg = load(QUICKSTART, ["model.lora.r=4", "model.lora.modules_to_save=[ln_f]", "training.precision=bf16"])
    algo_config = algorithm_config(cfg)
    module = algo_config.get_rl_module_spec(env=TokenGenerationEnv(algo_config.env_config)).build()
    perturb_adapters(module)  # adapters no fresh policy has: an export that loses them cannot pass
    path = tmp_path_factory.mktemp("lora_checkpoint")
    module.save_to_path(str(path / MODULE_SUBDIR))
    return str(path)


def ids_batch(tokenizer):
    ids = tokenizer("3 7 12 49 0", add_special_tokens=False)["input_ids"]
    return torch.tensor([ids, list(reversed(ids))])


def test_lora_checkpoint_exports_merged_and_as_an_adapter_and_both_load(lora_checkpoint, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from agents.generate import load_policy
    from agents.models import load_pretrained_lm
    from tests.conftest import run_module

    policy = load_policy(lora_checkpoint)
    assert not hasattr(policy, "ref_model") and policy.lm.peft_config
    batch = ids_batch(policy.tokenizer)
    with torch.no_grad():  # the policy's weights (its base stored in bf16) computed in float32, as the exports are
        want = copy.deepcopy(policy.lm).float()(input_ids=batch).logits
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    run = run_module("agents.export", "--checkpoint", lora_checkpoint, "--out", str(merged), timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "adapter_config.json" not in os.listdir(merged)
    run = run_module("agents.export", "--checkpoint", lora_checkpoint, "--out", str(adapter), "--lora", "adapter",
                     timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "PeftModel.from_pretrained" in run.stdout
    assert {"adapter_config.json", "adapter_model.safetensors", "base_model"} <= set(os.listdir(adapter))
    assert os.path.getsize(adapter / "adapter_model.safetensors") * 5 < os.path.getsize(
        merged / "model.safetensors")
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(str(merged)).eval()
        with_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(adapter / "base_model")),
                                              str(adapter)).eval()
        loaded = load_pretrained_lm(str(adapter))
        for got in (plain(input_ids=batch).logits, with_peft(input_ids=batch).logits, loaded(input_ids=batch).logits):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # an adapter whose base directory was saved in bf16 (transformers would load it in bf16):
        # evaluation holds the merged model in fp32, the base's saved values exactly
        AutoModelForCausalLM.from_pretrained(str(adapter / "base_model")).to(torch.bfloat16).save_pretrained(
            str(adapter / "base_model"))
        loaded = load_pretrained_lm(str(adapter))
        assert {p.dtype for p in loaded.parameters()} == {torch.float32}
        base = AutoModelForCausalLM.from_pretrained(str(adapter / "base_model"), dtype=torch.float32)
        merged_from_bf16 = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
        for name, value in merged_from_bf16.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], value), name


def test_lora_checkpoint_generates_and_serves(lora_checkpoint):
    from agents.serve import Policy
    from tests.conftest import run_module, served_in_process

    run = run_module("agents.generate", "--checkpoint", lora_checkpoint, "--prompt", "3 7", "-n", "2", timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("3 7") >= 2
    with served_in_process(Policy(lora_checkpoint)) as client:
        reply = client.post("/v1/completions", json={"prompt": "3 7", "max_tokens": 4, "seed": 1})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] and reply.json()["usage"]["completion_tokens"] >= 1


def test_export_of_adapters_from_a_policy_without_them_is_one_line(tmp_path, capsys):
    from agents.config import algorithm_config, load
    from agents.export import main
    from agents.saved_policy import MODULE_SUBDIR
    from tests.conftest import QUICKSTART, one_line_cli_error

    algo_config = algorithm_config(load(QUICKSTART, []))
    module = algo_config.get_rl_module_spec(env=TokenGenerationEnv(algo_config.env_config)).build()
    module.save_to_path(str(tmp_path / "ckpt" / MODULE_SUBDIR))
    err = one_line_cli_error(capsys, main, "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
                             "--lora", "adapter")
    assert err.startswith("error: --lora adapter: the policy in") and "has no LoRA adapters" in err, err
    assert not (tmp_path / "out").exists()  # nothing half-written


# -- a LoRA run through RLlib and Tune -----------------------------------------------------

@pytest.mark.slow
def test_lora_checkpointed_ppo_run_learns_and_leaves_a_checkpoint_that_exports(tmp_path):
    """The LoRA quickstart through `tokenmdp train` with gradient checkpointing: weight syncs of
    what trains only, the reward rises, the checkpoint exports. (bf16 is covered above at module
    level: on a CPU without native bf16, as CI's, a bf16 run is about 15x slower.)"""
    import glob
    import json

    from tests.conftest import ROOT, run_module

    run = run_module("agents.cli", "train", os.path.join(ROOT, "tune_configs", "lora_quickstart.yaml"),
                     "--set", "training.gradient_checkpointing=true", "--set", "stop.training_iteration=12",
                     "--set", "checkpoint.frequency=6", "--set", f"tune.storage_path={tmp_path}", timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (result,) = glob.glob(str(tmp_path / "lora_quickstart" / "*" / "result.json"))
    rewards = [json.loads(line)["env_runners"]["episode_return_mean"] for line in open(result) if line.strip()]
    assert len(rewards) == 12
    assert max(rewards[-3:]) > rewards[0] + 0.1, rewards
    checkpoints = sorted(glob.glob(str(tmp_path / "lora_quickstart" / "*" / "checkpoint_*")))
    assert checkpoints
    out = tmp_path / "export"
    export = run_module("agents.export", "--checkpoint", checkpoints[-1], "--out", str(out), timeout=180)
    assert export.returncode == 0, export.stderr[-2000:]
    assert "adapter_config.json" not in os.listdir(out) and "model.safetensors" in os.listdir(out)


@pytest.mark.parametrize("name", ["tiny-t5", "tiny-bart"])
def test_seq2seq_lora_policy_keeps_no_reference_copy_and_its_reference_is_the_base(name):
    import numpy as np

    from agents.modules.seq2seq import Seq2SeqActorCritic

    env_cfg = {"task": {"name": "sort_numbers"}, "max_prompt_len": 5, "max_new_tokens": 6, "encoder_decoder": True}

    def build(model):
        return Seq2SeqActorCritic(model_config={"model": {"name_or_path": name, **model}, "env": env_cfg, "seed": 0,
                                                "reference_model": True}, inference_only=False).eval()

    lora, base = build({"lora": {"r": 4}}), build({})  # target_modules: PEFT's default for T5 / BART
    assert not hasattr(lora, "ref_model") and hasattr(base, "ref_model")
    env = TokenGenerationEnv(env_cfg)
    obs = [env.reset(seed=0)[0]]
    for a in (5, 6, 7):
        obs.append(env.step(a)[0])
    batch = {Columns.OBS: {k: torch.as_tensor(np.stack([o[k] for o in obs])) for k in obs[0]},
             Columns.ACTIONS: torch.tensor([5, 6, 7, 8]), "seq_id": torch.zeros(4, dtype=torch.long)}
    perturb_adapters(lora)
    with torch.no_grad():
        ref, want = lora.reference_logp(batch), base.reference_logp(batch)
        moved = lora.forward_train(batch)[Columns.ACTION_DIST_INPUTS]
    torch.testing.assert_close(ref, want)
    assert not torch.allclose(torch.log_softmax(moved, -1).gather(-1, batch[Columns.ACTIONS][:, None])[:, 0], want,
                              atol=1e-3)
