#!/usr/bin/env bash
# Plots a CSVLogger metrics file (lightning_logs/version_N/metrics.csv) to a PNG with gnuplot:
# the loss curves (every column whose name holds "loss") and, below them, the accuracy curves
# (every column holding "acc"), against "step". Lightning's layout: one row per logging call,
# empty cells for the keys a row lacks (step values in one series, epoch values in another).
#
#   scripts/plot_metrics.sh METRICS_CSV [OUT_PNG]     (default OUT_PNG: METRICS_CSV with .png)
#
# Needs gnuplot (Debian: apt-get install gnuplot-nox). Prints what it plotted.
set -euo pipefail

die() {
  printf 'plot_metrics: %s\n' "$*" >&2
  exit 1
}

[ $# -ge 1 ] && [ $# -le 2 ] || die "usage: $0 METRICS_CSV [OUT_PNG]"
csv="$1"
out="${2:-${csv%.csv}.png}"
[ -r "$csv" ] || die "cannot read '$csv'"
command -v gnuplot >/dev/null 2>&1 || die "gnuplot not found (Debian: apt-get install gnuplot-nox)"

IFS=',' read -r -a columns < <(head -n 1 "$csv" | tr -d '\r') || die "'$csv' is empty"
step=0
loss=()
acc=()
for i in "${!columns[@]}"; do
  name="${columns[$i]}"
  case "$name" in
    step) step=$((i + 1)) ;;
    *loss*) loss+=("$((i + 1)):$name") ;;
    *acc*) acc+=("$((i + 1)):$name") ;;
  esac
done
[ "$step" -gt 0 ] || die "'$csv' has no \"step\" column (columns: ${columns[*]})"
[ "${#loss[@]}" -gt 0 ] || [ "${#acc[@]}" -gt 0 ] ||
  die "'$csv' has no loss or accuracy column (columns: ${columns[*]})"
rows=$(($(grep -c '' "$csv") - 1))  # counts a last line without a newline too
[ "$rows" -gt 0 ] || die "'$csv' has no rows"

# gnuplot's terminal: cairo's when built in, else libgd's.
terminal=png
case "$(gnuplot -e 'set terminal' 2>&1)" in *pngcairo*) terminal=pngcairo ;; esac

# A gnuplot single-quoted string (a quote inside is doubled).
gq() { local s="${1//\'/\'\'}"; printf "'%s'" "$s"; }

# One plot command per panel. With a comma separator gnuplot reads an empty cell as missing
# data and draws each series through the rows that have it.
panel() {
  local title="$1"
  shift
  local cmd="" entry
  for entry in "$@"; do
    local col="${entry%%:*}" name="${entry#*:}"
    [ -n "$cmd" ] && cmd+=", "
    cmd+="$(gq "$csv") using $step:$col with linespoints title $(gq "${name//_/\\_}")"
  done
  printf 'set title "%s"\nplot %s\n' "$title" "$cmd"
}

panels=0
[ "${#loss[@]}" -gt 0 ] && panels=$((panels + 1))
[ "${#acc[@]}" -gt 0 ] && panels=$((panels + 1))
{
  printf 'set terminal %s size 900,%d\n' "$terminal" $((360 * panels))
  printf 'set output %s\n' "$(gq "$out")"
  printf 'set datafile separator ","\nset key outside right\nset grid\nset xlabel "step"\n'
  printf 'set pointsize 0.6\nset multiplot layout %d,1\n' "$panels"
  if [ "${#loss[@]}" -gt 0 ]; then panel loss "${loss[@]}"; fi
  if [ "${#acc[@]}" -gt 0 ]; then panel accuracy "${acc[@]}"; fi
  printf 'unset multiplot\nset output\n'
} | gnuplot - || die "gnuplot failed"

names() { local e; for e in "$@"; do printf '%s ' "${e#*:}"; done; }
echo "plotted $(names ${loss[@]+"${loss[@]}"})(loss) and $(names ${acc[@]+"${acc[@]}"})(accuracy) against step from $rows rows to $out"
