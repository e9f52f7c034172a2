"""What `agents.evaluate` writes: its tables as Markdown, and `evaluation.csv`, `evaluation.md`
and `generations.jsonl` in its output directory."""
from __future__ import annotations

import csv
import json
import math
import os


def _fmt(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4f}"
    return str(value)


def markdown_table(columns: list[str], rows: list[dict]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_results(result: dict, out_dir: str) -> dict:
    """Writes evaluation.csv (both tables, a `table` column telling them apart), evaluation.md and
    generations.jsonl; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f) for k, f in
             (("csv", "evaluation.csv"), ("md", "evaluation.md"), ("generations", "generations.jsonl"))}
    columns = ["table", *dict.fromkeys(result["columns"] + result["breakdown_columns"])]
    with open(paths["csv"], "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows({"table": "overall", **r} for r in result["rows"])
        writer.writerows({"table": "by_difficulty", **r} for r in result["breakdown"])
    with open(paths["md"], "w", encoding="utf-8") as f:
        f.write(markdown_summary(result) + "\n")
    with open(paths["generations"], "w", encoding="utf-8") as f:
        f.writelines(json.dumps(g) + "\n" for g in result["generations"])
    return paths


def markdown_summary(result: dict) -> str:
    weights = "" if result.get("precision", "fp32") == "fp32" else f" with {result['precision']} weights"
    return (f"Split {result['split']!r}, {result['decoding']} decoding{weights}; perplexity under "
            f"{result['reference']} (fp32).\n\n" + markdown_table(result["columns"], result["rows"]) +
            f"\n\nBy {result['difficulty']} (terciles):\n\n" +
            markdown_table(result["breakdown_columns"], result["breakdown"]))
