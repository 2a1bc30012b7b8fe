"""Regenerate the family x scheme support matrix in README.md from the registries.

python scripts/maintenance/support_matrix.py          # rewrite the README section
python scripts/maintenance/support_matrix.py --check  # exit 1 when the README is out of date (tests run this)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hf_posswap.cli.matrix import support_matrix_markdown

README = Path(__file__).resolve().parents[2] / "README.md"
START, END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"


def updated_readme(text: str) -> str:
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{support_matrix_markdown()}\n{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that README.md is up to date")
    args = parser.parse_args()
    text = README.read_text(encoding="utf-8")
    new = updated_readme(text)
    if args.check:
        if new != text:
            print("README.md's support matrix is out of date: run python scripts/maintenance/support_matrix.py",
                  file=sys.stderr)
            return 1
        return 0
    README.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
