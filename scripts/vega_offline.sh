#!/usr/bin/env bash
# plots/templates/offline.html: a page template for `dvc plots show` with vega, vega-lite and
# vega-embed inlined, so the plots render with no network (DVC's own page loads them from a CDN).
#
#   bash scripts/vega_offline.sh     # idempotent; needs npm and the npm registry once (scripts/setup.sh calls it)
#   .venv/bin/dvc plots show --html-template plots/templates/offline.html
#
# The three minified builds are ~830 kB, too large to commit, so they are fetched (pinned versions)
# with `npm pack` and the generated page is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=plots/templates/offline.html
PKGS=(vega@6.4.0 vega-lite@6.4.3 vega-embed@7.3.0)
if [ -f "$OUT" ]; then exit 0; fi
if ! command -v npm >/dev/null 2>&1; then
  echo "[setup] npm not found: skipping $OUT (dvc plots show then loads vega from a CDN)"; exit 0
fi
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "${PKGS[@]}" >/dev/null)
{
  printf '<!DOCTYPE html>\n<html>\n<head>\n<meta charset="utf-8">\n{refresh_tag}\n<title>retro-realm plots</title>\n'
  printf '<!-- %s, inlined by scripts/vega_offline.sh: nothing loads from a CDN -->\n' "${PKGS[*]}"
  for name in vega vega-lite vega-embed; do
    tgz=("$tmp/$name"-[0-9]*.tgz)
    mkdir -p "$tmp/$name" && tar -xzf "${tgz[0]}" -C "$tmp/$name" "package/build/$name.min.js"
    printf '<script>\n'; cat "$tmp/$name/package/build/$name.min.js"; printf '\n</script>\n'
  done
  printf '<style>table { border-spacing: 15px; } body { font-family: sans-serif; }</style>\n</head>\n<body>\n{plot_divs}\n</body>\n</html>\n'
} > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
echo "[setup] wrote $OUT ($(du -k "$OUT" | cut -f1) kB)"
