#!/usr/bin/env bash
# Regenerate the figures of the docs site from the trained default model and the
# reversal demo:
#   docs/plan-shakespeare-char.txt        `torchformer plan` of the run
#   docs/loss-shakespeare-char.png        its training and validation loss curve (loss.png of the run)
#   docs/attention-shakespeare-char.png   layer x head heatmaps on a line of Romeo and Juliet
#   docs/attention-shakespeare-char.html  the interactive explorer of the same recording (offline)
#   docs/attention-shakespeare-char.txt   the head-statistics table and the ASCII map
#   docs/attention-reverse.png            cross-attention of the reversal model (the anti-diagonal)
#   docs/attention-reverse.html           its explorer: encoder, decoder and cross-attention
#   docs/attention-reverse.txt            its head-statistics table and ASCII map
#   docs/verify-shakespeare-char.txt      `torchformer verify` of the run
# Trains the models first when RUN / REVERSE_RUN are missing (`torchformer demo`, a few minutes
# on 2 cores; `torchformer demo reverse`, about 2 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
TF=${TF:-.venv/bin/torchformer}
RUN=${RUN:-runs/shakespeare-char}
REVERSE_RUN=${REVERSE_RUN:-runs/reverse}
TEXT=${TEXT:-"ROMEO:
But soft, what light through yonder window breaks?"}
# The reversal model reads letters then </s>, and writes <s> then the letters reversed.
WORD=${WORD:-reversal}

if [ ! -f "$RUN/config.json" ]; then
  "$TF" demo train.out_dir="$RUN"
fi
if [ ! -f "$REVERSE_RUN/config.json" ]; then
  "$TF" demo reverse train.out_dir="$REVERSE_RUN"
fi
"$TF" plan "$RUN" --batch-size 16 > docs/plan-shakespeare-char.txt
cp "$RUN/loss.png" docs/loss-shakespeare-char.png
"$TF" attention "$RUN" --text "$TEXT" --out docs/attention-shakespeare-char.png \
  --html docs/attention-shakespeare-char.html > docs/attention-shakespeare-char.txt
"$TF" attention "$REVERSE_RUN" --text "$WORD</s>" --target "<s>$(echo "$WORD" | rev)" --kind cross \
  --out docs/attention-reverse.png --html docs/attention-reverse.html > docs/attention-reverse.txt
# verify exits 1 when a check fails: keep the table either way, and say so.
"$TF" verify "$RUN" > docs/verify-shakespeare-char.txt || echo "verify reported a failure: see docs/verify-shakespeare-char.txt"
echo "wrote docs/plan-shakespeare-char.txt docs/loss-shakespeare-char.png docs/attention-{shakespeare-char,reverse}.{png,html,txt} docs/verify-shakespeare-char.txt"
