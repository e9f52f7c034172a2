"""Data sets for the text tasks, loaded through the `datasets` library.

A task's config names its data with these keys (all tasks share them):

    dataset          a hub name ("stanfordnlp/imdb"), a local file (.jsonl/.json/.csv/.tsv/.parquet),
                     a directory (one written by `save_to_disk`, or a folder of data files), or a
                     mapping {train: path, validation: path, test: path} with one file per split
    dataset_config   the hub data set's configuration (e.g. "3.0.0" for cnn_dailymail)
    splits           renames: {validation: dev} reads our split "validation" from the source's "dev"
    split_fractions  carve splits by a seeded shuffle, e.g. {train: 0.8, validation: 0.1, test: 0.1};
                     this is the default for a single file (or a single saved Dataset)
    split_from       the source split the fractions carve (default: the single file, else "train");
                     splits not in split_fractions are read from the source by name
    split_seed       seed of the shuffle (0); also picks the max_examples subset
    max_examples     keep at most this many examples per split (an int, or {train: 1000, test: 100}):
                     a seeded subset in the data's order (rows, or groups for grouped tasks)

The hub and local directories go through `datasets.load_dataset(name)`, local files through
its json/csv/parquet builders, saved directories through `datasets.load_from_disk`. Nothing
is downloaded unless a hub name is given (HF_HUB_OFFLINE=1 stops that too).

Malformed data stops with one `DataError` line naming the file (or hub split) and the field:
a missing field, an empty split, an empty text, non-UTF-8 bytes, a file that cannot be read.
Loaded splits are cached per process (keyed by the spec and the files' size and mtime).
"""
from __future__ import annotations

import codecs
import collections
import csv
import difflib
import json
import os
from dataclasses import dataclass

import numpy as np

from env.validation import written_as_path

SPLITS = ("train", "validation", "test")
DEFAULT_FRACTIONS = (("train", 0.8), ("validation", 0.1), ("test", 0.1))
FILE_TYPES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}
TEXT_TYPES = ("json", "csv")
DATA_OPTIONS = {  # config key -> default
    "dataset": None, "dataset_config": None, "splits": None, "split_fractions": None,
    "split_from": None, "split_seed": 0, "max_examples": None,
}


class DataError(ValueError):
    """Malformed or unreadable data: one line naming the file (or hub split) and the field."""


# -- the spec ------------------------------------------------------------------------------

@dataclass(frozen=True)
class DataSpec:
    dataset: str | tuple  # a name or path, or ((split, path), ...)
    config: str | None = None
    renames: tuple = ()  # ((our split, source split), ...)
    fractions: tuple | None = None  # ((split, fraction), ...) in canonical order
    split_from: str | None = None
    seed: int = 0
    max_examples: int | tuple | None = None  # an int for every split, or ((split, n), ...)

    @classmethod
    def parse(cls, options: dict, path: str = "task") -> "DataSpec":
        """Checks the data keys of a task config (see the module docstring); ValueError names the key."""
        ds = options.get("dataset")
        if isinstance(ds, dict):
            if not ds:
                raise ValueError(f"{path}.dataset: the mapping of split -> file is empty")
            for split, file in ds.items():
                if not isinstance(file, str) or not file.strip():
                    raise ValueError(f"{path}.dataset.{split}: expected a file path, got {file!r}")
            dataset = tuple((str(k), os.path.expanduser(v)) for k, v in ds.items())
        elif isinstance(ds, str) and ds.strip():
            dataset = os.path.expanduser(ds) if _looks_local(ds) else ds
        else:
            raise ValueError(f"{path}.dataset: expected a hub name, a local path or a mapping "
                             f"{{train: path, validation: path, test: path}}, got {ds!r}")
        config = options.get("dataset_config")
        if config is not None and not isinstance(config, str):
            raise ValueError(f"{path}.dataset_config: expected a string, got {config!r}")
        renames = _str_mapping(options.get("splits"), f"{path}.splits")
        fractions = options.get("split_fractions")
        if fractions is not None:
            if not isinstance(fractions, dict) or not fractions:
                raise ValueError(f"{path}.split_fractions: expected a mapping like {{train: 0.8, validation: 0.1, "
                                 f"test: 0.1}}, got {fractions!r}")
            for split, frac in fractions.items():
                if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 1:
                    raise ValueError(f"{path}.split_fractions.{split}: expected a number in (0, 1], got {frac!r}")
            if sum(fractions.values()) > 1 + 1e-9:
                raise ValueError(f"{path}.split_fractions: the fractions add up to {sum(fractions.values()):g} > 1")
            order = [s for s in SPLITS if s in fractions] + sorted(s for s in fractions if s not in SPLITS)
            fractions = tuple((str(s), float(fractions[s])) for s in order)
        split_from = options.get("split_from")
        if split_from is not None and not isinstance(split_from, str):
            raise ValueError(f"{path}.split_from: expected a split name, got {split_from!r}")
        if split_from is not None and fractions is None:
            raise ValueError(f"{path}.split_from: only applies with split_fractions")
        seed = options.get("split_seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"{path}.split_seed: expected an integer >= 0, got {seed!r}")
        limit = options.get("max_examples")
        if isinstance(limit, dict):
            for split, n in limit.items():
                _check_limit(f"{path}.max_examples.{split}", n)
            limit = tuple(sorted((str(k), int(v)) for k, v in limit.items()))
        elif limit is not None:
            _check_limit(f"{path}.max_examples", limit)
        return cls(dataset, config, renames, fractions, split_from, seed, limit)

    def limit(self, split: str) -> int | None:
        if isinstance(self.max_examples, tuple):
            return dict(self.max_examples).get(split)
        return self.max_examples


def _check_limit(path: str, n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{path}: expected an integer >= 1, got {n!r}")


def _str_mapping(value, path: str) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(isinstance(v, str) and v for v in value.values()):
        raise ValueError(f"{path}: expected a mapping of split -> source split name, got {value!r}")
    return tuple(sorted((str(k), v) for k, v in value.items()))


def _looks_local(name: str) -> bool:
    """A local path (existing, or written like one); anything else is a hub name."""
    if os.path.exists(os.path.expanduser(name)):
        return True
    return written_as_path(name) or os.path.splitext(name)[1].lower() in FILE_TYPES


# -- reading -----------------------------------------------------------------------------------

class BoundedCache(collections.OrderedDict):
    """A dict that keeps its `maxsize` most recently stored or read entries. Cache keys include the
    files' size and mtime, so a data file rewritten during a long run adds a key each time; the
    oldest are dropped instead of accumulating for the life of the process."""

    def __init__(self, maxsize: int):
        super().__init__()
        self.maxsize = maxsize

    def __getitem__(self, key):
        value = super().__getitem__(key)
        self.move_to_end(key)
        return value

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.maxsize:
            self.popitem(last=False)


_DATASETS = BoundedCache(16)  # source key -> Dataset or {split: Dataset}
_ROWS = BoundedCache(64)  # (spec, split, columns, stamps) -> rows


def file_stamp(path: str):  # (path, size, mtime), or (path, None, None): a cache key's part
    try:
        st = os.stat(path)
        return (path, st.st_size, st.st_mtime_ns)
    except OSError:
        return (path, None, None)


def stamps(spec: "DataSpec") -> tuple:
    """(path, size, mtime) of the spec's local paths: part of every cache key."""
    paths = [p for _, p in spec.dataset] if isinstance(spec.dataset, tuple) else [spec.dataset]
    return tuple(file_stamp(p) for p in paths if _looks_local(p))


def _first_line(error: BaseException) -> str:
    """The innermost cause's message, on one line."""
    seen = set()
    while True:
        nxt = error.__cause__ or error.__context__
        if nxt is None or id(nxt) in seen:
            break
        seen.add(id(error))
        error = nxt
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class _quiet:
    """Turns off datasets' progress bars and logs (the CLI prints errors as one line)."""

    def __enter__(self):
        import datasets

        self.bars = datasets.is_progress_bar_enabled()
        self.level = datasets.logging.get_verbosity()
        datasets.disable_progress_bars()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors are re-raised as DataError

    def __exit__(self, *exc):
        import datasets

        if self.bars:
            datasets.enable_progress_bars()
        datasets.logging.set_verbosity(self.level)


def _first_bad_json_line(path: str) -> str | None:
    """Where a JSON file that datasets refused goes wrong, as "line N ...", or None if every line
    parses. JSON Lines (any .jsonl; a .json whose first line is an object) are read line by line:
    the first line that is not a JSON object; one JSON document: where it stops parsing."""
    import json

    with open(path, encoding="utf-8") as f:
        lines = [(n, line.rstrip("\r\n")) for n, line in enumerate(f, 1) if line.strip()]

    def parse(text):
        try:
            return json.loads(text), None
        except json.JSONDecodeError as e:
            return None, e

    first, _ = parse(lines[0][1]) if lines else (None, None)
    if not path.lower().endswith(".jsonl") and not isinstance(first, dict):  # one document
        _, error = parse("\n".join(line for _, line in lines))
        return None if error is None else \
            f"line {lines[error.lineno - 1][0]} is not valid JSON: {error.msg} (column {error.colno})"
    for number, line in lines:
        row, error = parse(line)
        if error is not None:
            return f"line {number} is not valid JSON: {error.msg} (column {error.colno})"
        if not isinstance(row, dict):
            return f"line {number} is a JSON {type(row).__name__}, not an object of fields"
    return None


def _check_utf8(path: str, fmt: str) -> None:
    """Raises DataError at the first non-UTF-8 byte, naming the line and (when it can tell) the field."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            pending = len(decoder.getstate()[0])  # bytes of a sequence split across chunks
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                bad = offset - pending + e.start
                f.seek(0)
                head = f.read(bad + 1)
                line = head.count(b"\n") + 1
                byte = head[-1] if head else 0
                field = _field_at_line(path, fmt, line)
                where = f" in field {field!r}" if field else ""
                raise DataError(f"{path}: line {line}{where}: not UTF-8 (byte 0x{byte:02x} at offset {bad}); "
                                f"re-encode the file as UTF-8") from None
            if not chunk:
                return
            offset += len(chunk)


def _field_at_line(path: str, fmt: str, line: int) -> str | None:
    """The field holding the bad bytes on `line` (JSON lines, or CSV rows one line long), else None."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
            lines = f.read().split("\n")
        bad = lambda s: isinstance(s, str) and any("\udc80" <= c <= "\udcff" for c in s)  # noqa: E731
        if fmt == "json":
            record = json.loads(lines[line - 1])
            if isinstance(record, dict):
                return next((k for k, v in record.items() if bad(v) or bad(k) or
                             (isinstance(v, list) and any(bad(x) for x in v))), None)
            return None
        delimiter = "\t" if path.lower().endswith(".tsv") else ","
        header = next(csv.reader([lines[0]], delimiter=delimiter))
        if line == 1:
            return next((h for h in header if bad(h)), None)
        cells = next(csv.reader([lines[line - 1]], delimiter=delimiter))
        return next((header[i] for i, c in enumerate(cells) if bad(c) and i < len(header)), None)
    except Exception:
        return None


def _read_file(path: str, split: str | None):
    """One local data file as a Dataset (cached by path, size and mtime)."""
    key = ("file", *file_stamp(path))
    if key in _DATASETS:
        return _DATASETS[key]
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file" + (f" (split {split!r})" if split else ""))
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, not a data file" + (f" (split {split!r})" if split else ""))
    ext = os.path.splitext(path)[1].lower()
    if ext not in FILE_TYPES:
        raise DataError(f"{path}: unsupported file type {ext or '(none)'!r}; use one of {', '.join(FILE_TYPES)}")
    fmt = FILE_TYPES[ext]
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise DataError(f"{path}: cannot read the file: {_first_line(e)}") from None
    if size == 0:
        raise DataError(f"{path}: " + (f"split {split!r} is empty" if split else "empty") + " (the file has no rows)")
    if fmt in TEXT_TYPES:
        _check_utf8(path, fmt)
    import datasets

    kwargs = {}
    if fmt == "csv":  # keep texts such as "NA" or "null" as they are; empty cells stay ""
        kwargs = dict(keep_default_na=False, sep="\t" if ext == ".tsv" else ",")
    try:
        with _quiet():
            ds = datasets.load_dataset(fmt, data_files={"data": path}, split="data", **kwargs)
    except Exception as e:  # the builders raise many kinds; all mean the same here
        if "corresponds to no data" in str(e):  # a CSV header without rows, a JSON file of blank lines
            raise DataError(f"{path}: " + (f"split {split!r} is empty" if split else "empty")
                            + " (the file has no rows)") from None
        bad_line = _first_bad_json_line(path) if fmt == "json" else None
        raise DataError(f"{path}: " + (bad_line or f"cannot read it as {ext[1:]}: {_first_line(e)}")) from None
    _DATASETS[key] = ds
    return ds


def _read_source(spec: DataSpec):
    """A Dataset (one part: a file or a saved Dataset) or a {split: Dataset} mapping (hub, folders, saved dicts)."""
    name = spec.dataset
    if os.path.isfile(name) or os.path.splitext(name)[1].lower() in FILE_TYPES:
        return _read_file(name, None)
    key = ("source", name, spec.config, file_stamp(name) if _looks_local(name) else None)
    if key in _DATASETS:
        return _DATASETS[key]
    import datasets

    saved = os.path.isdir(name) and any(os.path.exists(os.path.join(name, f))
                                        for f in ("dataset_dict.json", "state.json"))
    try:
        with _quiet():
            if saved:
                data = datasets.load_from_disk(name)
            else:
                if _looks_local(name) and not os.path.exists(name):
                    raise DataError(f"{name}: no such file or directory")
                data = datasets.load_dataset(name, spec.config) if spec.config else datasets.load_dataset(name)
    except DataError:
        raise
    except Exception as e:
        what = f"{name}: cannot read the saved data set" if saved else (
            f"{name}: cannot load the data set" if os.path.isdir(name) else
            f"dataset {name!r}: cannot load it from the hub (or its cache)")
        raise DataError(f"{what}: {_first_line(e)}") from None
    data = data if isinstance(data, datasets.Dataset) else dict(data)
    _DATASETS[key] = data
    return data


def _part(spec: DataSpec, split: str, source_split: str):
    """(Dataset, where) for one split of the source; `where` names it in messages."""
    if isinstance(spec.dataset, tuple):
        files = dict(spec.dataset)
        if source_split not in files:
            raise DataError(f"task.dataset: no file for split {source_split!r} (files given for "
                            f"{', '.join(files)})")
        return _read_file(files[source_split], split), files[source_split]
    data = _read_source(spec)
    if not isinstance(data, dict):
        return data, spec.dataset
    local = _looks_local(spec.dataset)
    label = spec.dataset if local else f"dataset {spec.dataset!r}"
    if source_split not in data:
        hint = (f"; map one with splits: {{{split}: <name>}} or carve it with split_fractions"
                if split == source_split else "")
        raise DataError(f"{label}: no split {source_split!r} (has: {', '.join(data) or 'none'}){hint}")
    return data[source_split], (f"{label} (split {source_split!r})" if local else f"{label} split {source_split!r}")


def _is_single(spec: DataSpec) -> bool:
    if isinstance(spec.dataset, tuple):
        return False
    return not isinstance(_read_source(spec), dict)


# -- checking --------------------------------------------------------------------------------

def _check_rows(ds, where: str, fields: dict, text_fields, list_fields, split: str) -> list[dict]:
    """The rows' `fields` as dicts, after checking presence and non-empty texts."""
    if ds.num_rows == 0:
        raise DataError(f"{where}: split {split!r} is empty (no rows)")
    columns = list(ds.column_names)
    for field, option in fields.items():
        if field not in columns:
            hint = difflib.get_close_matches(field, columns, n=1)
            suffix = f"; did you mean {hint[0]!r}?" if hint else ""
            raise DataError(f"{where}: missing field {field!r} (columns: {', '.join(columns)}); "
                            f"set task.{option} to the column's name{suffix}")
    rows = ds.select_columns(list(fields)).to_list()
    for i, row in enumerate(rows, start=1):
        for field in fields:
            value = row[field]
            if field in text_fields:
                if not isinstance(value, str):
                    what = "missing (null)" if value is None else f"not text ({type(value).__name__} {value!r})"
                    raise DataError(f"{where}: row {i}: field {field!r} is {what}")
                if not value.strip():
                    raise DataError(f"{where}: row {i}: field {field!r} is empty")
            elif field in list_fields:
                items = value.replace(",", " ").split() if isinstance(value, str) else value
                if not isinstance(items, list) or not items or not all(isinstance(x, str) and x.strip()
                                                                        for x in items):
                    raise DataError(f"{where}: row {i}: field {field!r} must be a non-empty list of "
                                    f"non-empty strings, got {value!r}")
                row[field] = [x.strip() for x in items]
            elif value is None:
                raise DataError(f"{where}: row {i}: field {field!r} is missing (null)")
    return rows


def _checked_part(spec, split, source_split, fields, text_fields, list_fields):
    """(checked rows, where) of one source split, cached: the splits carved from it check it once."""
    key = ("part", spec.dataset, spec.config, source_split, tuple(fields.items()), tuple(text_fields),
           tuple(list_fields), stamps(spec))
    if key not in _ROWS:
        ds, where = _part(spec, split, source_split)
        _ROWS[key] = (_check_rows(ds, where, fields, text_fields, list_fields, source_split), where)
    return _ROWS[key]


def _units(rows: list[dict], group_field: str | None) -> list[list[int]]:
    """Row indices per unit: one row each, or the rows of each group in first-seen order."""
    if group_field is None:
        return [[i] for i in range(len(rows))]
    groups: dict = {}
    for i, row in enumerate(rows):
        groups.setdefault(json.dumps(row[group_field], sort_keys=True, default=str), []).append(i)
    return list(groups.values())


def _take(units: list[list[int]], chosen) -> list[int]:
    return [i for u in sorted(int(c) for c in chosen) for i in units[u]]


def load_rows(spec: DataSpec, split: str, *, fields: dict, text_fields=(), list_fields=(),
              group_field: str | None = None) -> list[dict]:
    """The rows of one split, checked, as dicts holding `fields` (field -> the config key naming it).

    `text_fields` must be non-empty strings, `list_fields` non-empty lists of strings (a string is
    split on commas or spaces), other fields non-null. With `group_field`, split fractions and
    max_examples count groups (rows sharing the field's value), never splitting one.
    """
    key = (spec, split, tuple(fields.items()), tuple(text_fields), tuple(list_fields), group_field, stamps(spec))
    if key in _ROWS:
        return _ROWS[key]
    fractions = dict(spec.fractions) if spec.fractions else None
    single = _is_single(spec)
    if fractions is None and single:
        fractions = dict(DEFAULT_FRACTIONS)
    renames = dict(spec.renames)
    if fractions is not None and split in fractions:
        base = spec.split_from or "train"
        rows, where = _checked_part(spec, split, renames.get(base, base), fields, text_fields, list_fields)
        units = _units(rows, group_field)
        order = np.random.default_rng(spec.seed).permutation(len(units))
        start = 0.0
        for name, frac in fractions.items():
            if name == split:
                lo, hi = round(start * len(units)), round((start + frac) * len(units))
                break
            start += frac
        chosen = order[lo:hi]
        if len(chosen) == 0:
            raise DataError(f"{where}: split {split!r} is empty: split_fractions gives it {fractions[split]:g} "
                            f"of {len(units)} {'groups' if group_field else 'rows'}")
        picked = _take(units, chosen)
        rows = [rows[i] for i in picked]
    elif single:
        raise DataError(f"{spec.dataset}: no split {split!r}: a single file is cut by split_fractions "
                        f"({', '.join(fractions)}); add {split!r} there")
    else:
        rows, where = _checked_part(spec, split, renames.get(split, split), fields, text_fields, list_fields)
    limit = spec.limit(split)
    if limit is not None:
        units = _units(rows, group_field)
        if len(units) > limit:
            chosen = np.random.default_rng(spec.seed).choice(len(units), size=limit, replace=False)
            rows = [rows[i] for i in _take(units, chosen)]
    _ROWS[key] = rows
    return rows


def clear_cache() -> None:
    """Forgets every loaded data set (tests; files changed in place are picked up by mtime anyway)."""
    _DATASETS.clear()
    _ROWS.clear()
