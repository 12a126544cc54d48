#!/bin/sh
# Re-fetch the plotting library the web viewer ships (uPlot, MIT licence) from the npm
# registry, copy the files the pages load into the package, and record the version and the
# sha256 of every copied file in VENDOR.md. Run by `make vendor`; needs npm and the internet.
# The committed files are what the package uses: nothing is fetched at run time.
set -eu
VERSION="${UPLOT_VERSION:-1.6.32}"
DEST="$(cd "$(dirname "$0")/.." && pwd)/src/tensorkv/viewer/web/static/vendor"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

(cd "$TMP" && npm pack --silent "uplot@$VERSION" >/dev/null && tar xzf "uplot-$VERSION.tgz")
TARBALL_SHA="$(sha256sum "$TMP/uplot-$VERSION.tgz" | cut -d' ' -f1)"
mkdir -p "$DEST"
cp "$TMP/package/dist/uPlot.iife.min.js" "$DEST/uPlot.iife.min.js"
cp "$TMP/package/dist/uPlot.min.css" "$DEST/uPlot.min.css"
cp "$TMP/package/LICENSE" "$DEST/uPlot.LICENSE"

{
    echo "# Vendored assets of the web viewer"
    echo
    echo "Fetched by \`make vendor\` (scripts/vendor_uplot.sh) with \`npm pack uplot@$VERSION\`;"
    echo "the package serves these files as they are, with no network access at run time."
    echo
    echo "| file | from | sha256 |"
    echo "|---|---|---|"
    echo "| uplot-$VERSION.tgz | npm registry, uplot@$VERSION | $TARBALL_SHA |"
    for f in uPlot.iife.min.js uPlot.min.css uPlot.LICENSE; do
        echo "| $f | uplot@$VERSION | $(sha256sum "$DEST/$f" | cut -d' ' -f1) |"
    done
    echo
    echo "uPlot is (c) Leon Sorokin, MIT licence (uPlot.LICENSE)."
} > "$DEST/VENDOR.md"
echo "vendored uplot@$VERSION into $DEST"
