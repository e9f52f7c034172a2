"""Where a checkpoint keeps its policy, the precisions a loaded policy decodes in and the seeds it
takes: what the command lines (`agents.serve`, `agents.generate`, `agents.export`, `agents.evaluate`)
check of a `--checkpoint`, `--precision` and `--seed` before anything is loaded. The standard library only, so a wrong path is refused
before torch, RLlib or Ray are imported.
"""
from __future__ import annotations

import os

# Where an Algorithm checkpoint keeps the trained policy: RLlib's component names (COMPONENT_LEARNER_GROUP,
# COMPONENT_LEARNER, COMPONENT_RL_MODULE, DEFAULT_MODULE_ID from ray.rllib.core, whose import loads torch
# and RLlib; tests/test_rllib_contract.py checks the two agree).
MODULE_SUBDIR = os.path.join("learner_group", "learner", "rl_module", "default_policy")
PRECISIONS = ("fp32", "bf16")  # a loaded policy's weights while it decodes (generate, serve)
MAX_SEED = 2**31 - 1  # the largest seed a user gives (generate, evaluate, serve); row i samples from seed + i


def find_module_dir(path: str) -> str:
    path = os.path.abspath(os.path.expanduser(path))
    for candidate in (os.path.join(path, MODULE_SUBDIR), path):
        if os.path.isfile(os.path.join(candidate, "module_state.pt")) or os.path.isfile(
            os.path.join(candidate, "module_state.pkl")
        ):
            return candidate
    if not os.path.exists(path):
        raise FileNotFoundError(f"--checkpoint: {path}: no such directory")
    inside = checkpoints_under(path)
    if inside:  # an experiment or trial directory: name its newest checkpoint
        more = f" (and {len(inside) - 1} older)" if len(inside) > 1 else ""
        raise RunDirectoryError(f"--checkpoint: {path} is a run directory, not a checkpoint; its newest checkpoint "
                                f"is {inside[-1]}{more}")
    raise FileNotFoundError(f"--checkpoint: {path} holds no policy (looked for {MODULE_SUBDIR})")


def check_whole(where: str) -> None:
    """Refuses, in one line, the policy directory `where` (from `find_module_dir`) of a checkpoint
    whose policy files are not those its save listed (`agents.whole_files.MANIFEST`: a file cut
    short, changed or missing). The files are read once (their CRC-32)."""
    from agents.whole_files import damaged

    root = where[:-len(MODULE_SUBDIR) - 1] if where.endswith(os.sep + MODULE_SUBDIR) else None
    if root and (why := damaged(root, MODULE_SUBDIR)):
        raise ValueError(f"--checkpoint: {root} is damaged: {why}")


def not_a_model_dir(name) -> str | None:
    """Why `name`, given where a Hugging Face model or tokenizer goes, is a checkpoint or run
    directory of `agents.train` instead (it holds no config.json); None otherwise."""
    if not isinstance(name, str) or not os.path.isdir(path := os.path.expanduser(name)) or os.path.isfile(
            os.path.join(path, "config.json")):
        return None
    try:
        find_module_dir(path)
        what, checkpoint = "a checkpoint", name
    except RunDirectoryError:
        what, checkpoint = "a run directory", checkpoints_under(os.path.abspath(path))[-1]  # its newest
    except FileNotFoundError:
        return None
    return (f"{name} is {what} of agents.train, not a model directory; write its policy out as one with "
            f"`tokenmdp export --checkpoint {checkpoint} --out DIR`")


class RunDirectoryError(FileNotFoundError):
    """A checkpoint was asked for, and the path is a run (experiment or trial) directory holding some."""


def checkpoints_under(path: str) -> list[str]:
    """The checkpoint directories (holding a policy) under `path`, oldest first."""
    found = set()
    for root, dirs, files in os.walk(path):
        if root.endswith(os.sep + MODULE_SUBDIR) and {"module_state.pt", "module_state.pkl"} & set(files):
            found.add(root[:-len(os.sep + MODULE_SUBDIR)])
            dirs.clear()
    return sorted(found, key=lambda d: (os.path.getmtime(d), d))


# A checkpoint's policy is rebuilt from its model.name_or_path (the architecture's config) and reads
# its tokens through the env's tokenizer: where those are local directories, their files are
# fingerprinted into the module's config when a run starts, and a checkpoint whose directories
# are gone or changed (a warm start written again with another vocabulary) is refused in one line
# rather than decoding its token ids through another tokenizer.
BASE_FILES = "base_files"
TOKEN_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "merges.txt",
                "special_tokens_map.json", "added_tokens.json", "spiece.model", "sentencepiece.bpe.model")


# What a save writes that does not change the model or its tokens (transformers' version, where it
# was loaded from, HF_HUB_OFFLINE at the save, the weights' dtype)
_VOLATILE = ("transformers_version", "_name_or_path", "name_or_path", "local_files_only", "is_local", "_commit_hash",
             "torch_dtype", "dtype", "tokenizer_file")


def base_fingerprint(path: str) -> str:
    """A hash of the directory's config and tokenizer files (not its weights); JSON files parsed,
    without the keys a save of the same model and tokens may write differently."""
    import hashlib
    import json

    digest = hashlib.sha256()
    for name in sorted(n for n in os.listdir(path) if n in TOKEN_FILES and os.path.isfile(os.path.join(path, n))):
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        if name.endswith(".json"):
            try:
                parsed = json.loads(data)
                if isinstance(parsed, dict):
                    parsed = {k: v for k, v in parsed.items() if k not in _VOLATILE}
                data = json.dumps(parsed, sort_keys=True).encode()
            except ValueError:
                pass
        digest.update(name.encode() + b"\0" + data + b"\0")
    return digest.hexdigest()


def base_record(*paths) -> dict[str, str]:
    """{directory: fingerprint} of the local directories among `paths` (hub names and None skipped)."""
    return {p: base_fingerprint(p) for p in dict.fromkeys(paths) if isinstance(p, str) and os.path.isdir(p)}


def check_base(model_config: dict) -> None:
    """Refuses (ValueError, one line) a policy whose recorded base directories are gone or changed;
    for a checkpoint from before the record, one whose local model directory is gone."""
    recorded = model_config.get(BASE_FILES)
    if recorded is None:
        name = (model_config.get("model") or {}).get("name_or_path")
        recorded = {name: None} if isinstance(name, str) and os.path.isabs(name) else {}
    for path, fingerprint in recorded.items():
        if not os.path.isdir(path):
            raise ValueError(f"--checkpoint: this policy was trained from {path} (model.name_or_path or "
                             "env.tokenizer), which no longer exists; it is rebuilt with that directory's config "
                             "and reads tokens through its tokenizer: put the directory back")
        if fingerprint is not None and base_fingerprint(path) != fingerprint:
            raise ValueError(f"--checkpoint: {path} (model.name_or_path or env.tokenizer) has changed since this "
                             "policy was trained (its config or tokenizer files differ), so its token ids would be "
                             "read through another vocabulary: restore the directory it was trained from")
