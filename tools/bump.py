"""Bump one package's version, optionally widen its dependents' ranges, log it.

    python tools/bump.py dew-nn minor --message "Add the MoE block"
    python tools/bump.py dew-nn minor --widen   # dependents' <0.2 becomes <0.3

part: major | minor | patch. The package's CHANGELOG.md gets a new section
with the message. Run ``uv lock`` afterwards (the script does unless
--no-lock) and ``python tools/check_ranges.py``.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _workspace import ROOT, packages  # noqa: E402
from packaging.version import Version  # noqa: E402


def bumped(version: str, part: str) -> str:
    v = Version(version)
    major, minor, patch = (list(v.release) + [0, 0])[:3]
    if part == "major":
        return f"{major + 1}.0.0"
    if part == "minor":
        return f"{major}.{minor + 1}.0"
    if part == "patch":
        return f"{major}.{minor}.{patch + 1}"
    raise ValueError(f"part must be major, minor or patch, got {part!r}")


def upper_bound(version: str) -> str:
    """The exclusive upper bound of a 0.x-compatible range: 0.3.1 -> 0.4, 1.2.0 -> 2."""
    v = Version(version)
    major, minor = (list(v.release) + [0])[:2]
    return f"0.{minor + 1}" if major == 0 else f"{major + 1}"


def bump(root: pathlib.Path, name: str, part: str, *, widen: bool, message: str) -> str:
    found = packages(root)
    if name not in found:
        raise SystemExit(f"unknown package {name!r}; workspace packages: {', '.join(found)}")
    info = found[name]
    old, new = info["version"], bumped(info["version"], part)
    pyproject = info["dir"] / "pyproject.toml"
    text = pyproject.read_text()
    text = re.sub(r'(?m)^version = "[^"]+"', f'version = "{new}"', text, count=1)
    pyproject.write_text(text)
    changelog = info["dir"] / "CHANGELOG.md"
    log = changelog.read_text() if changelog.exists() else "# Changelog\n"
    head, _, rest = log.partition("\n## ")
    entry = f"## {new}\n\n- {message}\n"
    changelog.write_text(f"{head.rstrip()}\n\n{entry}" + (f"\n## {rest}" if rest else ""))
    if widen:
        bound = upper_bound(new)
        for other, other_info in found.items():
            path = other_info["dir"] / "pyproject.toml"
            text = path.read_text()
            pattern = re.compile(rf'"{re.escape(name)}(\[[^\]]*\])?([^"]*)<[0-9.]+"')
            widened = pattern.sub(lambda m: f'"{name}{m.group(1) or ""}{m.group(2)}<{bound}"', text)
            if widened != text:
                path.write_text(widened)
                print(f"{other}: {name} range now admits < {bound}")
    print(f"{name}: {old} -> {new}")
    return new


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package")
    parser.add_argument("part", choices=["major", "minor", "patch"])
    parser.add_argument("--widen", action="store_true", help="widen dependents' ranges")
    parser.add_argument("--message", default="Version bump.", help="changelog entry")
    parser.add_argument("--root", type=pathlib.Path, default=ROOT)
    parser.add_argument("--no-lock", action="store_true", help="do not run uv lock")
    args = parser.parse_args(argv)
    bump(args.root, args.package, args.part, widen=args.widen, message=args.message)
    if not args.no_lock:
        subprocess.run(["uv", "lock"], cwd=args.root, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
