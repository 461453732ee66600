#!/bin/bash
# The demo over seeds and repeats, each run from an empty directory (docs/pipeline.md, "Runs over seeds"):
#   tools/demo_runs/run.sh OUT_ROOT "SEED REPEAT" ["SEED REPEAT" ...]
# appends one line per run to OUT_ROOT/results.txt; tools/demo_runs/summarize.py OUT_ROOT makes the table.
# Run two of these at once on disjoint pairs to use two cores' worth of machine.
set -u
root=$1; shift
mkdir -p "$root"
for pair in "$@"; do
  read -r seed repeat <<< "$pair"
  out=$root/s${seed}_r${repeat}
  start=$(date +%s)
  sao demo recipes/tiny_cpu.yaml run.output_dir="$out" run.seed="$seed" > "$out.log" 2>&1
  rc=$?
  echo "seed=$seed repeat=$repeat rc=$rc wall=$(( $(date +%s) - start ))s $(grep -a 'held-out success:' "$out.log" | tail -1)" >> "$root/results.txt"
done
