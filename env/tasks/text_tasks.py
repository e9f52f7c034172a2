"""Real-text tasks: prompts and references from a data set, scored by any reward of env/rewards.

Every task takes the data keys of env/tasks/data.py (`dataset`, `dataset_config`, `splits`,
`split_fractions`, `split_from`, `split_seed`, `max_examples`), its own field names, and
`reward`: a config mapping for `make_reward` (`{name: bleu}`, `{sum: [...]}`); null gives
the task's default. Example:

    task:
      name: commongen
      dataset: {train: data/cg_train.jsonl, validation: data/cg_val.jsonl}
      reward: {sum: [{name: cider_d, weight: 1.0}, {name: bleu, weight: 2.0}]}

Constructing a task checks its config and loads nothing; the data load on the first
`examples(split)` and are cached per process, reward models on the first reward call.
Each example's meta carries the split it came from: a `cider_d` term without
`corpus_references` gets the references of that split as its document set.
"""
from __future__ import annotations

import inspect
import json

from env.rewards import make_reward, references_of
from env.tasks import data as _data
from env.tasks.data import DATA_OPTIONS, DataError, DataSpec, load_rows
from env.validation import ConfigError, Field, check_keywords

_EXAMPLES = _data.BoundedCache(64)  # (task, options, split, file stamps) -> examples, shared by the envs of a process
_REWARDS = _data.BoundedCache(32)  # (reward spec, task, options, split) -> built reward


def _key(value) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _needs_corpus(spec) -> bool:
    if isinstance(spec, str):
        spec = {"name": spec}
    if isinstance(spec, dict) and "sum" in spec:
        return any(_needs_corpus({k: v for k, v in term.items() if k != "weight"}) for term in spec["sum"])
    return isinstance(spec, dict) and spec.get("name") == "cider_d" and spec.get("corpus_references") is None


def _with_corpus(spec, corpus: list):
    """The spec with `corpus_references` set on every cider_d term that lacks it."""
    if isinstance(spec, str):
        spec = {"name": spec}
    if "sum" in spec:
        return {"sum": [{**_with_corpus({k: v for k, v in t.items() if k != "weight"}, corpus), "weight": t["weight"]}
                        for t in spec["sum"]]}
    if spec.get("name") == "cider_d" and spec.get("corpus_references") is None:
        return {**spec, "corpus_references": corpus}
    return spec


def _option(kind, default, **bounds) -> Field:
    return Field(kind, default, optional=default is None, **bounds)


def _options_signature(options: dict) -> inspect.Signature:
    """The keyword-only signature a data task's keys make (a key's Field as its annotation), which
    `check_keywords` checks a task section against, as it checks any task's constructor."""
    return inspect.Signature([inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=field)
                              for k, (d, field) in options.items()])


class DataTask:
    """Shared machinery: option checks, cached examples, the reward per split."""

    name = "data"
    DEFAULT_DATA: dict = {}  # data keys used when `dataset` is not given (the hub set-up)
    OPTIONS: dict[str, Field] = {}  # task key -> its Field (type, default, range)
    FIELD_OPTIONS: tuple = ()  # the OPTIONS keys that name a column

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__init__" not in cls.__dict__:  # a subclass with its own constructor keeps its signature
            cls.__signature__ = _options_signature(cls.known_options())

    @classmethod
    def known_options(cls) -> dict:
        """Every key the task takes: key -> (default, Field or no check) (data keys, its own, `reward`)."""
        return {**{k: (d, inspect.Parameter.empty) for k, d in DATA_OPTIONS.items()},
                **{k: (f.default, f) for k, f in cls.OPTIONS.items()}, "reward": (None, inspect.Parameter.empty)}

    def __init__(self, **options):
        options = check_keywords(_options_signature(self.known_options()), options, "task", f"task {self.name!r}")
        opts = {k: d for k, (d, _) in self.known_options().items()} | options
        if opts["dataset"] is None:
            if not self.DEFAULT_DATA:
                raise ConfigError(f"task.dataset: missing (task {self.name!r} has no default data set; give a "
                                  f"hub name, a file, or {{train: path, validation: path, test: path}})")
            opts.update({k: v for k, v in self.DEFAULT_DATA.items() if options.get(k) is None})
        for key in self.OPTIONS:
            _check_option(key, opts[key])
        self.options = opts
        self.data = DataSpec.parse(opts)
        self._reward_given = opts["reward"] is not None
        self.reward_spec = opts["reward"] if self._reward_given else self.default_reward()
        make_reward(self.reward_spec, path="task.reward")  # checks the spec now; loads no model
        self._cache_key = (self.name, _key({k: v for k, v in opts.items() if k != "reward"}))
        self._first_split = None

    # -- the task interface --------------------------------------------------------------

    def tokenizer(self):
        return None  # the model's (env.tokenizer or model.name_or_path)

    def examples(self, split: str = "train") -> list[dict]:
        key = (*self._cache_key, split, _data.stamps(self.data))  # a file changed in place is read again
        if key not in _EXAMPLES:
            examples = self.build(split)
            for ex in examples:
                ex["meta"]["split"] = split
            _EXAMPLES[key] = examples
        if self._first_split is None:
            self._first_split = split
        return _EXAMPLES[key]

    def reward(self, prompts, generations, metas) -> list[float]:
        metas = [m or {} for m in metas]
        splits = [m.get("split") or self._first_split or "train" for m in metas]
        if len(set(splits)) == 1:
            return self.reward_for(splits[0])(prompts, generations, metas)
        out = [0.0] * len(generations)
        for split in set(splits):
            idx = [i for i, s in enumerate(splits) if s == split]
            values = self.reward_for(split)([prompts[i] for i in idx], [generations[i] for i in idx],
                                            [metas[i] for i in idx])
            for i, v in zip(idx, values):
                out[i] = v
        return out

    def targets(self, example: dict) -> list[str]:
        """Reference continuations of an example's prompt (for the MLE term of the RL loss)."""
        return references_of(example["meta"])

    def reward_for(self, split: str):
        """The built reward for examples of `split` (cached per process)."""
        needs = _needs_corpus(self.reward_spec)
        key = (_key(self.reward_spec), *self._cache_key, split if needs else None)
        if key not in _REWARDS:
            spec = self.reward_spec
            if needs:
                spec = _with_corpus(spec, [references_of(ex["meta"]) for ex in self.examples(split)])
            _REWARDS[key] = make_reward(spec, path="task.reward")
        return _REWARDS[key]

    # -- for subclasses ------------------------------------------------------------------------

    def default_reward(self) -> dict:
        raise NotImplementedError

    def build(self, split: str) -> list[dict]:
        raise NotImplementedError

    def rows(self, split: str, fields: list[str], text_fields=(), list_fields=(), group_field=None):
        names = {self.options[k]: k for k in self.FIELD_OPTIONS if self.options.get(k) is not None}
        wanted = {f: names.get(f, "meta_fields") for f in fields}
        return load_rows(self.data, split, fields=wanted, text_fields=text_fields, list_fields=list_fields,
                         group_field=group_field)

    def _wrap(self, text: str) -> str:
        return f"{self.options['prompt_prefix']}{text}{self.options['prompt_suffix']}"


def _check_option(key: str, value) -> None:
    """What a key's Field (checked by `check_keywords`) leaves: a field name is not empty, a list
    of fields holds names."""
    if key.endswith("_field") and value == "":
        raise ConfigError(f"task.{key}: expected a field name, got ''")
    if isinstance(value, list) and not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"task.{key}: expected a list of field names, got {value!r}")


def _cut_words(text: str, n: int | None) -> str:
    return text if n is None else " ".join(text.split()[:n])


class ImdbTask(DataTask):
    """IMDB sentiment continuation (GRUE / RLGF): continue a review's beginning, positively.

    Data: IMDB format, fields `text_field` ("text") and `label_field` ("label"). Default data:
    the hub's stanfordnlp/imdb with train = its train split and validation/test = 20% each of its
    (shuffled) test split, 25k/5k/5k as in GRUE. The prompt is the review's first `prompt_words`
    words (48, about 64 GPT-2 tokens; null keeps the whole review), with `<br />` breaks turned
    into spaces (`strip_html`); the env then cuts it to max_prompt_len tokens: set
    env.truncation_side: right so that a cut keeps the review's beginning (GRUE: 64 tokens,
    max_new_tokens 48). meta: label, review (the full text).

    Default reward: {name: sentiment}: P(positive) of a classifier when `model` is set (the
    paper's set-up, e.g. {name: sentiment, model: lvwerra/distilbert-imdb}), else VADER offline.
    """

    name = "imdb"
    DEFAULT_DATA = {"dataset": "stanfordnlp/imdb", "split_from": "test",
                    "split_fractions": {"validation": 0.2, "test": 0.2}}
    OPTIONS = {"text_field": _option(str, "text"), "label_field": _option(str, "label"),
               "prompt_words": Field(int, 48, lo=1, optional=True), "strip_html": _option(bool, True)}
    FIELD_OPTIONS = ("text_field", "label_field")

    def default_reward(self):
        return {"name": "sentiment"}

    def build(self, split):
        text_f, label_f = self.options["text_field"], self.options["label_field"]
        out = []
        for row in self.rows(split, [text_f, label_f], text_fields=(text_f,)):
            review = row[text_f]
            if self.options["strip_html"]:
                review = review.replace("<br />", " ").replace("<br/>", " ").replace("<br>", " ")
            out.append({"prompt": _cut_words(review, self.options["prompt_words"]),
                        "meta": {"label": row[label_f], "review": row[text_f]}})
        return out

    def targets(self, example):
        """The rest of the review after the prompt's words (none when the prompt is all of it)."""
        review = example["meta"]["review"]
        if self.options["strip_html"]:
            review = review.replace("<br />", " ").replace("<br/>", " ").replace("<br>", " ")
        words, n = review.split(), self.options["prompt_words"]
        return [" " + " ".join(words[n:])] if n is not None and len(words) > n else []


class CommonGenTask(DataTask):
    """CommonGen (GRUE / RLGF): write one sentence using a set of concepts.

    Data: the hub's allenai/common_gen format, one row per (concept set, target): fields
    `group_field` ("concept_set_idx"), `concepts_field` ("concepts", a list; a string is split
    on commas or spaces) and `target_field` ("target"). Rows are grouped by concept set: one
    example per set, its references all the set's targets (split fractions and max_examples
    count sets). Prompt: `prompt_prefix` + the concepts joined by `concept_separator`, e.g.
    "Generate a sentence with: dog frisbee catch throw". (The hub test split has no targets;
    use validation.) meta: concepts, references, concept_set_idx.

    Default reward: {name: cider_d}, given the split's references as its document set. RLGF
    optimises SPIDEr = CIDEr-D + SPICE; SPICE needs Java, so CIDEr-D is the half that runs
    here; it rewards the consensus n-grams of all references, weighted by rarity, where
    sentence BLEU on ~10-word sentences is mostly smoothing.
    """

    name = "commongen"
    DEFAULT_DATA = {"dataset": "allenai/common_gen"}
    OPTIONS = {"concepts_field": _option(str, "concepts"), "target_field": _option(str, "target"),
               "group_field": Field(str, "concept_set_idx", optional=True),
               "prompt_prefix": _option(str, "Generate a sentence with: "), "prompt_suffix": _option(str, ""),
               "concept_separator": _option(str, " ")}
    FIELD_OPTIONS = ("concepts_field", "target_field", "group_field")

    def default_reward(self):
        return {"name": "cider_d"}

    def build(self, split):
        o = self.options
        c_f, t_f, g_f = o["concepts_field"], o["target_field"], o["group_field"]
        fields = [c_f, t_f] + ([g_f] if g_f else [])
        rows = self.rows(split, fields, text_fields=(t_f,), list_fields=(c_f,), group_field=g_f or c_f)
        groups: dict = {}
        for row in rows:
            key = _key(row[g_f] if g_f else sorted(row[c_f]))
            if key not in groups:
                groups[key] = {"concepts": row[c_f], "references": [],
                               **({"concept_set_idx": row[g_f]} if g_f else {})}
            groups[key]["references"].append(row[t_f])
        return [{"prompt": self._wrap(o["concept_separator"].join(meta["concepts"])), "meta": meta}
                for meta in groups.values()]


class DialogueTask(DataTask):
    """Dialogue: answer a source utterance (context) with a response.

    Data: source -> response pairs, fields `source_field` ("source") and `response_field`
    ("response"); no default data set (give `dataset`). Prompt: `prompt_prefix` + source +
    `prompt_suffix`. meta: source (for the MMI reward), reference (the response).

    Default reward: {name: bleu}: sentence BLEU against the response, 0-1, the reward of the
    dialogue RL set-up this project follows (alongside MMI, perplexity, cosine: give them as a sum).
    """

    name = "dialogue"
    OPTIONS = {"source_field": _option(str, "source"), "response_field": _option(str, "response"),
               "prompt_prefix": _option(str, ""), "prompt_suffix": _option(str, "")}
    FIELD_OPTIONS = ("source_field", "response_field")

    def default_reward(self):
        return {"name": "bleu"}

    def build(self, split):
        s_f, r_f = self.options["source_field"], self.options["response_field"]
        return [{"prompt": self._wrap(row[s_f]), "meta": {"source": row[s_f], "reference": row[r_f]}}
                for row in self.rows(split, [s_f, r_f], text_fields=(s_f, r_f))]


class SummarizationTask(DataTask):
    """Summarization: article -> summary (CNN/DailyMail by default).

    Data: fields `article_field` ("article") and `summary_field` ("highlights"); default data:
    the hub's abisee/cnn_dailymail, configuration 3.0.0, with its train/validation/test splits.
    Prompt: `prompt_prefix` + the article's first `article_words` words (null: all) +
    `prompt_suffix` (" TL;DR:", the zero-shot cue for causal LMs). The env's default
    truncation_side (left) keeps the suffix and the article's end; set article_words so the
    prompt fits max_prompt_len to keep its beginning. meta: source (the article), reference.

    Default reward: {name: rouge}: ROUGE-L F1 (0-1) against the highlights, the standard
    summarization metric and bounded like the other rewards.
    """

    name = "summarization"
    DEFAULT_DATA = {"dataset": "abisee/cnn_dailymail", "dataset_config": "3.0.0"}
    OPTIONS = {"article_field": _option(str, "article"), "summary_field": _option(str, "highlights"),
               "prompt_prefix": _option(str, ""), "prompt_suffix": _option(str, " TL;DR:"),
               "article_words": _option(int, None, lo=1)}
    FIELD_OPTIONS = ("article_field", "summary_field")

    def default_reward(self):
        return {"name": "rouge"}

    def build(self, split):
        a_f, s_f = self.options["article_field"], self.options["summary_field"]
        return [{"prompt": self._wrap(_cut_words(row[a_f], self.options["article_words"])),
                 "meta": {"source": row[a_f], "reference": row[s_f]}}
                for row in self.rows(split, [a_f, s_f], text_fields=(a_f, s_f))]


class TextTask(DataTask):
    """Any prompts from local JSONL/CSV/Parquet (or a hub data set), with any reward.

    Fields: `prompt_field` ("prompt"); `reference_field` (optional: a string, or a list of
    strings, giving meta["references"]); `source_field` (optional: meta["source"] for MMI);
    `meta_fields` (columns copied into meta under their names). Prompt: `prompt_prefix` +
    the prompt + `prompt_suffix`.

    Default reward: {name: bleu} when `reference_field` is set; without references there is
    no sensible default, so `reward` must be given (e.g. {name: vader}).
    """

    name = "text"
    OPTIONS = {"prompt_field": _option(str, "prompt"), "reference_field": _option(str, None),
               "source_field": _option(str, None), "meta_fields": _option(list, None),
               "prompt_prefix": _option(str, ""), "prompt_suffix": _option(str, "")}
    FIELD_OPTIONS = ("prompt_field", "reference_field", "source_field")

    def default_reward(self):
        if self.options["reference_field"] is None:
            raise ValueError("task.reward: missing (the text task without reference_field has no default "
                             "reward; give one, e.g. {name: vader})")
        return {"name": "bleu"}

    def build(self, split):
        o = self.options
        p_f, r_f, s_f = o["prompt_field"], o["reference_field"], o["source_field"]
        extra = [f for f in (o["meta_fields"] or []) if f not in (p_f, r_f, s_f)]
        fields = [p_f] + [f for f in (r_f, s_f) if f] + extra
        text_fields = [p_f] + ([s_f] if s_f else [])
        rows = self.rows(split, fields, text_fields=text_fields, list_fields=(), group_field=None)
        out = []
        for i, row in enumerate(rows):
            meta = {f: row[f] for f in extra}
            if r_f:
                refs = [row[r_f]] if isinstance(row[r_f], str) else row[r_f]
                if not isinstance(refs, list) or not refs or not all(isinstance(r, str) and r.strip() for r in refs):
                    raise DataError(f"{_where(self.data, split)}: row {i + 1}: field {r_f!r} must be a non-empty "
                                    f"text or list of texts, got {row[r_f]!r}")
                meta["references"] = list(refs)
            if s_f:
                meta["source"] = row[s_f]
            out.append({"prompt": self._wrap(row[p_f]), "meta": meta})
        return out


def clear_cache() -> None:
    """Forgets loaded data, built examples and rewards (tests)."""
    _data.clear_cache()
    _EXAMPLES.clear()
    _REWARDS.clear()


def _where(spec: DataSpec, split: str) -> str:
    if isinstance(spec.dataset, tuple):
        return dict(spec.dataset).get(split, str(dict(spec.dataset)))
    return f"{spec.dataset} (split {split!r})"


TEXT_TASKS = {cls.name: cls for cls in (ImdbTask, CommonGenTask, DialogueTask, SummarizationTask, TextTask)}
