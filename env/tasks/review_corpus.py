"""A small templated movie-review corpus in IMDB format, for offline warm starts and demos.

Every review is two or three short sentences ("the acting was very good .", "i hated
it ."), each positive or negative on its own, so most reviews mix both. The label is 1
when positive sentences are the majority. The vocabulary is closed (about 70 words,
every token separated by a space), so a word-level tokenizer covers it exactly, and
VADER scores its sentiment words. Deterministic for a given seed.

    python -m env.tasks.review_corpus OUT_DIR [--seed 0]   # writes train/validation/test.jsonl
"""
from __future__ import annotations

import json
import os
import random
import sys

SUBJECTS = ["the film", "the movie", "the story", "the acting", "the plot", "the ending", "the cast",
            "the music", "the script", "the director"]
VERBS = ["was", "is", "felt"]
ADJECTIVES = {
    True: ["great", "wonderful", "excellent", "beautiful", "fun", "brilliant", "good", "amazing", "lovely"],
    False: ["bad", "awful", "boring", "terrible", "dull", "poor", "horrible", "weak", "stupid"],
}
MODIFIERS = ["", "very", "really", "quite"]
CLOSERS = {
    True: ["i loved it .", "highly recommended .", "a joy to watch .", "i enjoyed every minute ."],
    False: ["i hated it .", "a waste of time .", "not worth watching .", "i was so disappointed ."],
}
SIZES = {"train": 4000, "validation": 200, "test": 200}


def review(rng: random.Random) -> tuple[str, int]:
    """One review and its label (1: mostly positive)."""
    sentences, positive = [], 0
    for i in range(rng.choice([2, 3])):
        good = rng.random() < 0.5
        positive += good
        if i > 0 and rng.random() < 0.3:
            sentences.append(rng.choice(CLOSERS[good]))
            continue
        words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(MODIFIERS), rng.choice(ADJECTIVES[good]), "."]
        sentences.append(" ".join(w for w in words if w))
    return " ".join(sentences), int(2 * positive > len(sentences))


def review_corpus(n: int, seed: int = 0) -> list[dict]:
    """`n` reviews as `{"text", "label"}` rows."""
    rng = random.Random(seed)
    return [dict(zip(("text", "label"), review(rng))) for _ in range(n)]


def vocabulary() -> list[str]:
    """Every word a review can contain, sorted."""
    texts = SUBJECTS + VERBS + MODIFIERS + [w for v in ADJECTIVES.values() for w in v]
    texts += [c for v in CLOSERS.values() for c in v] + ["."]
    return sorted({w for t in texts for w in t.split()})


def write_review_corpus(out_dir: str, seed: int = 0, sizes: dict | None = None) -> dict:
    """Writes `<out_dir>/{train,validation,test}.jsonl`; returns {split: path}. Splits use distinct seeds."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for i, (split, n) in enumerate((sizes or SIZES).items()):
        paths[split] = os.path.join(out_dir, f"{split}.jsonl")
        with open(paths[split], "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in review_corpus(n, seed=seed * 1000 + i))
    return paths


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m env.tasks.review_corpus", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for split, path in write_review_corpus(args.out_dir, args.seed).items():
        print(f"{split}: {path}")
    sys.exit(0)
