#!/usr/bin/env bash
# Holdout figures before/after a feature change, on one world: a baseline commit's code
# and this checkout each run the daily batch and `train` on copies of the same raw data
# (simulated by this checkout). Prints both evaluation reports' headline sections.
#
#   bench/ab_train.sh BASELINE_REF [CARDS] [DAYS] [HOLDOUT_DAYS]
#
# Work goes to bench/results/ab_train/ (gitignored); the baseline runs from a git
# worktree there with this checkout's virtual environment.
set -euo pipefail
cd "$(dirname "$0")/.."
REF=${1:?usage: bench/ab_train.sh BASELINE_REF [CARDS] [DAYS] [HOLDOUT_DAYS]}
CARDS=${2:-6000}; DAYS=${3:-35}; HOLDOUT=${4:-7}
PY=$PWD/.venv/bin/python
OUT=$PWD/bench/results/ab_train
rm -rf "$OUT" && mkdir -p "$OUT"
git worktree add -f --detach -q "$OUT/baseline" "$REF"
trap 'git worktree remove --force "$OUT/baseline"' EXIT
unset REDIS_URL  # each command starts its own embedded server
FRAUD_DATA_DIR=$OUT/world $PY -m cli simulate --cards "$CARDS" --days "$DAYS"
last=$($PY -c "import datetime as d; print(d.date(2026,1,1)+d.timedelta(days=$DAYS-1))")
prev=$($PY -c "import datetime as d; print(d.date(2026,1,1)+d.timedelta(days=$DAYS-2))")
for side in baseline checkout; do
  src=$PWD; [ $side = baseline ] && src=$OUT/baseline
  mkdir -p "$OUT/$side-data" && cp -r "$OUT/world/raw" "$OUT/$side-data/raw"
  ( cd "$src" && export FRAUD_DATA_DIR=$OUT/$side-data FRAUD_MODEL_REPO=$OUT/$side-data/models
    echo "== $side: batch + train" >&2
    $PY -m cli batch --from 2026-01-01 --to "$prev" > "$OUT/$side.log" 2>&1
    $PY -m cli batch --date "$last" --no-materialize >> "$OUT/$side.log" 2>&1
    $PY -m cli train --holdout-days "$HOLDOUT" --warmup-days 7 --force >> "$OUT/$side.log" 2>&1 )
done
for side in baseline checkout; do
  echo "== $side"
  sed -n '/^| metric/,/^## Reliability/p' "$OUT/$side-data/models/fraud/1/evaluation/report.md"
done
