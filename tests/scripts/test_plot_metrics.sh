#!/usr/bin/env bash
# scripts/plot_metrics.sh on a CSVLogger metrics file (metrics.csv here: Lightning's layout,
# step rows and epoch rows with empty cells): it names the series it plotted (every loss and
# accuracy column), writes a PNG of the expected size, and refuses files it cannot plot with
# a message saying why.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
plot="$here/../../scripts/plot_metrics.sh"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

said="$("$plot" "$here/metrics.csv" "$tmp/curves.png")"
[ "$said" = "plotted train_loss_step train_loss_epoch val_loss (loss) and val_acc (accuracy) against step from 10 rows to $tmp/curves.png" ] ||
  fail "unexpected report: $said"
[ "$(head -c 4 "$tmp/curves.png" | od -An -tx1 | tr -d ' \n')" = "89504e47" ] || fail "not a PNG"
# Two panels of 360 pixels: the PNG's height (big endian at byte 20) is 720.
[ "$(od -An -j20 -N4 -tu1 "$tmp/curves.png" | awk '{print $3 * 256 + $4}')" = 720 ] || fail "not two panels high"
[ "$(wc -c < "$tmp/curves.png")" -gt 5000 ] || fail "an almost empty PNG"

# Only a loss column: one panel.
cut -d, -f1-3 "$here/metrics.csv" > "$tmp/loss.csv"
"$plot" "$tmp/loss.csv" > /dev/null
[ "$(od -An -j20 -N4 -tu1 "$tmp/loss.png" | awk '{print $3 * 256 + $4}')" = 360 ] || fail "one panel expected"

# Refusals name the problem.
cut -d, -f1,3- "$here/metrics.csv" > "$tmp/nostep.csv"
if err="$("$plot" "$tmp/nostep.csv" 2>&1)"; then fail "a file without step was plotted"; fi
[[ "$err" == *'has no "step" column'* ]] || fail "unexpected message: $err"
if err="$("$plot" "$tmp/absent.csv" 2>&1)"; then fail "a missing file was plotted"; fi
[[ "$err" == *"cannot read"* ]] || fail "unexpected message: $err"
echo "plot_metrics: all checks passed"
