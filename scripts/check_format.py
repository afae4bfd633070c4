#!/usr/bin/env python3
"""Every C++/CUDA source git tracks is formatted as .clang-format says, and no line of it,
comments included, is longer than 100 columns (characters, not bytes: the course's Chinese
terms count one column each).

    scripts/check_format.py [--clang-format PATH]      exit 1 with the files and lines to fix
"""
import argparse
import subprocess
import sys
from pathlib import Path

LIMIT = 100


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clang-format", default="clang-format")
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    listed = subprocess.run(["git", "ls-files", "*.cpp", "*.hpp", "*.cu", "*.h"], cwd=root,
                            capture_output=True, text=True)
    if listed.returncode != 0:
        print("not a git checkout: nothing to check")
        return 0
    files = listed.stdout.split()
    unformatted = []
    for name in files:
        check = subprocess.run([args.clang_format, "--dry-run", "--Werror", name], cwd=root,
                               capture_output=True, text=True)
        if check.returncode != 0:
            unformatted.append(name)
    long_lines = []
    for name in files:
        text = (root / name).read_text(encoding="utf-8")
        for number, line in enumerate(text.splitlines(), 1):
            if len(line) > LIMIT:
                long_lines.append(f"{name}:{number} ({len(line)} columns)")
    if unformatted:
        print("not formatted as .clang-format says (run `make format`):")
        print("\n".join("  " + f for f in unformatted))
    if long_lines:
        print(f"longer than {LIMIT} columns:")
        print("\n".join("  " + line for line in long_lines))
    if unformatted or long_lines:
        return 1
    print(f"{len(files)} files formatted, none longer than {LIMIT} columns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
