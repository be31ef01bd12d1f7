#!/usr/bin/env bash
# `make demo` with `kvturn top` beside it, in a real terminal (tmux): captures top's screen every
# few seconds into .kvturn/demo/top-AGENT/, then checks that it showed the demo's live figures
# (turns by plan with reuse, engines up) and prints the last such screen.
#
#   examples/watch_demo.sh            # AGENT=agents|langgraph picks the agent, as for make demo
set -euo pipefail
cd "$(dirname "$0")/.."
agent=${AGENT:-openai}
out=.kvturn/demo/top-$agent
rm -rf "$out" && mkdir -p "$out"
session=kvturn-demo-$$
command -v tmux >/dev/null || { echo "watch_demo: needs tmux" >&2; exit 2; }

tmux new-session -d -s "$session" -x 150 -y 55 \
  "make demo AGENT=$agent >$out/demo.log 2>&1; echo \$? >$out/demo.rc"
tmux new-window -t "$session" ".venv/bin/kvturn top --interval 1"
trap 'tmux kill-session -t "$session" 2>/dev/null || true' EXIT

n=0
while [[ ! -f $out/demo.rc ]]; do
  sleep 3
  n=$((n + 1))
  tmux capture-pane -p -t "$session:1" >"$out/screen-$(printf %04d $n).txt" || break
done
echo "watch_demo: make demo exited with $(cat "$out/demo.rc"); $n screens in $out"
tail -n 25 "$out/demo.log"

# A screen on which a reusing plan had turns and every engine was up: the last one taken while
# turns were being served (a rate above zero), else the last one at all.
.venv/bin/python - "$out" <<'PY'
import re, sys
from pathlib import Path

shown = busy = None
for path in sorted(Path(sys.argv[1]).glob("screen-*.txt")):
    text = path.read_text()
    reuse = re.search(r"│ (decode-local|pull-reuse)\s+│\s+([\d,]+) ", text)
    if reuse and int(reuse.group(2).replace(",", "")) > 0 and "DOWN" not in text and " up " in text:
        shown = (path, text)
        if re.search(r"│\s+(?!0\.00/s)[\d,.]+/s\s+│", text):
            busy = shown
if shown is None:
    sys.exit("watch_demo: kvturn top never showed a reusing turn with its engines up")
path, text = busy or shown
print(f"\nkvturn top during the demo ({path}):\n{text.rstrip()}")
PY
exit "$(cat "$out/demo.rc")"
