"""Component manifests: which checkpoint a component came from, and proof its files are intact.

Every exported component folder holds `manifest.json`:
  {"checkpoint_id", "component", "format", "files": {name: sha256}, "settings": {...}}
A component whose files do not hash to the manifest, or whose checkpoint id or shared settings
differ from its siblings', is refused with a message naming the file or the mismatch.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST = "manifest.json"
SHARED_SETTINGS = ("d_model", "vocab_size", "pair_size", "pad_id", "weight_precision")


class ManifestError(RuntimeError):
    pass


@dataclass
class Manifest:
    checkpoint_id: str
    component: str
    format: str
    files: dict[str, str]
    settings: dict = field(default_factory=dict)

    def save(self, directory: Path) -> None:
        (directory / MANIFEST).write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n", encoding="utf-8")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path, checkpoint_id: str, component: str, fmt: str,
                   settings: dict) -> Manifest:
    files = {p.name: sha256_of(p) for p in sorted(directory.iterdir())
             if p.is_file() and p.name != MANIFEST}
    manifest = Manifest(checkpoint_id, component, fmt, files, settings)
    manifest.save(directory)
    return manifest


def verify_component(directory: str | Path) -> Manifest:
    """Loads a component's manifest and checks every file it lists."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.exists():
        raise ManifestError(f"{directory}: no {MANIFEST}; refusing to load an unversioned component")
    manifest = Manifest(**json.loads(path.read_text(encoding="utf-8")))
    for name, expected in manifest.files.items():
        file = directory / name
        if not file.exists():
            raise ManifestError(f"{manifest.component}: file {file} listed in the manifest is missing")
        actual = sha256_of(file)
        if actual != expected:
            raise ManifestError(f"{manifest.component}: {file} has sha256 {actual[:12]}..., the manifest "
                                f"says {expected[:12]}...; the file was changed after export")
    return manifest


def verify_siblings(manifests: list[Manifest]) -> str:
    """All components must come from one checkpoint and agree on shared settings."""
    first = manifests[0]
    for other in manifests[1:]:
        if other.checkpoint_id != first.checkpoint_id:
            raise ManifestError(
                f"checkpoint mismatch: {first.component} is from checkpoint {first.checkpoint_id} but "
                f"{other.component} is from {other.checkpoint_id}; export all components from one checkpoint")
        for key in SHARED_SETTINGS:
            if key in first.settings and key in other.settings and first.settings[key] != other.settings[key]:
                raise ManifestError(f"setting mismatch: {key} is {first.settings[key]} in {first.component} "
                                    f"but {other.settings[key]} in {other.component}")
    return first.checkpoint_id
