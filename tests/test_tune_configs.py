"""Every file in tune_configs/ validates: experiment configs with agents.config.load, warm-start
configs (pretrain_*.yaml) with agents.pretrain.load_config. Nothing is loaded from the hub."""
import glob
import os

import pytest

from agents.config import algorithm_config, load
from agents.pretrain import load_config
from tests.conftest import ROOT

FILES = sorted(glob.glob(os.path.join(ROOT, "tune_configs", "*.yaml")))


def test_there_are_configs():
    names = {os.path.basename(f) for f in FILES}
    assert {"quickstart.yaml", "sentiment_offline.yaml", "pretrain_reviews.yaml", "gpt2_imdb.yaml",
            "gpt2_commongen.yaml"} <= names


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_config_validates(path):
    if os.path.basename(path).startswith("pretrain_"):
        cfg = load_config(path)
        assert cfg["output_dir"]
    else:
        cfg = load(path)
        algorithm_config(cfg)  # builds the RLlib config too (no model is loaded)
