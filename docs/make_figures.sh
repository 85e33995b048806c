#!/usr/bin/env bash
# Regenerate the "Look inside" figures of the README from the trained default model:
#   docs/plan-shakespeare-char.txt        `torchformer plan` of the run
#   docs/attention-shakespeare-char.png   layer x head heatmaps on a line of Romeo and Juliet
#   docs/attention-shakespeare-char.txt   the head-statistics table and the ASCII map
#   docs/verify-shakespeare-char.txt      `torchformer verify` of the run
# Trains the default model first (`torchformer demo`, ~4 minutes on 2 cores) when RUN is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
TF=${TF:-.venv/bin/torchformer}
RUN=${RUN:-runs/shakespeare-char}
TEXT=${TEXT:-"ROMEO:
But soft, what light through yonder window breaks?"}

if [ ! -f "$RUN/config.json" ]; then
  "$TF" demo
fi
"$TF" plan "$RUN" --batch-size 16 > docs/plan-shakespeare-char.txt
"$TF" attention "$RUN" --text "$TEXT" --out docs/attention-shakespeare-char.png > docs/attention-shakespeare-char.txt
# verify exits 1 when a check fails: keep the table either way, and say so.
"$TF" verify "$RUN" > docs/verify-shakespeare-char.txt || echo "verify reported a failure: see docs/verify-shakespeare-char.txt"
echo "wrote docs/plan-shakespeare-char.txt docs/attention-shakespeare-char.{png,txt} docs/verify-shakespeare-char.txt"
