#!/usr/bin/env python3
"""Checks that the output a README shows is what the programs print today.

A README marks an output block it wants checked with an HTML comment on the line before
the block's opening fence:

    <!-- checked -->                 run the commands of the nearest ```sh block above
    <!-- checked: CMD; CMD -->       run these commands instead
    <!-- checked exactly ... -->     the same, and the block is the whole output
    <!-- checked lines 1-9,12-14 --> only these lines of the block, each range on its
                                     own (the others hold timings)

A ```console block carries its own commands: each line "$ CMD" runs CMD, and the lines
after it, up to the next "$ " line, are what it must print.

The commands run one after the other (with build/default/bin/ replaced by --bin; once
for all of a block's ranges), and the block's lines must appear in what they print
(standard output and standard error, joined), in order and next to each other, trailing
spaces aside. A line "..." (indented or not) stands for any number of lines, so a README
can show the deterministic parts of an output and leave out the rest: timings never
belong in a checked line. Every marked block of every README given is checked; the first
difference of each is printed with its file and line. Exit 0 when all agree, 1 when
one does not, 2 on bad usage.

    scripts/check_readme_output.py --bin build/default/bin chapters/*/README.md
    scripts/check_readme_output.py --self-test      the matcher against known cases
"""
import argparse
import concurrent.futures
import functools
import re
import subprocess
import sys
from pathlib import Path

MARK = re.compile(r"^<!--\s*checked(\s+exactly)?(?:\s+lines\s+([\d,-]+))?(?::\s*(.*?))?\s*-->\s*$")


def blocks(path: Path):
    """(mark's line, line numbers, commands, expected lines) of every piece of every
    checked block."""
    lines = path.read_text(encoding="utf-8").split("\n")
    last_sh = None  # the commands of the latest ```sh block
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```sh"):
            j = i + 1
            cmds = []
            while j < len(lines) and not lines[j].startswith("```"):
                cmd = lines[j].split("#")[0].strip() if not lines[j].lstrip().startswith("#") else ""
                if cmd:
                    cmds.append(cmd)
                j += 1
            last_sh = cmds
            i = j + 1
            continue
        m = MARK.match(line)
        if m:
            if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
                raise SystemExit(f"{path}:{i + 1}: a 'checked' mark must come right before a ``` block")
            exact, ranges, given = m.groups()
            j = i + 2
            body = []
            while j < len(lines) and not lines[j].startswith("```"):
                body.append((j + 1, lines[j].rstrip()))
                j += 1
            # (commands, [(line number, expected line)]) pieces to check
            if lines[i + 1].startswith("```console"):
                pieces = []
                for number, text in body:
                    if text.startswith("$ "):
                        pieces.append(([text[2:]], []))
                    elif pieces:
                        pieces[-1][1].append((number, text))
            else:
                cmds = [c.strip() for c in given.split(";")] if given else last_sh
                if not cmds:
                    raise SystemExit(f"{path}:{i + 1}: a 'checked' block with no ```sh block above it")
                pieces = [(cmds, body)]
            if ranges:  # "lines 1-3,7-9": each range of the block on its own
                pieces = [(cmds, body[int(a) - 1:int(b)])
                          for cmds, body in pieces[:1]
                          for a, b in (r.split("-") for r in ranges.split(","))]
            for cmds, expected in pieces:
                numbers = [n for n, _ in expected]
                texts = [t for _, t in expected]
                if not exact:  # a part of the output: anything may come before and after
                    texts = ["..."] + texts + ["..."]
                    numbers = [numbers[0] if numbers else i + 2] + numbers + [numbers[-1] if numbers else i + 2]
                yield i + 1, numbers, cmds, texts
            i = j + 1
            continue
        i += 1


def matches(expected, actual):
    """None when `actual` fits `expected`; else (e, a): the furthest expected line e that
    could not be matched, at actual line a."""
    worst = [(-1, 0)]

    @functools.lru_cache(maxsize=None)
    def fits(e, a):
        if e == len(expected):
            if a == len(actual):
                return True
            worst[0] = max(worst[0], (e, a))
            return False
        if expected[e].strip() == "...":
            return any(fits(e + 1, k) for k in range(a, len(actual) + 1))
        if a < len(actual) and actual[a] == expected[e]:
            return fits(e + 1, a + 1)
        worst[0] = max(worst[0], (e, a))
        return False

    return None if fits(0, 0) else worst[0]


def self_test():
    """The matcher against outputs it must accept and ones it must refuse."""
    out = ["a", "b", "c", "d"]
    cases = [(["a", "b", "c", "d"], True), (["...", "c", "..."], True), (["a", "...", "d"], True),
             (["a", "...", "...", "d"], True), (["...", "b", "c", "..."], True),
             (["a", "c"], False), (["a", "b", "c"], False), (["...", "e", "..."], False),
             (["b", "...", "d"], False), (["a", "  ...", "d"], True), (["...", "d", "a"], False)]
    bad = [(e, ok) for e, ok in cases if (matches(e, out) is None) != ok]
    for e, ok in bad:
        print(f"self-test: {e} against {out} should {'match' if ok else 'not match'}")
    print(f"self-test: {len(cases) - len(bad)} of {len(cases)} cases right")
    return 1 if bad else 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bin", required=True, help="the folder of the built programs")
    parser.add_argument("--without", action="append", default=[],
                        help="skip the blocks whose commands run this program (mpirun, "
                             "where there is no MPI)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="blocks run at once (each block's commands one after the other; "
                             "no checked block writes a file another reads)")
    parser.add_argument("readmes", nargs="+")
    args = parser.parse_args()
    bin_dir = Path(args.bin).resolve()
    if not bin_dir.is_dir():
        print(f"check_readme_output: error: --bin {args.bin} is not a folder", file=sys.stderr)
        return 2
    checked = failed = skipped = 0

    def run_block(cmds):
        out = []
        for cmd in cmds:
            run = subprocess.run(cmd.replace("build/default/bin/", f"{bin_dir}/"),
                                 shell=True, capture_output=True, text=True, timeout=300)
            out += (run.stdout + run.stderr).rstrip("\n").split("\n")
        return [l.rstrip() for l in out]

    # (README, mark's line, commands): what they printed, run once for all the block's ranges,
    # --jobs blocks at a time.
    todo = [(readme, mark, tuple(cmds))
            for readme in map(Path, args.readmes)
            for mark, numbers, cmds, expected in blocks(readme)
            if not any(w in cmd.split() for cmd in cmds for w in args.without)]
    todo = list(dict.fromkeys(todo))
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        printed = dict(zip(todo, pool.map(lambda key: run_block(key[2]), todo)))
    for readme in map(Path, args.readmes):
        for mark, numbers, cmds, expected in blocks(readme):
            if any(w in cmd.split() for cmd in cmds for w in args.without):
                skipped += 1
                continue
            actual = printed[(readme, mark, tuple(cmds))]
            checked += 1
            at = matches(expected, actual)
            if at is None:
                continue
            failed += 1
            e, a = at
            shows = repr(expected[e]) if e < len(expected) else "nothing more"
            prints = repr(actual[a]) if a < len(actual) else "nothing more"
            print(f"{readme}:{numbers[min(e, len(numbers) - 1)]}: the README shows {shows}\n"
                  f"  where `{' ; '.join(cmds)}` prints, at its line {a + 1}: {prints}")
    print(f"{checked} checked blocks, {failed} differ" +
          (f"; {skipped} skipped (they run {', '.join(args.without)})" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
