"""The mixed objective: RL loss + mle_coef * NLL of the task's reference continuations."""
import pytest
import torch

from agents.algorithms.mle import ReferencePairs, reference_nll
from agents.config import ConfigError, algorithm_config, load
from env.tasks.text_tasks import clear_cache
from tests.test_tasks import imdb_rows, save_tokenizer, write

PAIRS = [{"source": f"say {w}", "response": f"{w} is good {w}"} for w in
         ("apples", "pears", "plums", "grapes", "limes", "figs", "dates", "kiwis")]


@pytest.fixture(autouse=True)
def _fresh_task_cache():
    clear_cache()
    yield
    clear_cache()


def dialogue_config(tmp_path, *overrides, algorithm="ppo",
                    training="{lr: 3.0e-3, train_batch_size: 64, minibatch_size: 32, num_epochs: 2, mle_batch_size: 8}"):
    data = write(tmp_path / "pairs.jsonl", PAIRS)
    tok = save_tokenizer(tmp_path, [p[k] for p in PAIRS for k in p])
    path = tmp_path / "mle.yaml"
    path.write_text(f"""
algorithm: {algorithm}
seed: 3
task: {{name: dialogue, dataset: {{train: {data}}}}}
model: {{name_or_path: tiny-gpt2}}
env: {{tokenizer: {tok}, max_prompt_len: 4, max_new_tokens: 6}}
reward: {{kl_coef: 0.0}}
training: {training}
env_runners: {{num_env_runners: 0, num_envs_per_env_runner: 8}}
stop: {{training_iteration: 5}}
""")
    return load(str(path), list(overrides))


def test_pairs_are_the_envs_prompts_followed_by_the_reference_and_eos(tmp_path):
    cfg = dialogue_config(tmp_path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg["env"]["tokenizer"])
    env_cfg = {"task": cfg["task"], "max_prompt_len": 1, "max_new_tokens": 3, "truncation_side": "left"}
    pairs = ReferencePairs(env_cfg, tok)
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert len(pairs) == len(PAIRS)
    p = PAIRS[0]
    # prompt cut from the left to 1 token, target cut to 3 tokens (no room left for EOS)
    assert pairs.pairs[0] == (enc(p["source"])[-1:], enc(p["response"])[:3])
    pairs = ReferencePairs({**env_cfg, "max_prompt_len": 4, "max_new_tokens": 6}, tok)
    assert pairs.pairs[0] == (enc(p["source"]), enc(p["response"]) + [tok.eos_token_id])
    ids, mask, labels = pairs.batch(0, indices=[0, 1])
    n_prompt, n_target = len(pairs.pairs[0][0]), len(pairs.pairs[0][1])
    assert ids[0, :n_prompt + n_target].tolist() == pairs.pairs[0][0] + pairs.pairs[0][1]
    assert (labels[0] != -100).sum() == n_target and labels[0, n_prompt:n_prompt + n_target].tolist() == pairs.pairs[0][1]


def test_imdb_targets_are_the_rest_of_the_review(tmp_path):
    from env.tasks import make_task

    task = make_task({"name": "imdb", "dataset": {"train": write(tmp_path / "t.jsonl", imdb_rows("train", 2))},
                      "prompt_words": 4}, max_new_tokens=8)
    ex = task.examples("train")[1]
    assert ex["prompt"] == "train review 1 :"
    assert task.targets(ex) == [" the film was great and the cast was fine overall"]


def test_reference_nll_is_the_mean_target_token_nll():
    from agents.models import build_causal_lm
    from env.tokenization import word_level_tokenizer

    tok = word_level_tokenizer(list("abcdefgh"))
    lm = build_causal_lm({"name_or_path": "tiny-gpt2"}, tok, seed=0, max_positions=16)
    ids = torch.tensor([[5, 6, 7, 8, 0], [5, 7, 6, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    labels = torch.tensor([[-100, -100, 7, 8, -100], [-100, 7, 6, -100, -100]])
    got = reference_nll(lm, ids, mask, labels)
    by_hand = []
    for r in range(2):
        n = int(mask[r].sum())
        logp = torch.log_softmax(lm(input_ids=ids[r:r + 1, :n]).logits[0].float(), -1)
        by_hand += [-logp[t - 1, ids[r, t]] for t in range(n) if labels[r, t] != -100]
    assert float(got) == pytest.approx(float(torch.stack(by_hand).mean()), rel=1e-5)


def test_learner_loss_adds_mle_coef_times_the_references_nll_and_coef_0_adds_nothing(tmp_path):
    """The mixed objective on the learner: loss = RL loss + mle_coef * NLL of a draw of reference pairs."""
    from agents.config import env_config
    from env.text_env import TokenGenerationEnv

    def learner(coef):
        cfg = dialogue_config(tmp_path, f"training.mle_coef={coef}")
        return algorithm_config(cfg).build_learner(env=TokenGenerationEnv(env_config(cfg)))

    plain = learner(0.0)
    rl_loss = torch.tensor(0.25, requires_grad=True)
    assert plain.mle_pairs is None and plain.add_mle_term("default_policy", rl_loss) is rl_loss

    mixed = learner(0.5)
    pairs = mixed.mle_pairs
    drawn = []
    draw = pairs.batch
    pairs.batch = lambda n, device=None: drawn.append(draw(n, device)) or drawn[-1]  # keep what the learner drew
    total = mixed.add_mle_term("default_policy", rl_loss)
    assert len(drawn) == 1 and drawn[0][0].shape[0] == 8  # training.mle_batch_size pairs
    lm = mixed.module["default_policy"].unwrapped().lm
    nll = reference_nll(lm, *drawn[0])
    assert float(nll) > 1.0  # an untrained model: a real term
    assert float(total) == pytest.approx(0.25 + 0.5 * float(nll), rel=1e-5)
    total.backward()  # the term trains the LM
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in lm.parameters())


@pytest.mark.slow
def test_mle_term_lowers_the_references_nll_against_pure_rl(tmp_path, ray_local):
    def train(coef):
        cfg = dialogue_config(tmp_path, f"training.mle_coef={coef}")
        algo = algorithm_config(cfg).build_algo()
        try:
            learner = algo.learner_group._learner
            pairs = ReferencePairs({"task": cfg["task"], "max_prompt_len": 4, "max_new_tokens": 6},
                                   learner.module["default_policy"].tokenizer)
            everything = pairs.batch(0, indices=range(len(pairs)))
            lm = learner.module["default_policy"].lm
            with torch.no_grad():
                before = float(reference_nll(lm, *everything))
            results = [algo.train() for _ in range(4)]
            with torch.no_grad():
                after = float(reference_nll(lm, *everything))
        finally:
            algo.stop()
        return before, after, results[-1]["learners"]["default_policy"]

    before0, after0, metrics0 = train(0.0)
    before1, after1, metrics1 = train(1.0)
    assert before0 == pytest.approx(before1)  # same seed, same initial policy
    assert "mle_nll" not in metrics0
    assert metrics1["mle_coef"] == 1.0 and metrics1["mle_nll"] < before1
    assert after1 < before1 - 1.0, (before1, after1)
    assert after1 < after0 - 0.5, (after0, after1)


def test_mle_coef_where_it_cannot_apply_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="training.mle_coef: task 'text' has no reference texts to learn from"):
        dialogue_config(tmp_path, "training.mle_coef=0.5", "task.name=text", "task.reward={name: vader}")
    with pytest.raises(ConfigError, match="training.mle_coef: not used by algorithm 'dqn'"):
        dialogue_config(tmp_path, algorithm="dqn", training="{mle_coef: 0.5}")
