#!/usr/bin/env bash
# Screenshots of the documentation site and the plot gallery, as a browser draws them:
# the main page, a chapter page, the glossary (Chinese terms), the site's gallery and the
# standalone gallery page, by headless Chromium.
#
#   scripts/screenshots.sh [SITE] [PLOTS] [OUT]
#     SITE   the built site (default build/default/docs/html; make docs)
#     PLOTS  make plots' folder (default build/default/plots)
#     OUT    where the PNGs go (default build/default/screenshots)
#
# Needs chromium (apt-get install chromium) and, for the Chinese terms, a CJK font
# (apt-get install fonts-noto-cjk): without one they are drawn as boxes.
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(realpath -m "${1:-build/default/docs/html}")
plots=$(realpath -m "${2:-build/default/plots}")
out=$(realpath -m "${3:-build/default/screenshots}")
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [[ -z "$browser" ]]; then
  echo "screenshots: no chromium on the PATH (apt-get install chromium)" >&2
  exit 2
fi
if ! fc-list 2>/dev/null | grep -qi "cjk"; then
  echo "screenshots: no CJK font installed: Chinese terms will be boxes (apt-get install fonts-noto-cjk)" >&2
fi
mkdir -p "$out"
shoot() {  # shoot NAME FILE HEIGHT
  if [[ ! -f "$2" ]]; then
    echo "screenshots: $2 does not exist (make docs, make plots)" >&2
    exit 1
  fi
  "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --force-device-scale-factor=1 \
    --window-size=1280,"$3" --screenshot="$out/$1.png" "file://$2" > /dev/null 2>&1
  echo "$out/$1.png"
}
shoot main "$site/index.html" 2400
shoot chapter "$site/ch04.html" 2400
shoot glossary "$site/glossary.html" 1600
shoot gallery "$site/gallery.html" 3000
shoot plots_index "$plots/index.html" 3000
