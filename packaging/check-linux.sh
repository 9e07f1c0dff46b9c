#!/usr/bin/env bash
# Build the Linux packages from this checkout, then check them as a user would:
# unpack the .deb into a scratch root, run the packaged CLI (--version, a real
# generate on the default model from the cache, the server on loopback), start the
# packaged app from its .desktop entry under Xvfb, find its window by title and take
# a screenshot.
#   packaging/check-linux.sh [--no-build]      (needs: xvfb x11-utils imagemagick curl)
# Slow (minutes), so CI's .ci/run does not call it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
if [ "${1:-}" != "--no-build" ]; then
    start=$(date +%s)
    packaging/build-linux.sh
    echo "build took $(( $(date +%s) - start )) s"
fi
DEB=$(ls -t dist/llamba_*.deb | head -1)
echo "package: $DEB ($(du -h "$DEB" | cut -f1)), tar.gz: $(du -h dist/llamba-*-linux-*.tar.gz | cut -f1 | head -1)"

SCRATCH=$(mktemp -d)
# (never `kill 0`: with no PID yet that would end this script's whole process group)
trap 'for p in ${SERVE_PID:-} ${XVFB_PID:-}; do kill $p 2>/dev/null || true; done; rm -rf "$SCRATCH"' EXIT
dpkg -x "$DEB" "$SCRATCH/root"
CLI="$SCRATCH/root/opt/llamba/llamba-cli"
export NUMBA_CACHE_DIR="$SCRATCH/numba-cache" LLAMBA_DATA_DIR="$SCRATCH/data"

echo "== llamba-cli --version"
"$CLI" --version

echo "== llamba-cli generate (default model from the cache)"
MODEL=$(python3 -c "from runtime.download import fetch; print(fetch('smollm2-135m'))")
"$CLI" generate -m "$MODEL" -p "The capital of France is" -n 12 --temp 0

echo "== llamba-cli serve (the bundled server on loopback: health, a chat answer under a JSON schema)"
PORT=18597
"$CLI" serve -m "$MODEL" --port $PORT -np 2 -c 1024 >"$SCRATCH/serve.log" 2>&1 & SERVE_PID=$!
for _ in $(seq 1 120); do
    curl -fs "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    sleep 1
done
curl -fs "http://127.0.0.1:$PORT/health" || { echo "the packaged server never became healthy"; cat "$SCRATCH/serve.log"; exit 1; }
ANSWER=$(curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "messages": [{"role": "user", "content": "Give me a city and its country."}], "max_tokens": 40, "temperature": 0,
  "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": {"type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}}, "required": ["city", "country"]}}}}')
echo "$ANSWER" | python3 -c "import json,sys; a=json.load(sys.stdin); assert 'error' not in a, a; c=a['choices'][0]['message']['content']; print('answer:', c, a['choices'][0]['finish_reason']); assert a['choices'][0]['finish_reason'] != 'stop' or set(json.loads(c)) == {'city', 'country'}"
kill $SERVE_PID; wait $SERVE_PID 2>/dev/null || true

echo "== the app, started from its .desktop entry, under Xvfb"
DESKTOP="$SCRATCH/root/usr/share/applications/llamba.desktop"
EXEC=$(sed -n 's/^Exec=//p' "$DESKTOP" | sed 's/ %[fFuU]//')
EXEC="$SCRATCH/root$EXEC"          # the entry points into /opt/llamba; here that is the scratch root
Xvfb :57 -screen 0 1280x800x24 >/dev/null 2>&1 & XVFB_PID=$!
sleep 1
DISPLAY=:57 QT_QPA_PLATFORM=xcb "$EXEC" "$MODEL" >"$SCRATCH/app.log" 2>&1 & APP_PID=$!
title=""
for _ in $(seq 1 90); do
    title=$(DISPLAY=:57 xwininfo -root -tree 2>/dev/null | grep -o '"Llamba[^"]*"' | head -1 || true)
    [ -n "$title" ] && break
    sleep 1
done
[ -n "$title" ] || { echo "no Llamba window appeared"; cat "$SCRATCH/app.log"; exit 1; }
echo "window title: $title"
sleep 8                                   # let the model load so the panel shows it
mkdir -p docs
DISPLAY=:57 import -window root docs/installed-app.png
echo "screenshot: docs/installed-app.png"
kill $APP_PID
echo "all package checks passed"
