"""The distributions a built wheel asks for, taken from this test environment instead of an index.

``closure`` follows the wheel's own Requires-Dist (the base set, or with extras) through each
installed distribution's metadata, markers evaluated as pip would; ``link`` puts exactly those
distributions, nothing else of this environment, into a folder a fresh venv reads through a .pth
line. pip then installs the wheel with ``--no-index``: it still checks every requirement against
what is there, but unpacks and byte-compiles no torch (~35 CPU-s a venv). A requirement the wheel
forgot is missing from the folder as it would be from a user's venv.
"""

from __future__ import annotations

import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def wheel_requires(wheel: Path) -> list[str]:
    """The Requires-Dist lines of ``wheel``'s METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        text = zf.read(name).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def closure(requires: list[str], extras: tuple[str, ...] = ()) -> dict[str, metadata.Distribution]:
    """{canonical name: installed distribution} of ``requires`` (asked with ``extras``) and everything
    they require in turn; a requirement this environment cannot satisfy fails here, by name."""
    found: dict[str, metadata.Distribution] = {}
    asked: set[tuple[str, str]] = set()
    todo = [(Requirement(r), ("", *extras)) for r in requires]
    while todo:
        req, active = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in active):
            continue
        name = canonicalize_name(req.name)
        dist = found.get(name) or metadata.distribution(req.name)
        assert req.specifier.contains(dist.version, prereleases=True), f"{req} asked, {dist.version} installed"
        new = [e for e in ("", *sorted(req.extras)) if (name, e) not in asked]
        if name in found and not new:
            continue
        found[name] = dist
        asked.update((name, e) for e in new)
        todo += [(Requirement(r), tuple(new)) for r in dist.requires or ()]
    return found


def link(dists: dict[str, metadata.Distribution], folder: Path) -> Path:
    """Symlink each distribution's top-level files (packages, modules, .libs, its .dist-info) into
    ``folder``; scripts outside site-packages are left out."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, dist in dists.items():
        assert dist.files, f"{name}: no RECORD, its files are unknown"
        for top in {f.parts[0] for f in dist.files if f.parts[0] != ".."}:
            target = folder / top
            if not target.exists():
                target.symlink_to(Path(dist.locate_file(top)).resolve())
    return folder
