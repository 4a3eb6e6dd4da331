"""Check that every sibling version range admits the sibling's current version.

uv resolves workspace members from the workspace whatever their ranges say,
so a bump of dew-nn to 0.2.0 while dew-train requires ``dew-nn>=0.1,<0.2``
locks and syncs silently, and breaks only for users installing from an index.

    python tools/check_ranges.py            # exit 1 and name both versions on a mismatch
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _workspace import ROOT, packages  # noqa: E402


def mismatches(root: pathlib.Path = ROOT) -> list[str]:
    found = packages(root)
    problems = []
    for name, info in found.items():
        for req in info["requires"]:
            sibling = found.get(req.name)
            if sibling is None:
                continue
            if not req.specifier.contains(sibling["version"], prereleases=True):
                problems.append(
                    f"{name} {info['version']} requires {req.name}{req.specifier}, but the "
                    f"workspace has {req.name} {sibling['version']}; widen the range "
                    f"(python tools/bump.py {req.name} ... --widen) or pin the older version"
                )
    return problems


def main() -> int:
    problems = mismatches()
    for line in problems:
        print(line, file=sys.stderr)
    if not problems:
        print(f"sibling ranges ok: {len(packages())} packages")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
