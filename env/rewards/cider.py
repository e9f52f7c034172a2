"""CIDEr-D (Vedantam et al. 2015), pure Python, against `meta["references"]`.

For a candidate c with references s_1..s_m and n-gram orders n = 1..N (N = 4):

    g^n(x)[w] = count_x(w) * log(|D| / max(1, df(w)))     TF-IDF of each n-gram w
    CIDEr-D_n = 10/m * sum_j exp(-(l(c) - l(s_j))^2 / (2 sigma^2))
                       * <min(g^n(c), g^n(s_j)), g^n(s_j)> / (|g^n(c)| |g^n(s_j)|)
    CIDEr-D   = (1/N) sum_n CIDEr-D_n

df(w) is the number of documents (reference sets) among D that contain w; l(x)
is the length in words; sigma = 6; the min clips the candidate's weights by the
reference's; a zero-norm vector contributes 0. As in the authors' code
(coco-caption's `cider_scorer.py`), term frequencies are raw counts (the paper
divides them by the n-gram total, which only matters through the clipping).

The document set D is `corpus_references` (a list with one list of references
per example, e.g. the training split's) when given, else the references of the
scored batch, which is what coco-caption does with the evaluated corpus. A
batch's score then depends on the batch, and a batch of one is 0 by definition,
so that is refused: the env scores episodes one at a time, so training needs
`corpus_references`. Text is lowercased and punctuation turned into spaces
before splitting on whitespace, an approximation of coco-caption's Java PTB
tokenizer; `lowercase` / `strip_punctuation` turn these off.
"""
from __future__ import annotations

import math
import re
from collections import Counter

from env.rewards.base import FieldError, check_field, check_positive, references_of, register

_PUNCT = re.compile(r"[^\w\s]")


def tokenize(text: str, lowercase: bool = True, strip_punctuation: bool = True) -> list[str]:
    if lowercase:
        text = text.lower()
    if strip_punctuation:
        text = _PUNCT.sub(" ", text)
    return text.split()


def ngram_counts(words: list[str], n: int) -> Counter:
    return Counter(tuple(words[i:i + k]) for k in range(1, n + 1) for i in range(len(words) - k + 1))


def document_frequency(reference_sets: list[list[Counter]]) -> Counter:
    df = Counter()
    for refs in reference_sets:
        df.update(set(w for counts in refs for w in counts))
    return df


def _tfidf(counts: Counter, df: Counter, log_docs: float, n: int):
    vec = [dict() for _ in range(n)]
    for w, tf in counts.items():
        vec[len(w) - 1][w] = tf * (log_docs - math.log(max(1.0, df[w])))
    norms = [math.sqrt(sum(v * v for v in order.values())) for order in vec]
    return vec, norms


def cider_d(candidate: Counter, cand_len: int, references: list[tuple[Counter, int]], df: Counter,
            num_docs: int, n: int = 4, sigma: float = 6.0) -> float:
    log_docs = math.log(float(num_docs))
    vc, nc = _tfidf(candidate, df, log_docs, n)
    total = 0.0
    for ref_counts, ref_len in references:
        vr, nr = _tfidf(ref_counts, df, log_docs, n)
        penalty = math.exp(-((cand_len - ref_len) ** 2) / (2 * sigma ** 2))
        for k in range(n):
            if nc[k] == 0 or nr[k] == 0:
                continue
            dot = sum(min(v, vr[k].get(w, 0.0)) * vr[k].get(w, 0.0) for w, v in vc[k].items())
            total += penalty * dot / (nc[k] * nr[k])
    return 10.0 * total / n / len(references)


@register("cider_d")
class CiderD:
    """CIDEr-D with n=4, sigma=6 by default; 0 for no overlap, typically 0-10 (not capped)."""

    name = "cider_d"
    higher_is_better = True

    def __init__(self, n: int = 4, sigma: float = 6.0, lowercase: bool = True, strip_punctuation: bool = True,
                 corpus_references: list | None = None):
        check_field("n", n, int, lo=1)
        check_positive("sigma", sigma)
        self.n, self.sigma, self.lowercase, self.strip_punctuation = n, sigma, lowercase, strip_punctuation
        self._corpus = None
        if corpus_references is not None:
            if not isinstance(corpus_references, list) or not corpus_references:
                raise FieldError("corpus_references", "expected a non-empty list of reference lists")
            sets = [[r] if isinstance(r, str) else r for r in corpus_references]
            if not all(isinstance(s, list) and s and all(isinstance(r, str) for r in s) for s in sets):
                raise FieldError("corpus_references", "expected a list of (lists of) reference strings")
            self._corpus = (document_frequency([[self._counts(r)[0] for r in s] for s in sets]), len(sets))

    def _counts(self, text: str) -> tuple[Counter, int]:
        words = tokenize(text, self.lowercase, self.strip_punctuation)
        return ngram_counts(words, self.n), len(words)

    def __call__(self, prompts, generations, metas):
        refs = [[self._counts(r) for r in references_of(m)] for m in metas]
        if self._corpus is not None:
            df, num_docs = self._corpus
        else:
            if len(refs) == 1:
                raise ValueError("CIDEr-D of a single example without corpus_references is 0 by definition "
                                 "(every n-gram is in all documents, so idf is 0); give corpus_references")
            df, num_docs = document_frequency([[c for c, _ in rs] for rs in refs]), len(refs)
        out = []
        for text, rs in zip(generations, refs):
            counts, length = self._counts(text)
            out.append(cider_d(counts, length, rs, df, num_docs, self.n, self.sigma))
        return out
