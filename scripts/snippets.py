#!/usr/bin/env python3
"""Code in the chapter texts comes from the real sources, never pasted by hand.

A text marks each C++ block with the source region it shows; the region is the lines
between two `// [name]` lines in the source (plain comments: Doxygen finds them for
\\snippet and does not take them for documentation):

    <!-- snippet: chapters/03_ring_allreduce/ring_allreduce.hpp ring_steps -->
    ```cpp
    void ring_reduce_scatter(Communicator& comm, std::span<float> data, Workspace& scratch);
    ```

    snippets.py --check [ROOT]      every C++ block of every text is marked, and equals its
                                    region (dedented); exit 1 naming each one that is not
    snippets.py --filter [--figures FIGURES.md] FILE.md
                                    FILE with each marked block replaced by Doxygen's
                                    \\snippet of its region (Doxygen's FILTER_PATTERNS), so
                                    the site shows the source itself; and a line
                                    `<!-- figures: ... -->` replaced by FIGURES.md (the
                                    gallery make plots drew) or, before it exists, by a
                                    line saying how to draw them
    snippets.py --update [ROOT]     paste each marked block's region again (after the
                                    source changed)
    snippets.py --self-test         the checker on texts with planted faults

On GitHub a text shows its block; the check keeps that block equal to the source.
"""
import re
import sys
import tempfile
import textwrap
from pathlib import Path

MARK = re.compile(r"^<!-- snippet: (\S+) (\S+) -->\s*$")
FIGURES = re.compile(r"^<!-- figures:.*-->\s*$")
SHIPPED_IMAGE = re.compile(r"\]\((?:\.\./)+docs/images/")
FENCE = re.compile(r"^```(\w*)\s*$")
CODE_LANGS = {"cpp", "c++", "cc", "hpp"}
TEXTS = ["README.md", "chapters/*/README.md", "docs/*.md"]


def region(root, path, name):
    """The lines between the two `// [name]` markers of root/path, dedented; None if the
    file or the pair of markers is missing."""
    try:
        lines = (Path(root) / path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    marks = [i for i, line in enumerate(lines) if line.strip() == f"// [{name}]"]
    if len(marks) != 2:
        return None
    return textwrap.dedent("\n".join(lines[marks[0] + 1:marks[1]])).strip("\n")


def blocks(text):
    """Every fenced block: (line of its opening fence, language, its code, the marker above
    it or None, line of its closing fence)."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not FENCE.match(lines[end]):
            end += 1
        mark = MARK.match(lines[i - 1]) if i > 0 else None
        yield i, fence.group(1).lower(), "\n".join(lines[i + 1:end]), mark, end
        i = end + 1


def texts(root):
    """Every text under `root` whose C++ blocks are checked: (path, its contents)."""
    for pattern in TEXTS:
        for text_path in sorted(root.glob(pattern)):
            yield text_path, text_path.read_text(encoding="utf-8")


def shown(code):
    """A block's code as it is compared with its region: dedented, no blank ends."""
    return textwrap.dedent(code).strip("\n")


def check(root):
    """Problems, one line each: unmarked C++ blocks, missing regions, blocks that differ."""
    root = Path(root)
    problems = []
    for text_path, text in texts(root):
        rel = text_path.relative_to(root)
        for line, lang, code, mark, _ in blocks(text):
            where = f"{rel}:{line + 1}"
            if mark is None:
                if lang in CODE_LANGS:
                    problems.append(f"{where}: a C++ block with no '<!-- snippet: FILE "
                                    "REGION -->' above it: show a region of a real source")
                continue
            source, name = mark.group(1), mark.group(2)
            want = region(root, source, name)
            if want is None:
                problems.append(f"{where}: no region '// [{name}]' ... '// [{name}]' in "
                                f"{source}")
            elif shown(code) != want:
                problems.append(f"{where}: the block differs from {source} [{name}]; "
                                "run scripts/snippets.py --update")
    return problems


def update(root):
    """Rewrites each marked block of every text with its region; returns the texts changed."""
    root = Path(root)
    changed = []
    for text_path, text in texts(root):
        lines = text.split("\n")
        for line, _, code, mark, end in reversed(list(blocks(text))):
            want = mark and region(root, mark.group(1), mark.group(2))
            if want and shown(code) != want:
                lines[line + 1:end] = want.split("\n")
        if "\n".join(lines) != text:
            text_path.write_text("\n".join(lines), encoding="utf-8")
            changed.append(str(text_path.relative_to(root)))
    return changed


def doxygen_filter(path, figures=None):
    """The text with each marked block replaced by a \\snippet of its region, padded with
    blank lines so that Doxygen's warnings keep their line numbers; and its figures marker
    (the gallery page's) replaced by the figures page make plots wrote, if any."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    out = list(lines)
    for line, _, _, mark, end in blocks("\n".join(lines)):
        if mark is None:
            continue
        out[line - 1] = f"\\snippet {mark.group(1)} {mark.group(2)}"
        for i in range(line, end + 1):
            out[i] = ""
    for i, text in enumerate(out):
        if FIGURES.match(text):
            drawn = figures and Path(figures).is_file()
            out[i] = (Path(figures).read_text(encoding="utf-8") if drawn else
                      "No figures yet on this site: `make plots`, then `make docs`.")
        # A chapter's figure from docs/images (../../docs/images/NAME on GitHub): Doxygen
        # finds it by its name in IMAGE_PATH.
        out[i] = SHIPPED_IMAGE.sub("](", out[i])
    return "\n".join(out) + "\n"


def self_test():
    """Plants each fault the checker must find, and a text it must pass."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "docs/pages").mkdir(parents=True)
        (root / "src.hpp").write_text("int a;\n  // [decl]\n  int f(int x);\n  // [decl]\n")
        good = "<!-- snippet: src.hpp decl -->\n```cpp\nint f(int x);\n```\n\n```sh\nls\n```\n"
        cases = {
            "good": (good, []),
            "unmarked": ("```cpp\nint f(int x);\n```\n", ["with no"]),
            "differs": ("<!-- snippet: src.hpp decl -->\n```cpp\nint f(int y);\n```\n",
                        ["differs"]),
            "no region": ("<!-- snippet: src.hpp other -->\n```cpp\nint f(int x);\n```\n",
                          ["no region"]),
            "no file": ("<!-- snippet: nope.hpp decl -->\n```cpp\nint f(int x);\n```\n",
                        ["no region"]),
        }
        failed = 0
        for name, (text, want) in cases.items():
            (root / "docs/t.md").write_text(text)
            got = check(root)
            ok = len(got) == len(want) and all(w in g for w, g in zip(want, got))
            print(f"{'ok' if ok else 'FAILED'}: {name}: {got or 'no problems'}")
            failed += not ok
        (root / "docs/t.md").write_text(good)
        filtered = doxygen_filter(root / "docs/t.md").splitlines()
        ok = filtered[0] == "\\snippet src.hpp decl" and len(filtered) == len(good.splitlines())
        print(f"{'ok' if ok else 'FAILED'}: the filter: {filtered[:2]}")
        page = root / "docs/gallery.md"
        page.write_text("# Every figure\n\n<!-- figures: here -->\n")
        (root / "figures.md").write_text("## Chapter 01\n")
        drawn = doxygen_filter(page, figures=root / "figures.md")
        none = doxygen_filter(page, figures=root / "missing.md")
        (root / "chapter.md").write_text("![a plot](../../docs/images/readme_x.png)\n")
        image = doxygen_filter(root / "chapter.md")
        ok_figures = ("## Chapter 01" in drawn and "make plots" in none and "<!--" not in none
                      and image == "![a plot](readme_x.png)\n")
        print(f"{'ok' if ok_figures else 'FAILED'}: the figures marker: {drawn.splitlines()[2]!r}, "
              f"{none.splitlines()[2]!r}")
        return 1 if failed or not ok or not ok_figures else 0


def main(argv):
    if len(argv) == 3 and argv[1] == "--filter":
        sys.stdout.write(doxygen_filter(argv[2]))
        return 0
    if len(argv) == 5 and argv[1] == "--filter" and argv[2] == "--figures":
        sys.stdout.write(doxygen_filter(argv[4], figures=argv[3]))
        return 0
    if len(argv) >= 2 and argv[1] == "--self-test":
        return self_test()
    if len(argv) in (2, 3) and argv[1] == "--update":
        root = Path(argv[2]) if len(argv) == 3 else Path(__file__).resolve().parent.parent
        for text in update(root):
            print("updated", text)
        return 0
    if len(argv) in (2, 3) and argv[1] == "--check":
        root = Path(argv[2]) if len(argv) == 3 else Path(__file__).resolve().parent.parent
        problems = check(root)
        for p in problems:
            print(p, file=sys.stderr)
        print(f"snippets: {len(problems)} problem(s)" if problems else "snippets: every C++ "
              "block of the texts equals its source region")
        return 1 if problems else 0
    print("usage: snippets.py --check [ROOT] | --update [ROOT] | "
          "--filter [--figures FIGURES.md] FILE.md | --self-test", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
