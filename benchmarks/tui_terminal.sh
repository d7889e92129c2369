#!/usr/bin/env bash
# The terminal UI in a real terminal (tmux 120x40) against headless mode, on
# the same inventory and prompts (issue 16: the TUI within 0.95 of headless).
#
#   benchmarks/tui_terminal.sh [OUTFILE]      (INV=inventory.yaml to choose another)
#
# For each of two prompts: a headless run (--json, its decode tokens/s), then
# the TUI in a detached tmux session, the same prompts typed in, ctrl+n
# between them, its "last run ... tok/s" read off the screen; ctrl+q at the
# end. Appends to OUTFILE (default: stdout). One run is noisy on a shared
# machine: run it several times, alternating builds, and compare medians.
# Needs tmux.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-/dev/stdout}
S=ggufpipe-tui-bench$$
cd "$REPO"; V=$REPO/.venv/bin; INV=${INV:-inventory.example.yaml}
P1="Why is the sky blue?"; P2="Count from one to fifty, one number per line."
wait_for() {  # pattern timeout-seconds
  for _ in $(seq 1 $(( $2 * 4 ))); do tmux capture-pane -p -t $S | grep -q -- "$1" && return 0; sleep 0.25; done
  echo "timeout waiting for $1" >> "$OUT"; tmux capture-pane -p -t $S >> "$OUT"; return 1
}
{
echo "== $REPO $(git -C "$REPO" rev-parse --short HEAD) $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
for prompt in "$P1" "$P2"; do
  $V/ggufpipe-tui "$INV" --prompt "$prompt" --json 2>/dev/null \
    | python3 -c "import json,sys; d=json.load(sys.stdin); print('headless', repr(sys.argv[1]), d['timings']['decode_tokens_per_s'])" "$prompt"
done
tmux new -d -s $S -x 120 -y 40 -c "$REPO" "$V/ggufpipe-tui $INV"
wait_for "ready for a prompt" 120
for prompt in "$P1" "$P2"; do
  tmux send-keys -t $S -l "$prompt"; tmux send-keys -t $S Enter
  sleep 1
  wait_for "last run" 120 && wait_for "ready for a prompt" 120
  echo "TUI $(printf %q "$prompt"): $(tmux capture-pane -p -t $S | grep -m1 -o 'last run.*tok\b')"
  tmux send-keys -t $S C-n; sleep 1
done
tmux send-keys -t $S C-q
for _ in $(seq 1 60); do tmux has-session -t $S 2>/dev/null || break; sleep 0.5; done
tmux kill-session -t $S 2>/dev/null && echo "(tmux session killed)"
} >> "$OUT" 2>&1
