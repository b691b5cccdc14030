"""What a quality gate hands to the builder, kept beside the weights it measured
(`checkpoints/NAME/serving.json`), not among the generated reports: the calibrated
acceptance_threshold, whether the gate passed and what it missed, the report that says so, and the
sha256 of the weights file it measured. `builder.assemble` reads it and refuses one whose weights
file changed since (the threshold of other weights would be a guess)."""
from __future__ import annotations

import json
from pathlib import Path

from builder.import_model import sha256_file

FILE = "serving.json"
ROOT = Path(__file__).resolve().parent.parent


def write(folder: Path, weights_file: str, threshold: float, passed: bool, missed: list[str], report: Path) -> Path:
    """`report`: the quality report that says why (named relative to the repository where it is in it)."""
    report = Path(report).resolve()
    report = report.relative_to(ROOT) if report.is_relative_to(ROOT) else report
    path = Path(folder) / FILE
    path.write_text(json.dumps({"acceptance_threshold": threshold, "quality_gate_passed": passed, "missed": missed,
                                "report": str(report), "weights_file": weights_file,
                                "weights_sha256": sha256_file(Path(folder) / weights_file)}, indent=1) + "\n",
                    encoding="utf-8")
    return path


def threshold(folder: Path, weights_file: str) -> float:
    return float(read(folder, weights_file)["acceptance_threshold"])


def read(folder: Path, weights_file: str) -> dict:
    path = Path(folder) / FILE
    if not path.exists():
        raise SystemExit(f"{path} is missing: run the quality gate (python -m builder.evaluate, or "
                         f"builder.evaluate_conversion for a converted model) to calibrate acceptance_threshold")
    settings = json.loads(path.read_text(encoding="utf-8"))
    if settings["weights_file"] != weights_file or settings["weights_sha256"] != sha256_file(Path(folder) / weights_file):
        raise SystemExit(f"{path} was measured on other weights than {Path(folder) / weights_file}: run the quality "
                         f"gate again, or pass --threshold")
    return settings
