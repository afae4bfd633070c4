"""What every chapter's plot script shares: one way to save a figure, and one way to check
that a saved figure is a real picture.

    .venv/bin/python notebooks/plotting.py --check a.png b.png   # exit 1 on a bad one
    .venv/bin/python notebooks/plotting.py --self-test           # the check, on planted faults
"""
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from PIL import Image  # noqa: E402  (matplotlib's own dependency)

# A figure of these scripts at 120 dpi is 600-2400 pixels a side and tens of kilobytes; an
# empty canvas is one colour, a truncated file fails to decode.
MIN_SIDE, MAX_SIDE = 300, 4000
MIN_BYTES = 8_000
MIN_COLOURS = 16


def save(fig, path, layout=True):
    """Lays `fig` out (unless the caller did: layout=False), writes it to `path` (PNG, 120
    dpi), closes it, and returns the path."""
    if layout:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def check_png(path):
    """Raises ValueError unless `path` is a whole PNG of plausible size with something drawn
    on it; returns (width, height)."""
    with open(path, "rb") as f:
        head = f.read(8)
    if head != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG (starts {head!r})")
    size = os.path.getsize(path)
    if size < MIN_BYTES:
        raise ValueError(f"{path}: {size} bytes, too small for a figure (at least {MIN_BYTES})")
    try:
        with Image.open(path) as image:
            image.verify()  # every chunk's checksum
        with Image.open(path) as image:
            image.load()  # the whole picture decodes
            width, height = image.size
            colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
    except (OSError, SyntaxError) as e:  # PIL's errors for a broken file
        raise ValueError(f"{path}: does not decode ({e})") from e
    if not (MIN_SIDE <= width <= MAX_SIDE and MIN_SIDE <= height <= MAX_SIDE):
        raise ValueError(f"{path}: {width}x{height} pixels, outside {MIN_SIDE}..{MAX_SIDE}")
    if colours is not None and len(colours) < MIN_COLOURS:
        raise ValueError(f"{path}: only {len(colours)} colours: nothing drawn")
    return width, height


def shrink_png(source, target, width=640):
    """Writes a copy of `source` at most `width` pixels wide, as a small palette PNG."""
    with Image.open(source) as image:
        image = image.convert("RGB")
        if image.width > width:
            image = image.resize((width, round(image.height * width / image.width)),
                                 Image.LANCZOS)
        image.quantize(colors=128).save(target, optimize=True)


def self_test():
    """check_png on pictures with planted faults (each must be rejected, saying why) and on
    a real figure (which must pass); returns the exit code."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(range(10), [x * x for x in range(10)], marker="o", label="a curve")
        ax.legend()
        good = save(fig, tmp / "good.png")
        data = good.read_bytes()
        (tmp / "truncated.png").write_bytes(data[: len(data) // 2])
        (tmp / "not_a_png.png").write_bytes(b"<html>" + b"x" * 20_000)
        Image.new("RGB", (800, 600), "white").save(tmp / "blank.png")
        Image.effect_noise((800, 600), 1).convert("RGB").quantize(colors=4).save(tmp / "few.png")
        fig, _ = plt.subplots(figsize=(1, 1))
        save(fig, tmp / "tiny.png")
        Image.effect_noise((5000, 300), 60).convert("RGB").save(tmp / "huge.png")
        want = {"truncated.png": "does not decode", "not_a_png.png": "not a PNG",
                "blank.png": "too small", "few.png": "colours", "tiny.png": "too small",
                "huge.png": "outside"}
        failed = 0
        for name, words in want.items():
            try:
                check_png(tmp / name)
                print(f"FAILED: {name} passed")
                failed += 1
            except ValueError as e:
                ok = words in str(e)
                print(f"{'ok' if ok else 'FAILED'}: {name}: {e}")
                failed += not ok
        try:
            print(f"ok: a real figure passes: {check_png(good)}")
        except ValueError as e:
            print(f"FAILED: a real figure: {e}")
            failed += 1
        return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--self-test":
        sys.exit(self_test())
    if len(sys.argv) < 3 or sys.argv[1] != "--check":
        print("usage: plotting.py --check PNG... | --self-test", file=sys.stderr)
        sys.exit(2)
    bad = 0
    for png in sys.argv[2:]:
        try:
            w, h = check_png(png)
            print(f"ok {png}: {w}x{h}")
        except (OSError, ValueError) as e:
            print(f"bad image: {e}", file=sys.stderr)
            bad = 1
    sys.exit(bad)
