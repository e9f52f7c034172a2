"""The README's Python API example (the first ```python block under "## Python API"), run exactly as
written from the repository root: it trains three iterations and samples three texts from the policy."""
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def python_api_block(text: str) -> str:
    assert "\n## Python API\n" in text, "README.md: no '## Python API' section"
    section = text.split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "README.md: no ```python block under '## Python API'"
    return blocks[0]


def test_the_example_is_found_short_and_imports_public_names():
    code = python_api_block(README.read_text())
    assert len(code.splitlines()) <= 20  # a README example, not a script
    assert "build_algo()" in code and "algo.train()" in code and "generate(" in code
    compile(code, "README.md", "exec")
    imports = "\n".join(line for line in code.splitlines() if line.startswith(("from ", "import ")))
    exec(imports, {})  # the names it imports exist


@pytest.mark.slow
def test_the_readme_python_api_example_runs_as_written(ray_local, monkeypatch, capsys):
    code = python_api_block(README.read_text())
    monkeypatch.chdir(ROOT)  # the README says: from the repository root
    exec(compile(code, "README.md (Python API)", "exec"), {"__name__": "__main__"})
    lines = capsys.readouterr().out.splitlines()

    # What a user looks at: one line per training iteration (its number and mean episode reward) ...
    iterations = [m.groups() for line in lines if (m := re.fullmatch(r"(\d+) (\S+)", line.strip()))]
    assert [int(i) for i, _ in iterations] == [1, 2, 3], lines
    rewards = [float(r) for _, r in iterations]
    assert all(math.isfinite(r) and 0.0 <= r <= 1.0 for r in rewards), rewards
    assert rewards[-1] > rewards[0], rewards  # two PPO updates moved the policy towards the reward

    # ... and three texts sampled from the trained policy, each with its reward: on the quickstart's task
    # up to 20 number tokens ("0".."49"), scored by the fraction of ascending pairs.
    samples = [m.groups() for line in lines if (m := re.fullmatch(r"\[reward (\d\.\d{3})\] (.*)", line.strip()))]
    assert len(samples) == 3, lines
    for reward, text in samples:
        tokens = text.split()
        assert 0.0 <= float(reward) <= 1.0 and len(tokens) <= 20, (reward, text)
        assert all(t.isdigit() and int(t) < 50 for t in tokens), text
