#!/usr/bin/env python3
"""Checks a built HTML site's internal links: no dead link, no missing image.

    python3 scripts/check_site_links.py SITE_DIR     every *.html under SITE_DIR
    python3 scripts/check_site_links.py --self-test  the checker on a small site with faults

Every href and src of every page that is not an outside address (http:, https:, mailto:,
javascript:, data:) must name a file of the site, and a #fragment must name an id (or a
named anchor) on the page it points to. Exit status: 0 every link holds; 1 some do not
(each printed as PAGE: LINK (why)); 2 bad usage (no such folder, no pages).
"""
import argparse
import html.parser
import os
import sys
import tempfile
import urllib.parse

OUTSIDE = ("http:", "https:", "mailto:", "javascript:", "data:", "ftp:")
# Doxygen's class summary links "Classes" to #nested-classes whenever a class has nested
# classes, and leaves the section out when they are all private: a link to the page
# itself, known and harmless, the one fault this checker lets pass.
DOXYGEN_SUMMARY = "#nested-classes"


class Page(html.parser.HTMLParser):
    """The links a page makes and the anchors it offers."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.links, self.anchors = [], set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if value is None:
                continue
            if name in ("id",) or (tag == "a" and name == "name"):
                self.anchors.add(value)
            if (tag, name) in (("a", "href"), ("link", "href"), ("img", "src"),
                               ("script", "src"), ("iframe", "src")):
                self.links.append((tag, value))


def parse(path, cache):
    if path not in cache:
        page = Page()
        with open(path, encoding="utf-8", errors="replace") as f:
            page.feed(f.read())
        cache[path] = page
    return cache[path]


def check(site):
    """The faults of the site at `site`: a list of 'page: link (why)'."""
    pages = sorted(os.path.join(d, f) for d, _, files in os.walk(site) for f in files
                   if f.endswith(".html"))
    if not pages:
        raise FileNotFoundError(f"{site}: no .html pages")
    cache, faults = {}, []
    for page_path in pages:
        for tag, link in parse(page_path, cache).links:
            target = link.strip()
            if not target or target.lower().startswith(OUTSIDE) or target == DOXYGEN_SUMMARY:
                continue
            url = urllib.parse.urlsplit(target)
            if url.scheme or url.netloc:
                continue
            where = page_path if not url.path else os.path.normpath(
                os.path.join(os.path.dirname(page_path), urllib.parse.unquote(url.path)))
            name = os.path.relpath(page_path, site)
            if not os.path.isfile(where):
                what = "missing image" if tag == "img" else "dead link"
                faults.append(f"{name}: {link} ({what}: no {os.path.relpath(where, site)})")
                continue
            if url.fragment and where.endswith(".html"):
                fragment = urllib.parse.unquote(url.fragment)
                if fragment not in parse(where, cache).anchors:
                    faults.append(f"{name}: {link} (no anchor '{fragment}' on "
                                  f"{os.path.relpath(where, site)})")
    return pages, faults


def self_test():
    """The checker must find each planted fault, and pass the sound pages."""
    with tempfile.TemporaryDirectory() as site:
        os.makedirs(os.path.join(site, "img"))
        with open(os.path.join(site, "img", "plot.png"), "wb") as f:
            f.write(b"\x89PNG")
        sound = ('<a href="b.html#part">b</a><img src="img/plot.png">'
                 '<a href="https://example.org/x">out</a><a href="#top">up</a><p id="top"></p>')
        with open(os.path.join(site, "a.html"), "w") as f:
            f.write(sound)
        with open(os.path.join(site, "b.html"), "w") as f:
            f.write('<h1 id="part">B</h1><a name="old"></a>')
        _, faults = check(site)
        if faults:
            print("check_site_links: the sound site was faulted:", *faults, sep="\n  ")
            return 1
        with open(os.path.join(site, "c.html"), "w") as f:
            f.write('<a href="gone.html">x</a><img src="img/none.png">'
                    '<a href="b.html#nowhere">y</a><a href="b.html#old">z</a>')
        _, faults = check(site)
        want = ["c.html: gone.html (dead link", "c.html: img/none.png (missing image",
                "c.html: b.html#nowhere (no anchor 'nowhere'"]
        missed = [w for w in want if not any(f.startswith(w) for f in faults)]
        if missed or len(faults) != len(want):
            print("check_site_links: planted faults", want, "found", faults)
            return 1
    print("check_site_links: the self-test found every planted fault")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("site", nargs="?")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not a.site or not os.path.isdir(a.site):
        print(f"check_site_links: {a.site}: no such folder (build the site first: make docs)",
              file=sys.stderr)
        return 2
    try:
        pages, faults = check(a.site)
    except FileNotFoundError as e:
        print(f"check_site_links: {e}", file=sys.stderr)
        return 2
    for fault in faults:
        print(fault)
    print(f"{len(pages)} pages, {len(faults)} broken links")
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
