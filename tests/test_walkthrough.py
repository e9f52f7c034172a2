"""The README's walkthrough ("Your data, your reward, your task") as a user runs it, and the docs' links.

The walkthrough test takes the shell commands from the README's fenced ```bash blocks between
`<!-- walkthrough:begin -->` and `<!-- walkthrough:end -->`, runs exactly those in a copy of the
repository (so results/ and the trial directories are the copy's), and checks that each exits 0
and prints what the README shows after it: every line of the ```text block that follows, with
numbers free, `...` standing for any text and sampled generations free, in that order.
"""
import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BEGIN, END = "<!-- walkthrough:begin -->", "<!-- walkthrough:end -->"
NUMBER = r"-?[\d,]*\.?\d+"


def walkthrough_steps(text: str) -> list[tuple[str, list[str]]]:
    """(command, the README's output lines for it) for every command in the walkthrough's bash blocks."""
    assert text.count(BEGIN) == 1 and text.count(END) == 1, "README.md: walkthrough markers missing"
    section = text[text.index(BEGIN):text.index(END)]
    blocks = re.findall(r"```(\w*)\n(.*?)```", section, flags=re.S)
    steps = []
    for i, (lang, body) in enumerate(blocks):
        if lang != "bash":
            continue
        lines = body.replace("\\\n", " ").splitlines()
        commands = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
        shown = blocks[i + 1][1].splitlines() if i + 1 < len(blocks) and blocks[i + 1][0] == "text" else []
        for j, command in enumerate(commands):
            steps.append((command, shown if j == len(commands) - 1 else []))
    return steps


def line_pattern(line: str) -> re.Pattern:
    """The README's output line with its numbers, trial ids and spacing free and `...` as a wildcard."""
    if re.match(r"\s*\[reward [\d.]+\] ", line):  # a sampled generation: any text
        return re.compile(r"\[reward " + NUMBER + r"\] \S")
    line = re.sub(r"[0-9a-f]{5}_\d{5}", "...", line.strip())  # Tune's trial id
    parts = []
    for piece in re.split(r"(\.\.\.|" + NUMBER + ")", line):
        if piece == "...":
            parts.append(".*")
        elif re.fullmatch(NUMBER, piece or "x"):
            parts.append(NUMBER)
        else:
            parts.append(re.sub(r"(\\ )+", r"\\s+", re.escape(piece)))
    return re.compile("".join(parts))


def assert_shows(output: str, shown: list[str], command: str) -> None:
    lines = output.splitlines()
    at = 0
    for want in shown:
        pattern = line_pattern(want)
        while at < len(lines) and not pattern.search(lines[at]):
            at += 1
        assert at < len(lines), f"{command!r}: no output line like the README's {want!r} (in order)\n" + \
            "\n".join(lines[-40:])
        at += 1


def test_the_walkthrough_steps_are_found():
    steps = walkthrough_steps(README.read_text())
    commands = [c for c, _ in steps]
    assert any("tokenmdp pretrain" in c for c in commands)
    assert any("tokenmdp train examples/custom_reward" in c for c in commands)
    assert any("tokenmdp evaluate" in c for c in commands)
    assert any("tokenmdp train examples/custom_task" in c for c in commands)
    assert all(shown for c, shown in steps if "tokenmdp" in c), "every step shows its output"
    # The matcher frees numbers, not words.
    assert line_pattern("iter   20  steps    14,349  reward 0.944").search("iter 3  steps 1,234  reward -0.5")
    assert not line_pattern("saved model and tokenizer to .../warm_start").search("saved model to x/warm_start")
    assert line_pattern("  trial c84a8_00000: mean episode reward 0.291").search("trial 7b752_00000: mean episode reward 1")
    assert not line_pattern("| PPO | 40 | 0.8750 |").search("| warm start | 40 | 0.8750 |")


@pytest.mark.slow
def test_the_readme_walkthrough_runs_as_shown(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, symlinks=True, ignore=shutil.ignore_patterns(
        ".venv", ".git", "results", "__pycache__", ".pytest_cache", "*.pyc"))
    venv = ROOT / ".venv"
    if venv.exists():
        (repo / ".venv").symlink_to(venv)
    else:  # the test runs from some other interpreter: the README's `.venv/bin/tokenmdp` is that one's
        (repo / ".venv" / "bin").mkdir(parents=True)
        (repo / ".venv" / "bin" / "python").symlink_to(sys.executable)
        command = repo / ".venv" / "bin" / "tokenmdp"
        command.write_text(f'#!/bin/sh\nexec {sys.executable} -m agents.cli "$@"\n')
        command.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}  # as a user's shell
    env["HF_HUB_OFFLINE"] = "1"
    for command, shown in walkthrough_steps(README.read_text()):
        run = subprocess.run(["bash", "-c", command], cwd=repo, env=env, capture_output=True, text=True,
                             timeout=900)
        output = run.stdout + run.stderr
        assert run.returncode == 0, f"{command!r} exited {run.returncode}:\n{output[-4000:]}"
        assert_shows(output, shown, command)

    results = repo / "results" / "custom_reward"
    assert (results / "warm_start" / "config.json").is_file()
    checkpoints = list((results / "ppo").glob("*/checkpoint_000000"))
    assert len(checkpoints) == 1 and any(checkpoints[0].iterdir())
    with open(results / "evaluation" / "evaluation.csv") as f:
        rows = {row["model"]: row for row in csv.DictReader(f)}
    metric = "examples.custom_reward.keyword_reward:keyword_reward"
    assert float(rows["PPO"][metric]) > float(rows["warm start"][metric]) + 0.2, rows
    assert list((repo / "results" / "custom_task" / "ppo").glob("*/checkpoint_000000"))


# -- links ------------------------------------------------------------------------------------

def doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def test_every_relative_link_in_the_docs_points_to_a_file():
    broken, checked = [], 0
    for doc in doc_files():
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # code blocks hold no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            checked += 1
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)
    assert checked > 20  # the pattern still finds the docs' links
    assert len(doc_files()) > 5


def test_the_readme_stays_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert "make test" in text  # .ci/run runs the README's test command
