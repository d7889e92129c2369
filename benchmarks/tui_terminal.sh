#!/usr/bin/env bash
# The terminal UI in a real terminal (tmux 120x40) against headless mode, on
# the same inventory and prompts (the target: the TUI within 0.95 of headless, docs/performance.md).
#
#   benchmarks/tui_terminal.sh [OUTFILE] [ROUNDS]   (INV=inventory.yaml to choose another)
#
# One TUI session in a detached tmux session stays up for all the rounds
# (after one untimed prompt, and the probe that follows it). Each round, for
# each of two prompts: a headless run (--json, its decode tokens/s), then
# the same prompt typed into the TUI and its decode tokens/s
# read from its run log (--log-dir: the RunFinished event), then ctrl+n; a
# line "ratio" per prompt. ctrl+q at the end.
#
# While a run decodes the harness touches nothing: it does not read the
# screen (a `tmux capture-pane` a few times a second costs the stages of a
# 2-core machine 10-15 %, and was taken for the UI's cost before), it looks
# for the run's end in the log every half second (a grep). Both modes run
# under benchmarks/decode_cpu.py, which also gives the orchestrator process's
# CPU time from each run's first token to its last: what the view takes from
# the stages, steadier than tokens/s. Appends to
# OUTFILE (default: stdout). One run is noisy on a shared machine: compare
# medians of several rounds. Needs tmux.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-/dev/stdout}
ROUNDS=${2:-3}
S=ggufpipe-tui-bench$$
cd "$REPO"; V=$REPO/.venv/bin; INV=${INV:-inventory.example.yaml}
LOGS=$(mktemp -d); trap 'rm -rf "$LOGS"' EXIT
P1="Why is the sky blue?"; P2="Count from one to fifty, one number per line."
finished() { cat "$LOGS"/*.jsonl 2>/dev/null | grep -c '"RunFinished"'; }
last_rate() {  # decode tokens/s of the newest RunFinished in the TUI's run logs
  python3 -c '
import glob, json, sys
ends = [json.loads(line) for name in glob.glob(sys.argv[1] + "/*.jsonl") for line in open(name) if "\"RunFinished\"" in line]
print(max(ends, key=lambda e: e["t"])["result"]["timings"]["decode_tokens_per_s"])' "$LOGS"
}
{
echo "== $REPO $(git -C "$REPO" rev-parse --short HEAD) $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
tmux new -d -s $S -x 120 -y 40 -c "$REPO" "env DECODE_CPU_OUT=$LOGS/cpu-tui $V/python benchmarks/decode_cpu.py $INV --log-dir $LOGS"
for _ in $(seq 1 240); do tmux capture-pane -p -t $S | grep -q "ready for a prompt" && break; sleep 0.5; done
# A first, untimed prompt: the run after it probes each stage's batch
# invariance once (seconds of compute, ggufpipe_agent/llama/engine.py), which
# would land on the first headless run. Wait until the probes are logged.
before=$(finished)
tmux send-keys -t $S -l "$P1"; tmux send-keys -t $S Enter
for _ in $(seq 1 240); do sleep 0.5; [ "$(finished)" -gt "$before" ] && break; done
sleep 0.5; tmux send-keys -t $S C-n
probed=0; still=0  # a stage's probe is logged every 2-3 s: done when none came for 5 s
for _ in $(seq 1 90); do
  sleep 1; now=$(cat "$LOGS"/*.jsonl | grep -c "rows come out alike\|only whole prefilled ubatches")
  if [ "$now" -gt 0 ] && [ "$now" = "$probed" ]; then still=$((still + 1)); else still=0; fi
  [ $still -ge 5 ] && break; probed=$now
done
for round in $(seq 1 "$ROUNDS"); do
  for prompt in "$P1" "$P2"; do
    headless=$(DECODE_CPU_OUT=$LOGS/cpu-headless $V/python benchmarks/decode_cpu.py "$INV" --prompt "$prompt" --json 2>/dev/null \
      | python3 -c "import json,sys; print(json.load(sys.stdin)['timings']['decode_tokens_per_s'])")
    before=$(finished)
    tmux send-keys -t $S -l "$prompt"; tmux send-keys -t $S Enter
    for _ in $(seq 1 480); do sleep 0.5; [ "$(finished)" -gt "$before" ] && break; done
    tui=$(last_rate)
    python3 -c "
import json, sys
h, t = map(float, sys.argv[2:4])
ch, ct = (json.loads(open(name).readlines()[-1])['cpu_ms'] for name in sys.argv[5:7])
print(f'round {sys.argv[1]}: headless {h:.1f} tok/s, TUI {t:.1f} tok/s, ratio {t / h:.3f}; decode CPU headless {ch:.0f} ms, TUI {ct:.0f} ms  ({sys.argv[4]!r})')" \
      "$round" "$headless" "$tui" "$prompt" "$LOGS/cpu-headless" "$LOGS/cpu-tui" | tee -a "$LOGS/ratios"
    sleep 0.5; tmux send-keys -t $S C-n; sleep 0.5
  done
done
python3 -c '
import re, statistics, sys
text = open(sys.argv[1]).read()
ratios = [float(m) for m in re.findall(r"ratio ([0-9.]+)", text)]
cpu = re.findall(r"decode CPU headless ([0-9]+) ms, TUI ([0-9]+) ms", text)
if ratios:
    print(f"TUI / headless: median {statistics.median(ratios):.3f} over {len(ratios)} runs")
    print(f"decode CPU of the orchestrator process: headless median {statistics.median(int(h) for h, _ in cpu)} ms, "
          f"TUI {statistics.median(int(t) for _, t in cpu)} ms")' "$LOGS/ratios"
tmux send-keys -t $S C-q
for _ in $(seq 1 60); do tmux has-session -t $S 2>/dev/null || break; sleep 0.5; done
if tmux kill-session -t $S 2>/dev/null; then echo "(tmux session killed)"; fi
} >> "$OUT" 2>&1
