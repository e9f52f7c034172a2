"""Real-text tasks (env/tasks/text_tasks.py) on small files written here in each hub data set's format."""
import csv
import json
import os

import pytest

from env.rewards import RewardConfigError, make_reward
from env.tasks import TASKS, check_task, make_task
from env.tasks.data import DataError
from env.tasks.text_tasks import clear_cache
from env.text_env import TokenGenerationEnv
from env.tokenization import word_level_tokenizer
from env.validation import ConfigError
from tests.conftest import one_line_cli_error


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path_factory, monkeypatch):
    """datasets' Arrow cache in a temporary folder, and this module's in-process cache emptied."""
    import datasets

    cache = str(tmp_path_factory.getbasetemp() / "hf_datasets_cache")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    clear_cache()
    yield cache
    clear_cache()


def write(path, rows, fmt=None):
    """Writes rows (dicts) as .jsonl, .csv or .parquet, by the file's extension."""
    path = str(path)
    fmt = fmt or os.path.splitext(path)[1][1:]
    if fmt == "jsonl":
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    elif fmt == "csv":
        with open(path, "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def imdb_rows(split, n):
    return [{"text": f"{split} review {i} : the film was {'great' if i % 2 else 'dull'} and the cast "
                     f"was fine<br /><br />overall",
             "label": i % 2} for i in range(n)]


def save_tokenizer(tmp_path, texts):
    """A word-level tokenizer knowing every word of `texts`, saved where the env can load it."""
    words = sorted({w for t in texts for w in t.split()})
    out = tmp_path / "tokenizer"
    word_level_tokenizer(words).save_pretrained(str(out))
    return str(out)


def make_env(tmp_path, task, texts, **kw):
    cfg = {"task": task, "tokenizer": save_tokenizer(tmp_path, texts), "max_prompt_len": 8, "max_new_tokens": 8}
    cfg.update(kw)
    return TokenGenerationEnv(cfg)


def ids(env, text):
    return env.tokenizer(text, add_special_tokens=False)["input_ids"]


# -- loading and splits ----------------------------------------------------------------------------

def test_every_text_task_is_registered():
    assert {"imdb", "commongen", "dialogue", "summarization", "text"} <= set(TASKS)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_imdb_files_per_split_give_each_split_its_rows(tmp_path, fmt):
    sizes = {"train": 5, "validation": 3, "test": 2}
    files = {s: write(tmp_path / f"{s}.{fmt}", imdb_rows(s, n)) for s, n in sizes.items()}
    task = make_task({"name": "imdb", "dataset": files, "prompt_words": 4}, max_new_tokens=8)
    for split, n in sizes.items():
        examples = task.examples(split)
        assert [e["meta"]["review"] for e in examples] == [r["text"] for r in imdb_rows(split, n)]
        assert [e["meta"]["label"] for e in examples] == [i % 2 for i in range(n)]
        assert all(isinstance(e["meta"]["label"], int) for e in examples)
        assert examples[1]["prompt"] == f"{split} review 1 :"  # the first 4 words
        assert all(e["meta"]["split"] == split for e in examples)
    assert "<br" not in make_task({"name": "imdb", "dataset": files, "prompt_words": None},
                                  max_new_tokens=8).examples("test")[0]["prompt"]


def test_single_file_is_split_by_seeded_fractions(tmp_path):
    path = write(tmp_path / "all.jsonl", imdb_rows("all", 20))

    def split_of(**kw):
        task = make_task({"name": "imdb", "dataset": path, **kw}, max_new_tokens=8)
        return {s: [e["meta"]["review"] for e in task.examples(s)] for s in ("train", "validation", "test")}

    first = split_of()
    assert {s: len(v) for s, v in first.items()} == {"train": 16, "validation": 2, "test": 2}  # 0.8/0.1/0.1
    everything = first["train"] + first["validation"] + first["test"]
    assert sorted(everything) == sorted(r["text"] for r in imdb_rows("all", 20))  # disjoint and complete
    order = [r["text"] for r in imdb_rows("all", 20)]
    assert all(v == sorted(v, key=order.index) for v in first.values())  # file order kept within a split
    clear_cache()
    assert split_of() == first  # deterministic across loads
    assert split_of(split_seed=1) != first
    task = make_task({"name": "imdb", "dataset": path, "split_fractions": {"train": 0.5, "test": 0.25}},
                     max_new_tokens=8)
    assert len(task.examples("train")) == 10 and len(task.examples("test")) == 5
    with pytest.raises(DataError, match=r"all\.jsonl: no split 'validation'.*split_fractions"):
        task.examples("validation")


def test_max_examples_keeps_a_seeded_subset_per_split(tmp_path):
    files = {s: write(tmp_path / f"{s}.jsonl", imdb_rows(s, 10)) for s in ("train", "test")}
    spec = {"name": "imdb", "dataset": files, "max_examples": {"train": 4}}
    train = [e["meta"]["review"] for e in make_task(spec, max_new_tokens=8).examples("train")]
    assert len(train) == 4 and set(train) <= {r["text"] for r in imdb_rows("train", 10)}
    clear_cache()
    assert [e["meta"]["review"] for e in make_task(spec, max_new_tokens=8).examples("train")] == train
    assert len(make_task(spec, max_new_tokens=8).examples("test")) == 10
    assert len(make_task({**spec, "max_examples": 3}, max_new_tokens=8).examples("test")) == 3


def test_hub_layout_folder_and_save_to_disk_go_through_datasets(tmp_path):
    import datasets

    hub = tmp_path / "imdb_hub"  # a folder laid out like the hub repository: load_dataset(name)
    hub.mkdir()
    for split, n in (("train", 6), ("test", 4)):
        write(hub / f"{split}.jsonl", imdb_rows(split, n))
    task = make_task({"name": "imdb", "dataset": str(hub), "split_from": "test",
                      "split_fractions": {"validation": 0.5, "test": 0.5}}, max_new_tokens=8)
    assert len(task.examples("train")) == 6
    val, test = task.examples("validation"), task.examples("test")
    assert len(val) == 2 and len(test) == 2
    assert {e["meta"]["review"] for e in val + test} == {r["text"] for r in imdb_rows("test", 4)}
    with pytest.raises(DataError, match=r"no split 'validation' \(has: train, test\)"):
        make_task({"name": "imdb", "dataset": str(hub)}, max_new_tokens=8).examples("validation")

    saved = tmp_path / "saved"
    datasets.DatasetDict({s: datasets.Dataset.from_list(imdb_rows(s, 3)) for s in ("train", "dev")}).save_to_disk(
        str(saved))
    task = make_task({"name": "imdb", "dataset": str(saved), "splits": {"validation": "dev"}}, max_new_tokens=8)
    assert [e["meta"]["review"] for e in task.examples("validation")] == [r["text"] for r in imdb_rows("dev", 3)]
    one = tmp_path / "saved_one"
    datasets.Dataset.from_list(imdb_rows("one", 10)).save_to_disk(str(one))
    task = make_task({"name": "imdb", "dataset": str(one)}, max_new_tokens=8)
    assert len(task.examples("train")) == 8 and len(task.examples("test")) == 1


def test_a_hub_name_that_cannot_be_loaded_offline_is_one_data_error():
    task = make_task({"name": "dialogue", "dataset": "no-such-owner/no-such-dataset-4711"}, max_new_tokens=8)
    with pytest.raises(DataError, match=r"^dataset 'no-such-owner/no-such-dataset-4711': cannot load") as e:
        task.examples("train")
    assert "\n" not in str(e.value)


def test_the_default_data_sets_are_hub_names_and_load_nothing_at_construction():
    assert make_task({"name": "imdb"}, max_new_tokens=8).data.dataset == "stanfordnlp/imdb"
    assert make_task({"name": "commongen"}, max_new_tokens=8).data.dataset == "allenai/common_gen"
    summ = make_task({"name": "summarization"}, max_new_tokens=8)
    assert (summ.data.dataset, summ.data.config) == ("abisee/cnn_dailymail", "3.0.0")


# -- prompts through the env --------------------------------------------------------------------

def test_imdb_prompt_is_cut_to_max_prompt_len_by_the_env(tmp_path):
    review = "one two three four five six seven eight nine ten"
    files = {"train": write(tmp_path / "train.jsonl", [{"text": review, "label": 1}])}
    texts = [review]
    env = make_env(tmp_path, {"name": "imdb", "dataset": files, "prompt_words": None}, texts,
                   max_prompt_len=4, truncation_side="right")
    obs, info = env.reset(seed=0)
    assert env.prompt_ids == ids(env, "one two three four")  # the review's beginning
    assert info["prompt"] == "one two three four" and info["prompt_truncated"]
    assert obs["input_ids"][-4:].tolist() == env.prompt_ids
    env = make_env(tmp_path, {"name": "imdb", "dataset": files, "prompt_words": 3}, texts, max_prompt_len=4)
    _, info = env.reset(seed=0)
    assert info["prompt"] == "one two three" and not info["prompt_truncated"]  # pre-cut by words


# -- CommonGen ---------------------------------------------------------------------------------------

CG_SETS = {
    0: (["dog", "frisbee", "catch", "throw"], ["a dog leaps to catch a thrown frisbee",
                                               "the dog can catch the frisbee when i throw it",
                                               "he will throw the frisbee and the dog will catch it"]),
    1: (["cat", "sofa", "sleep"], ["a cat likes to sleep on the sofa", "the cat is asleep on a sofa"]),
    2: (["ski", "mountain"], ["they ski down the mountain", "a man skis on a mountain", "ski the mountain"]),
    3: (["river", "boat", "row"], ["two men row a boat on the river", "row the boat across the river"]),
}


def commongen_rows(sets=CG_SETS, as_string=False):
    rows = [{"concept_set_idx": idx, "concepts": " ".join(c) if as_string else c, "target": t}
            for idx, (c, targets) in sets.items() for t in targets]
    return rows[1::2] + rows[0::2]  # interleaved: a set's targets are not adjacent


def test_commongen_groups_all_targets_of_a_concept_set(tmp_path):
    files = {"train": write(tmp_path / "train.jsonl", commongen_rows()),
             "validation": write(tmp_path / "val.csv", commongen_rows(as_string=True))}  # csv: concepts as text
    task = make_task({"name": "commongen", "dataset": files}, max_new_tokens=8)
    for split in ("train", "validation"):
        examples = task.examples(split)
        assert len(examples) == len(CG_SETS)
        by_idx = {e["meta"]["concept_set_idx"]: e for e in examples}
        for idx, (concepts, targets) in CG_SETS.items():
            assert sorted(by_idx[idx]["meta"]["references"]) == sorted(targets)
            assert by_idx[idx]["meta"]["concepts"] == concepts
        assert by_idx[0]["prompt"] == "Generate a sentence with: dog frisbee catch throw"


def test_commongen_split_fractions_never_split_a_concept_set(tmp_path):
    sets = {i: ([f"c{i}", "x"], [f"target {i} {k}" for k in range(3)]) for i in range(20)}
    path = write(tmp_path / "cg.jsonl", commongen_rows(sets))
    task = make_task({"name": "commongen", "dataset": path, "max_examples": {"test": 1}}, max_new_tokens=8)
    seen = {}
    for split in ("train", "validation", "test"):
        for e in task.examples(split):
            assert e["meta"]["concept_set_idx"] not in seen
            seen[e["meta"]["concept_set_idx"]] = split
            assert len(e["meta"]["references"]) == 3
    assert len(task.examples("train")) == 16 and len(task.examples("validation")) == 2
    assert len(task.examples("test")) == 1


def test_commongen_default_reward_is_cider_d_on_the_splits_references(tmp_path):
    files = {"train": write(tmp_path / "train.jsonl", commongen_rows())}
    task = make_task({"name": "commongen", "dataset": files}, max_new_tokens=8)
    examples = task.examples("train")
    meta = next(e["meta"] for e in examples if e["meta"]["concept_set_idx"] == 1)
    corpus = [e["meta"]["references"] for e in examples]
    direct = make_reward({"name": "cider_d", "corpus_references": corpus})
    text = "a cat likes to sleep on the sofa"
    got = task.reward(["p"], [text], [meta])[0]
    assert got == pytest.approx(direct(["p"], [text], [meta])[0]) and got > 1.0
    assert task.reward(["p"], ["ski"], [meta])[0] < got
    summed = make_task({"name": "commongen", "dataset": files,
                        "reward": {"sum": [{"name": "cider_d", "weight": 0.5}, {"name": "bleu", "weight": 1.0}]}},
                       max_new_tokens=8)
    bleu = make_reward({"name": "bleu"})(["p"], [text], [meta])[0]
    assert summed.reward(["p"], [text], [meta])[0] == pytest.approx(0.5 * got + bleu)


# -- dialogue, summarization, generic text -------------------------------------------------------------

DIALOGUE = [{"source": "how are you today", "response": "i am fine thank you very much"},
            {"source": "where do you live", "response": "i live in a small town by the sea"}]


def test_dialogue_bleu_on_a_finished_episode_is_sacrebleus_sentence_bleu(tmp_path):
    import sacrebleu

    files = {"train": write(tmp_path / "dialogue.csv", DIALOGUE)}
    env = make_env(tmp_path, {"name": "dialogue", "dataset": files},
                   [d[k] for d in DIALOGUE for k in d], max_new_tokens=10)
    _, info = env.reset(seed=0)
    pair = next(d for d in DIALOGUE if d["source"] == info["prompt"])
    assert env._example["meta"]["source"] == pair["source"]
    assert env._example["meta"]["reference"] == pair["response"]
    words = pair["response"].split()[:5]
    for w in words:
        _, reward, done, _, info = env.step(ids(env, w)[0])
        assert not done and reward == 0.0
    _, reward, done, _, info = env.step(env.eos_id)
    assert done and info["generation"] == " ".join(words)
    expected = sacrebleu.sentence_bleu(info["generation"], [pair["response"]]).score / 100
    assert reward == pytest.approx(expected) and 0 < reward < 1


def test_summarization_prompt_meta_and_rouge(tmp_path):
    rows = [{"article": "the council voted to build a new bridge over the river on monday", "highlights":
             "council votes for new bridge", "id": "a"}]
    files = {"test": write(tmp_path / "test.parquet", rows)}
    task = make_task({"name": "summarization", "dataset": files}, max_new_tokens=8)
    (example,) = task.examples("test")
    assert example["prompt"] == rows[0]["article"] + " TL;DR:"
    assert example["meta"]["source"] == rows[0]["article"]
    assert example["meta"]["reference"] == rows[0]["highlights"]
    from rouge_score import rouge_scorer

    text = "council votes for a bridge"
    expected = rouge_scorer.RougeScorer(["rougeL"]).score(rows[0]["highlights"], text)["rougeL"].fmeasure
    assert task.reward([example["prompt"]], [text], [example["meta"]])[0] == pytest.approx(expected)
    cut = make_task({"name": "summarization", "dataset": files, "article_words": 3, "prompt_suffix": ""},
                    max_new_tokens=8)
    assert cut.examples("test")[0]["prompt"] == "the council voted"


def test_imdb_default_reward_is_vader_sentiment(tmp_path):
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    task = make_task({"name": "imdb", "dataset": {"train": write(tmp_path / "t.jsonl", imdb_rows("t", 2))}},
                     max_new_tokens=8)
    assert task.reward_spec == {"name": "sentiment"}
    text = "a wonderful, moving film"
    expected = (SentimentIntensityAnalyzer().polarity_scores(text)["compound"] + 1) / 2
    assert task.reward(["p"], [text], [{}])[0] == pytest.approx(expected)


def test_text_task_fields_references_and_reward(tmp_path):
    rows = [{"question": "name a colour", "answers": ["red", "blue"], "ctx": "colours", "n": 1},
            {"question": "name a fruit", "answers": ["apple"], "ctx": "fruit", "n": 2}]
    files = {"train": write(tmp_path / "qa.parquet", rows)}
    spec = {"name": "text", "dataset": files, "prompt_field": "question", "reference_field": "answers",
            "source_field": "ctx", "meta_fields": ["n"], "prompt_prefix": "Q: ", "prompt_suffix": " A:"}
    task = make_task(spec, max_new_tokens=8)
    first = task.examples("train")[0]
    assert first["prompt"] == "Q: name a colour A:"
    assert first["meta"]["references"] == ["red", "blue"] and first["meta"]["source"] == "colours"
    assert first["meta"]["n"] == 1
    assert task.reward_spec == {"name": "bleu"}
    assert task.reward([first["prompt"]], ["blue"], [first["meta"]])[0] == pytest.approx(1.0)
    vader = make_task({"name": "text", "dataset": files, "prompt_field": "question", "reward": {"name": "vader"}},
                      max_new_tokens=8)
    assert vader.examples("train")[1]["meta"] == {"split": "train"}
    with pytest.raises(ValueError, match=r"^task\.reward: missing"):
        make_task({"name": "text", "dataset": files, "prompt_field": "question"}, max_new_tokens=8)


# -- config mistakes -------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,message", [
    ({"name": "imdb", "datset": "x.jsonl"}, r"^task\.datset: unknown key for task 'imdb' \(did you mean 'dataset'\?\)"),
    ({"name": "dialogue"}, r"^task\.dataset: missing"),
    ({"name": "imdb", "dataset": "x.jsonl", "reward": {"name": "bleuu"}}, r"^task\.reward\.name: unknown reward"),
    ({"name": "imdb", "dataset": "x.jsonl", "split_fractions": {"train": 0.9, "test": 0.2}},
     r"^task\.split_fractions: the fractions add up to 1\.1"),
    ({"name": "imdb", "dataset": "x.jsonl", "max_examples": 0}, r"^task\.max_examples: expected an integer >= 1"),
    ({"name": "imdb", "dataset": "x.jsonl", "prompt_words": "ten"}, r"^task\.prompt_words: expected an integer"),
])
def test_config_mistakes_name_the_key(spec, message):
    with pytest.raises(ValueError, match=message):
        make_task(spec, max_new_tokens=8)
    if "reward" in spec:
        with pytest.raises(RewardConfigError):
            make_task(spec, max_new_tokens=8)


@pytest.mark.parametrize("spec, line", [
    # The quickstart's task section (increasing_numbers' keys) under another built-in task's name.
    ({"name": "sort_numbers", "num_numbers": 50, "prompt_len": 5},
     "task.prompt_len: unknown key for task 'sort_numbers' (known: length, mode, num_eval, num_numbers, num_train, "
     "seed)"),
    ({"name": "sort_numbers", "lenght": 3},
     "task.lenght: unknown key for task 'sort_numbers' (did you mean 'length'?)"),
    ({"name": "combination_lock", "max_new_token": 3},
     "task.max_new_token: unknown key for task 'combination_lock' (did you mean 'max_new_tokens'?)"),
    ({"name": "increasing_numbers", "num_numbers": "ten"}, "task.num_numbers: expected an integer, got 'ten'"),
    ({"name": "imdb", "dataset": "x.jsonl", "strip_html": "yes"}, "task.strip_html: expected true or false, got 'yes'"),
])
def test_a_built_in_task_checks_its_keys_as_a_plugin_task_does(spec, line):
    """Built-in tasks go through the constructor-signature check of plugin tasks and rewards: a key
    the constructor does not take is one line naming it (not a TypeError from inside the env), and
    `check_task` gives the same line without building anything."""
    with pytest.raises(ConfigError) as info:
        TokenGenerationEnv({"task": spec, "max_prompt_len": 5, "max_new_tokens": 20})
    assert str(info.value) == line
    with pytest.raises(ConfigError) as info:
        check_task(spec)
    assert str(info.value) == line


def test_check_task_passes_what_builds_and_names_an_unknown_task():
    check_task({"name": "increasing_numbers", "num_numbers": 50, "prompt_len": 5})
    check_task({"name": "combination_lock", "pattern": 7})  # one number: YAML reads it as an int
    check_task({"name": "imdb", "dataset": "x.jsonl", "prompt_words": None})
    with pytest.raises(ConfigError, match=r"^task\.name: unknown task 'sort_number' "
                                          r"\(did you mean 'sort_numbers'\?\)$"):
        check_task({"name": "sort_number"})


# -- malformed data ------------------------------------------------------------------------------

def _non_utf8_jsonl(path):
    with open(path, "wb") as f:
        f.write(b'{"text": "fine review", "label": 1}\n')
        f.write(b'{"text": "caf\xe9 review", "label": 0}\n')  # latin-1, not UTF-8


def _non_utf8_csv(path):
    with open(path, "wb") as f:
        f.write(b"label,text\n1,fine review\n0,caf\xe9 review\n")


MALFORMED = {
    "missing field": ("train.jsonl", lambda p: write(p, [{"review": "good", "label": 1}]),
                      r"train\.jsonl: missing field 'text' \(columns: review, label\); set task\.text_field"),
    "missing label": ("train.csv", lambda p: write(p, [{"text": "good"}]),
                      r"train\.csv: missing field 'label' .*task\.label_field"),
    "empty split (no bytes)": ("train.jsonl", lambda p: open(p, "w").close(),
                               r"train\.jsonl: split 'train' is empty"),
    "empty split (header only)": ("train.csv", lambda p: open(p, "w").write("text,label\n"),
                                  r"train\.csv: split 'train' is empty"),
    "empty text": ("train.jsonl", lambda p: write(p, [{"text": "ok", "label": 1}, {"text": "  ", "label": 0}]),
                   r"train\.jsonl: row 2: field 'text' is empty"),
    "null text": ("train.parquet", lambda p: write(p, [{"text": "ok", "label": 1}, {"text": None, "label": 0}]),
                  r"train\.parquet: row 2: field 'text' is missing"),
    "non-UTF-8 jsonl": ("train.jsonl", _non_utf8_jsonl,
                        r"train\.jsonl: line 2 in field 'text': not UTF-8 \(byte 0xe9"),
    "non-UTF-8 csv": ("train.csv", _non_utf8_csv, r"train\.csv: line 3 in field 'text': not UTF-8"),
    "unreadable parquet": ("train.parquet", lambda p: open(p, "wb").write(b"this is not parquet"),
                           r"train\.parquet: cannot read it as parquet"),
    "bad json": ("train.jsonl", lambda p: open(p, "w").write('{"text": "a", "label": 1}\n\n{"text": \n'),
                 r"train\.jsonl: line 3 is not valid JSON: Expecting value \(column 10\)$"),
    "json line not an object": ("train.jsonl", lambda p: open(p, "w").write('{"text": "a", "label": 1}\n["b", 0]\n'),
                                r"train\.jsonl: line 2 is a JSON list, not an object of fields$"),
    "bad json document": ("train.json", lambda p: open(p, "w").write('[{"text": "a", "label": 1},\n {"text": "b" "label": 0}]'),
                          r"train\.json: line 2 is not valid JSON: Expecting ',' delimiter \(column 15\)$"),
    "no such file": ("missing.jsonl", lambda p: None, r"missing\.jsonl: no such file \(split 'train'\)"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_data_stops_with_one_line_naming_file_and_field(tmp_path, case):
    name, make, message = MALFORMED[case]
    path = tmp_path / name
    make(str(path))
    task = make_task({"name": "imdb", "dataset": {"train": str(path)}}, max_new_tokens=8)
    with pytest.raises(DataError, match=message) as e:
        task.examples("train")
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_split_emptied_by_its_fraction_is_named(tmp_path):
    path = write(tmp_path / "few.jsonl", imdb_rows("few", 3))
    task = make_task({"name": "imdb", "dataset": path}, max_new_tokens=8)
    with pytest.raises(DataError, match=r"few\.jsonl: split .test. is empty: split_fractions gives it 0\.1 of 3 rows"):
        task.examples("test")
    assert len(task.examples("validation")) == 1  # rounding: 3 rows give 2 / 1 / 0


@pytest.mark.parametrize("case", ["non-UTF-8 jsonl", "missing field", "bad json"])  # before, after, as datasets reads it
def test_train_cli_prints_one_error_line_for_malformed_data(tmp_path, case, capsys):
    # The CLI's main in this process (the data is read before Ray starts): exit code 2, one line, no traceback.
    from agents.train import main

    bad = tmp_path / "train.jsonl"
    MALFORMED[case][1](str(bad))
    config = tmp_path / "imdb.yaml"
    config.write_text(
        f"task:\n  name: imdb\n  dataset:\n    train: {bad}\n"
        f"env:\n  tokenizer: {save_tokenizer(tmp_path, ['fine review'])}\n"
        f"  max_prompt_len: 8\n  max_new_tokens: 8\n")
    line = one_line_cli_error(capsys, main, str(config))
    assert line.startswith("error: ") and str(bad) in line and ("field 'text'" in line or "line 3" in line)
    if case == "bad json":  # datasets logs the file's parse error through its own logger: not in this process's capture
        from tests.conftest import run_module

        out = run_module("agents.train", str(config))
        assert out.returncode == 2 and out.stderr.strip() == line, out.stderr[-2000:]


def test_a_data_file_rewritten_again_and_again_keeps_the_caches_bounded(tmp_path):
    """Cache keys carry each file's size and mtime; a file rewritten in place during a long run is
    read again each time, and the per-process caches keep a bounded number of entries."""
    from env.tasks import data, text_tasks

    path = tmp_path / "train.jsonl"
    spec = {"name": "imdb", "dataset": {"train": str(path)}}
    for i in range(80):
        rows = imdb_rows("train", 3)
        rows[0]["text"] = f"version {i}"
        write(path, rows)
        os.utime(path, ns=(i * 10**9, i * 10**9))  # a new mtime even within the file system's resolution
        assert make_task(spec, max_new_tokens=8).examples("train")[0]["meta"]["review"] == f"version {i}"
    assert len(text_tasks._EXAMPLES) <= text_tasks._EXAMPLES.maxsize < 80
    assert len(data._ROWS) <= data._ROWS.maxsize < 2 * 80
    assert len(data._DATASETS) <= data._DATASETS.maxsize < 80


def test_train_refuses_prompts_with_words_its_word_level_tokenizer_lacks_in_one_line(tmp_path, capsys):
    """A prompt word the tokenizer does not know would reach the policy as its unknown token (EOS
    for the project's word-level tokenizers): refused before Ray starts, as pretrain refuses it."""
    from agents.train import main

    data = write(tmp_path / "train.jsonl", [{"text": "fine review", "label": 1}, {"text": "fine river", "label": 0}])
    config = tmp_path / "imdb.yaml"
    config.write_text(f"task:\n  name: imdb\n  dataset:\n    train: {data}\n"
                      f"env:\n  tokenizer: {save_tokenizer(tmp_path, ['fine review'])}\n"
                      f"  max_prompt_len: 8\n  max_new_tokens: 8\n")
    line = one_line_cli_error(capsys, main, str(config))
    assert line.startswith("error: task.dataset: its tokenizer does not know words of 1 of the 2 training examples "
                           "(the first: 'river' in example 2); they would train as its unknown token"), line


@pytest.mark.parametrize("reward, message", [
    ("{name: bleu}", "error: reward 'bleu' (task.reward): failed on generation 'write about the river' (prompt "
                     "'write about the river'): ValueError: needs references: the example's meta has no 'references'"),
    ('{name: "examples.custom_reward.keyword_reward:keyword_reward"}',  # meta_fields left out: no keyword
     "error: reward 'examples.custom_reward.keyword_reward:keyword_reward' (task.reward): failed on generation "
     "'write about the river' (prompt 'write about the river'): KeyError: 'keyword'"),
])
def test_train_refuses_a_reward_its_data_cannot_feed_in_one_line(tmp_path, capsys, reward, message):
    """A text task's reward is tried on its first training example before Ray starts (one that
    loads no model): references or meta fields the data lacks fail here, not inside the trial."""
    from agents.train import main

    rows = [{"prompt": "write about the river", "keyword": "river"}] * 3
    data = write(tmp_path / "prompts.jsonl", rows)
    config = tmp_path / "text.yaml"
    config.write_text(f"task:\n  name: text\n  dataset: {data}\n  reward: {reward}\n"
                      f"env:\n  tokenizer: {save_tokenizer(tmp_path, ['write about the river'])}\n"
                      f"  max_prompt_len: 8\n  max_new_tokens: 8\n")
    assert one_line_cli_error(capsys, main, str(config)).startswith(message)
