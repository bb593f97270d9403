#!/usr/bin/env bash
# The Muon A/B of docs/arms.md: every arm of configs/ab/ over its lr grid and seeds, seed-major
# (each seed's whole lr curve of every arm before the next seed), then the table and plots.
# Resumable: run it again after an interruption (finished runs are skipped, an interrupted one
# resumes). Run from the repository root after preparing the BPE data:
#   harness data prepare builtin:corpus --out data/tokens-example --tokenizer train-bpe:512
#   OMP_NUM_THREADS=1 nice -n 10 ops/bench/muon_ab.sh          # both stages
#   OMP_NUM_THREADS=1 nice -n 10 ops/bench/muon_ab.sh main     # AdamW vs Muon vs Muon-rms0.2 only
# No -e: a run that diverges (exit 2 at a NaN loss, a high lr) ends that run, not the A/B.
set -uo pipefail
STAGES=${1:-main price}

# AdamW's grid, factor 2 apart; Muon-rms0.2 sweeps the same values (AdamW's lr transfers).
ADAMW_LRS=1.5e-3,3e-3,6e-3,1.2e-2,2.4e-2
# Muon's reference scaling: 6e-3 is the matched-RMS lr here (0.2 x 3e-3 x sqrt(96)), 2.4e-2 4x it.
MUON_LRS=6e-3,1.2e-2,2.4e-2,4.8e-2,9.6e-2

sweep() {  # sweep ARM KEY VALUES SEED
  harness sweep "configs/ab/$1.toml" --grid "$2=$3" --seeds "$4"
}

for stage in $STAGES; do
  case "$stage" in
    main)
      for seed in 0 1 2; do
        sweep adamw optim.lr "$ADAMW_LRS" "$seed"
        sweep muon optim.lr_muon "$MUON_LRS" "$seed"
        sweep muon-rms0.2 optim.lr_muon "$ADAMW_LRS" "$seed"
      done ;;
    price)
      for seed in 0 1; do
        sweep lion optim.lr_matrix 6e-4,1.2e-3,2.4e-3 "$seed"
        sweep olion optim.lr_matrix 3e-3,6e-3,1.2e-2 "$seed"
        sweep adafactor optim.lr_matrix 3e-3,6e-3,1.2e-2 "$seed"
        sweep sgdm optim.lr 3e-2,6e-2,1.2e-1 "$seed"
      done ;;
    *) echo "unknown stage $stage (main | price)" >&2; exit 2 ;;
  esac
done
