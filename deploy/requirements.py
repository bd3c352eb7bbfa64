"""Print the project's runtime requirements from pyproject.toml, one per line.

The images install dependencies from this list *before* copying the code, so editing the
code rebuilds one small layer instead of reinstalling torch. `--without` drops packages an
image must not carry (the scheduler never imports torch; the gateway needs no triton):

    python requirements.py pyproject.toml --without torch triton accelerate > requirements.txt
"""
from __future__ import annotations

import argparse
import re
import tomllib


def package_name(requirement: str) -> str:
    """The normalised distribution name of a PEP 508 requirement ("Foo_Bar>=1" -> "foo-bar")."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if name is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", name.group(1)).lower()


def requirements(pyproject: str, without: list[str] = ()) -> list[str]:
    with open(pyproject, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    drop = {package_name(w) for w in without}
    return [d for d in deps if package_name(d) not in drop]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pyproject")
    ap.add_argument("--without", nargs="*", default=[], help="package names to leave out")
    args = ap.parse_args()
    print("\n".join(requirements(args.pyproject, args.without)))


if __name__ == "__main__":
    main()
