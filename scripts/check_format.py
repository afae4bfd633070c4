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


def clang_format_accepts(clang_format: str, names: list, root: Path) -> bool:
    check = subprocess.run([clang_format, "--dry-run", "--Werror", *names], cwd=root,
                           capture_output=True, text=True)
    return check.returncode == 0


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
    # A few files to a clang-format (one process per file was most of this check's time);
    # a batch that fails is checked again file by file, which names exactly the ones to fix.
    for start in range(0, len(files), 64):
        batch = files[start:start + 64]
        if clang_format_accepts(args.clang_format, batch, root):
            continue
        unformatted += [name for name in batch
                        if not clang_format_accepts(args.clang_format, [name], root)]
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
