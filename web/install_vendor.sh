#!/usr/bin/env bash
# The chat page's libraries (pinned in web/package.json and web/package-lock.json): installed with npm, their
# browser builds copied into static/vendor/ (ignored by git, served by the proxy; never a CDN).
# Without npm, or offline, this warns and the page renders plain, safe markdown with its own small renderer
# (and PDFs cannot be attached: pdf.js renders their pages).
#   web/install_vendor.sh          install when web/package-lock.json changed since the last copy
set -uo pipefail
cd "$(dirname "$0")"
log() { echo "[vendor] $*"; }
OUT=../static/vendor
STAMP=$OUT/.installed

want="$(sha256sum package-lock.json | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then exit 0; fi
if ! command -v npm >/dev/null 2>&1; then
  log "warning: npm is missing (Debian: apt-get install npm); the page renders without markdown/math/code libraries"
  exit 0
fi
# --omit=optional: pdf.js lists a native canvas for Node as optional; the browser build needs none of it.
log "installing the page's rendering libraries (npm ci)"
if ! npm ci --omit=optional --no-audit --no-fund --loglevel=error >/dev/null; then
  log "warning: npm ci failed; the page renders without markdown/math/code libraries"
  exit 0
fi
M=node_modules
rm -rf "$OUT.tmp" && mkdir -p "$OUT.tmp/katex" "$OUT.tmp/pdfjs" "$OUT.tmp/licenses"
cp $M/marked/lib/marked.esm.js $M/dompurify/dist/purify.es.mjs "$OUT.tmp/"
cp $M/@highlightjs/cdn-assets/es/highlight.min.js "$OUT.tmp/highlight.min.mjs"
cp $M/@highlightjs/cdn-assets/styles/github.min.css "$OUT.tmp/hljs-light.css"
cp $M/@highlightjs/cdn-assets/styles/github-dark.min.css "$OUT.tmp/hljs-dark.css"
cp $M/katex/dist/katex.mjs $M/katex/dist/katex.min.css "$OUT.tmp/katex/"
cp -r $M/katex/dist/fonts "$OUT.tmp/katex/"
# pdf.js: the library, its worker, and the data it fetches for some PDFs (CJK character maps, the 14 standard
# fonts, the wasm decoders of JPEG 2000 and JBIG2 scans, a colour profile).
cp $M/pdfjs-dist/build/pdf.min.mjs $M/pdfjs-dist/build/pdf.worker.min.mjs "$OUT.tmp/pdfjs/"
cp -r $M/pdfjs-dist/cmaps $M/pdfjs-dist/standard_fonts $M/pdfjs-dist/wasm $M/pdfjs-dist/iccs "$OUT.tmp/pdfjs/"
for p in marked dompurify katex @highlightjs/cdn-assets pdfjs-dist; do
  for f in $M/$p/LICENSE*; do cp "$f" "$OUT.tmp/licenses/${p//\//-}.LICENSE"; break; done
done
rm -rf "$OUT" && mv "$OUT.tmp" "$OUT" && echo "$want" > "$STAMP"
log "page libraries ready in static/vendor/"
