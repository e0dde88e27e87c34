#!/usr/bin/env bash
# Fetch the page's browser libraries (marked, DOMPurify, highlight.js, KaTeX) from the
# npm registry and copy their browser builds and licenses into static/vendor/.
# Re-run after changing a version below; commit the result (no build step at runtime).
set -euo pipefail

MARKED_VERSION="${MARKED_VERSION:-18.2.1}"
DOMPURIFY_VERSION="${DOMPURIFY_VERSION:-3.5.0}"
HLJS_VERSION="${HLJS_VERSION:-11.12.0}"
KATEX_VERSION="${KATEX_VERSION:-0.19.1}"

root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/static/vendor"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

cd "$work"
npm init -y >/dev/null
npm install --no-audit --no-fund --ignore-scripts --save-exact \
  "marked@$MARKED_VERSION" \
  "dompurify@$DOMPURIFY_VERSION" \
  "@highlightjs/cdn-assets@$HLJS_VERSION" \
  "katex@$KATEX_VERSION" >/dev/null

nm="$work/node_modules"
rm -rf "$dest"
mkdir -p "$dest/marked" "$dest/dompurify" "$dest/highlight" "$dest/katex"

cp "$nm/marked/lib/marked.esm.js" "$dest/marked/marked.esm.js"
cp "$nm/marked/LICENSE" "$dest/marked/LICENSE"

# .js, not .mjs: not every server maps .mjs to a JavaScript MIME type, and modules need one.
cp "$nm/dompurify/dist/purify.es.mjs" "$dest/dompurify/purify.es.js"
cp "$nm/dompurify/LICENSE" "$dest/dompurify/LICENSE"
cp "$nm/dompurify/LICENSE-MPL" "$dest/dompurify/LICENSE-MPL"

cp "$nm/@highlightjs/cdn-assets/es/highlight.min.js" "$dest/highlight/highlight.min.js"
cp "$nm/@highlightjs/cdn-assets/styles/github.min.css" "$dest/highlight/github.min.css"
cp "$nm/@highlightjs/cdn-assets/styles/github-dark.min.css" "$dest/highlight/github-dark.min.css"
cp "$nm/@highlightjs/cdn-assets/LICENSE" "$dest/highlight/LICENSE"

# The minified build (a classic script: window.katex; there is no minified module build).
# The page asks for MathML output only: the browser lays the math out, so no KaTeX CSS,
# fonts or inline styles (the CSP allows none).
cp "$nm/katex/dist/katex.min.js" "$dest/katex/katex.min.js"
cp "$nm/katex/LICENSE" "$dest/katex/LICENSE"

# Drop trailing sourceMappingURL comments: the maps are not shipped.
for f in "$dest"/*/*.js; do
  sed -i '/^\/\/# sourceMappingURL=/d' "$f"
done

{
  echo "Third-party browser libraries, fetched by scripts/vendor-frontend.sh from the npm registry."
  echo
  echo "marked                  $MARKED_VERSION  MIT                     marked/LICENSE"
  echo "dompurify               $DOMPURIFY_VERSION   MPL-2.0 OR Apache-2.0   dompurify/LICENSE, dompurify/LICENSE-MPL"
  echo "@highlightjs/cdn-assets $HLJS_VERSION BSD-3-Clause            highlight/LICENSE"
  echo "katex                   $KATEX_VERSION  MIT                     katex/LICENSE"
} > "$dest/LICENSES"

echo "vendored into $dest:"
(cd "$dest" && find . -type f | sort)
