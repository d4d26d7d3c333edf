#!/usr/bin/env bash
# main_job.sh — kolo's allreduce beside Open MPI's on this machine, in one table: what
# `sh scripts/bench.sh` runs once it has built kolo.
#
# Both run the same benchmark shape (nccl-tests' flags and table: bench/all_reduce_perf for kolo
# under kolorun with kolo's default transport, bench/mpi_allreduce_perf under mpirun with Open
# MPI's shared-memory transport, `--mca pml ob1 --mca btl self,vader`), float32 sum, out of place,
# with the same -n and -w, and every result checked element by element against a reference
# (-c 1; each program checks its own). The two alternate, round after round (kolo first in odd
# rounds, Open MPI first in even ones), so that a busy spell of the machine hits both; a cell is
# the median of its rounds.
#
# Rank counts: N = 2 and N = 4, each only where the machine has at least N cores; a smaller
# machine runs the N it can and says which it left out (RANKS="2 4" runs them anyway, and the
# table marks N above the cores "oversubscribed": ranks then share cores, which measures the
# machine's scheduler more than either library).
#
# Prints one table per N (size, each library's time and bus bandwidth, and kolo's speed relative
# to Open MPI's: Open MPI's time / kolo's, above 1 where kolo is faster), a verdict line per N,
# and writes OUT_DIR/main_job.tsv (the medians) and, with gnuplot installed, OUT_DIR/main_job.png.
# Exit status 1 when a run failed or an element was wrong.
#
# Settings from the environment:
#   BUILD=./build       the meson build directory
#   OUT_DIR=BUILD/main-job   where the logs, the TSV and the PNG go
#   RANKS               default: those of "2 4" that the cores allow
#   ROUNDS=5            interleaved rounds
#   MIN_BYTES=8 MAX_BYTES=32M FACTOR=8
#   SPLIT_BYTES=1M      sizes below run SMALL_ITERS timed calls after SMALL_WARMUP, the others
#   SMALL_ITERS=100 SMALL_WARMUP=20 LARGE_ITERS=5 LARGE_WARMUP=2   LARGE_ITERS after LARGE_WARMUP
set -uo pipefail
for argument in "$@"; do
  case "$argument" in
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "main_job.sh: unknown argument $argument (settings come from the environment;" \
            "try --help)" >&2; exit 2 ;;
  esac
done

BUILD=${BUILD:-./build}
OUT_DIR=${OUT_DIR:-$BUILD/main-job}
ROUNDS=${ROUNDS:-5}
MIN_BYTES=${MIN_BYTES:-8} MAX_BYTES=${MAX_BYTES:-32M} FACTOR=${FACTOR:-8}
SPLIT_BYTES=${SPLIT_BYTES:-1M}
SMALL_ITERS=${SMALL_ITERS:-100} SMALL_WARMUP=${SMALL_WARMUP:-20}
LARGE_ITERS=${LARGE_ITERS:-5} LARGE_WARMUP=${LARGE_WARMUP:-2}
cores=$(nproc)
if [[ -z ${RANKS:-} ]]; then
  RANKS=""
  for ranks in 2 4; do
    if ((ranks <= cores)); then RANKS+="$ranks "; else
      echo "main_job.sh: N = $ranks left out: this machine has $cores cores (RANKS=\"2 4\" runs" \
           "it oversubscribed)" >&2
    fi
  done
fi
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR"/*.log "$OUT_DIR/main_job.tsv" "$OUT_DIR/main_job.png"

kolorun=$BUILD/src/kolorun kolo_perf=$BUILD/bench/all_reduce_perf
mpi_perf=$BUILD/bench/mpi_allreduce_perf
for program in "$kolorun" "$kolo_perf" "$mpi_perf"; do
  [[ -x $program ]] || { echo "main_job.sh: $program is not built (BUILD=$BUILD)" >&2; exit 1; }
done
command -v mpirun >/dev/null || { echo "main_job.sh: no mpirun (Debian: openmpi-bin)" >&2; exit 1; }
# Open MPI's shared memory copies with CMA (process_vm_readv), which some containers forbid: then
# it copies through its shared segment instead.
if ! mpirun --allow-run-as-root --oversubscribe -np 2 --mca pml ob1 --mca btl self,vader \
    "$mpi_perf" -b 1M -e 1M -n 1 -w 0 -c 1 >"$OUT_DIR/mpi_probe.log" 2>&1; then
  export OMPI_MCA_btl_vader_single_copy_mechanism=none
  echo "main_job.sh: Open MPI with CMA failed ($OUT_DIR/mpi_probe.log): it copies without" >&2
fi

# Runs one library's benchmark over both passes (small and large sizes) into one log.
#   measure LOG COMMAND...
measure() {
  local log=$1 status=0
  shift
  "$@" -b "$MIN_BYTES" -e "$SMALL_LAST" -f "$FACTOR" -n "$SMALL_ITERS" -w "$SMALL_WARMUP" -c 1 \
    >"$log" 2>&1 || status=$?
  if [[ -n $LARGE_FIRST ]] && ((status == 0)); then
    "$@" -b "$LARGE_FIRST" -e "$MAX_BYTES" -f "$FACTOR" -n "$LARGE_ITERS" -w "$LARGE_WARMUP" -c 1 \
      >>"$log" 2>&1 || status=$?
  fi
  return $status
}
to_bytes() {
  local number=${1%%[KkMmGg]*}
  case "${1##*[0-9]}" in
    K|k) echo $((number << 10)) ;; M|m) echo $((number << 20)) ;; G|g) echo $((number << 30)) ;;
    *) echo "$number" ;;
  esac
}
SMALL_LAST="" LARGE_FIRST=""
split=$(to_bytes "$SPLIT_BYTES")
for ((size = $(to_bytes "$MIN_BYTES"); size <= $(to_bytes "$MAX_BYTES"); size *= FACTOR)); do
  if ((size < split)); then SMALL_LAST=$size; elif [[ -z $LARGE_FIRST ]]; then LARGE_FIRST=$size; fi
done
[[ -n $SMALL_LAST ]] || SMALL_LAST=$(to_bytes "$MIN_BYTES")

transport=${KOLO_TRANSPORT:-auto}
load_start=$(cut -d' ' -f1 /proc/loadavg)
started=$SECONDS failed=0
records=$OUT_DIR/records.txt
: >"$records"
for ((round = 1; round <= ROUNDS; round++)); do
  for ranks in $RANKS; do
    order="kolo mpi"
    ((round % 2 == 0)) && order="mpi kolo"
    for library in $order; do
      log=$OUT_DIR/${library}_np${ranks}_round${round}.log
      echo "main_job.sh: round $round of $ROUNDS: $library, N = $ranks" >&2
      if [[ $library == kolo ]]; then
        measure "$log" "$kolorun" -np "$ranks" "$kolo_perf"
      else
        measure "$log" mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$ranks" \
          --mca pml ob1 --mca btl self,vader "$mpi_perf"
      fi
      status=$?
      if ((status != 0)); then
        failed=1
        echo "main_job.sh: $library with $ranks ranks failed (exit $status); $log ends:" >&2
        tail -n 5 "$log" | sed 's/^/    /' >&2
      fi
      # Table rows, once kolorun's "[rank] " prefix is gone: size, out-of-place time, #wrong.
      awk -v library="$library" -v ranks="$ranks" '{ sub(/^\[[0-9]+\] /, "") }
        !/^#/ && NF >= 13 && $1 ~ /^[0-9]+$/ { print library, ranks, $1, $6, $9 }' "$log" \
        >>"$records"
    done
  done
done
load_end=$(cut -d' ' -f1 /proc/loadavg)

echo
echo "allreduce, float32 sum, out of place: kolo (KOLO_TRANSPORT=$transport) beside Open MPI"\
     "$(mpirun --version 2>/dev/null | head -n 1 | awk '{ print $NF }') (btl vader)"
echo "on $(hostname), $cores cores; median of $ROUNDS interleaved rounds; every element checked;"\
     "load $load_start at the start, $load_end at the end; $((SECONDS - started)) s; logs in $OUT_DIR"
awk -v rounds="$ROUNDS" -v cores="$cores" -v tsv="$OUT_DIR/main_job.tsv" '
  function median(list,   n, values, i, j, t) {
    n = split(list, values, " ")
    for (i = 2; i <= n; i++) for (j = i; j > 1 && values[j - 1] + 0 > values[j] + 0; j--) {
      t = values[j]; values[j] = values[j - 1]; values[j - 1] = t
    }
    return n % 2 ? values[(n + 1) / 2] : (values[n / 2] + values[n / 2 + 1]) / 2
  }
  function human(bytes) {
    if (bytes >= 1048576 && bytes % 1048576 == 0) return (bytes / 1048576) " MiB"
    if (bytes >= 1024 && bytes % 1024 == 0) return (bytes / 1024) " KiB"
    return bytes " B"
  }
  {
    key = $1 SUBSEP $2 SUBSEP $3
    times[key] = times[key] " " $4; count[key]++
    if ($5 != 0) wrong[key] = 1
    if (!($2 in seen_ranks)) { seen_ranks[$2] = 1; rank_list[++rank_count] = $2 }
    if (!(($2, $3) in seen_size)) { seen_size[$2, $3] = 1; sizes[$2, ++size_count[$2]] = $3 }
  }
  END {
    print "# ranks\tbytes\tkolo_us\tmpi_us\tkolo_busbw\tmpi_busbw\tspeed" > tsv
    bad = 0
    for (r = 1; r <= rank_count; r++) {
      n = rank_list[r]
      note = n > cores ? " (oversubscribed: more ranks than cores)" : ""
      printf "\nN = %d%s\n", n, note
      printf "%10s  %10s %10s  %12s %12s  %s\n", "size", "kolo (us)", "MPI (us)", "kolo busbw",
             "MPI busbw", "kolo speed / MPI"
      faster = ""; slower = ""; worst = 0; best = 0; ok = 1
      for (s = 1; s <= size_count[n]; s++) {
        bytes = sizes[n, s]
        k = "kolo" SUBSEP n SUBSEP bytes; m = "mpi" SUBSEP n SUBSEP bytes
        if (count[k] != rounds || count[m] != rounds) {
          printf "%10s  %s\n", human(bytes), "failed: a round is missing (see the logs)"
          ok = 0; bad = 1; continue
        }
        kt = median(times[k]); mt = median(times[m])
        factor = 2 * (n - 1) / n
        kb = bytes / kt / 1e3 * factor; mb = bytes / mt / 1e3 * factor
        speed = mt / kt
        mark = (k in wrong || m in wrong) ? "  WRONG ELEMENTS" : ""
        if (mark != "") bad = 1
        printf "%10s  %10.2f %10.2f  %7.2f GB/s %7.2f GB/s  %6.2fx%s\n", human(bytes), kt, mt, kb,
               mb, speed, mark
        printf "%d\t%d\t%.3f\t%.3f\t%.4f\t%.4f\t%.4f\n", n, bytes, kt, mt, kb, mb, speed > tsv
        if (speed >= 1) faster = faster (faster == "" ? "" : ", ") human(bytes)
        else slower = slower (slower == "" ? "" : ", ") human(bytes)
        if (worst == 0 || speed < worst) { worst = speed; worst_at = human(bytes) }
        if (speed > best) { best = speed; best_at = human(bytes) }
      }
      if (!ok) { printf "verdict N = %d: incomplete (a run failed)\n", n; continue }
      if (slower == "")
        printf "verdict N = %d: kolo is as fast as Open MPI or faster at every size (%.2fx at %s to %.2fx at %s)\n", n, worst, worst_at, best, best_at
      else if (faster == "")
        printf "verdict N = %d: kolo is slower than Open MPI at every size, by up to %.2fx (at %s)\n", n, 1 / worst, worst_at
      else
        printf "verdict N = %d: kolo is within %.2fx of Open MPI at every size (slowest at %s), faster at %s (up to %.2fx at %s); slower at %s\n", n, 1 / worst, worst_at, faster, best, best_at, slower
    }
    exit bad
  }' "$records" || failed=1

# The plot: each library's time per call against size, one panel per N.
if command -v gnuplot >/dev/null && [[ -s $OUT_DIR/main_job.tsv ]]; then
  panels=$(wc -w <<<"$RANKS") panel=0
  # One tic per measured size, labelled as the table labels it.
  tics=$(awk '!/^#/ && !seen[$2]++ { b = $2
    label = b % 1048576 == 0 ? b / 1048576 " MiB" : b % 1024 == 0 ? b / 1024 " KiB" : b " B"
    printf "%s\"%s\" %s", (n++ ? ", " : ""), label, b }' "$OUT_DIR/main_job.tsv")
  {
    echo "set terminal png size $((520 * panels)),440 font ',10'"
    echo "set output '$OUT_DIR/main_job.png'"
    echo "set logscale xy; set xtics ($tics) rotate by -30; set xlabel 'allreduce size (float32 sum)'"
    echo "set ylabel 'time per call (us), lower is better'; set key top left; set grid"
    echo "set multiplot layout 1,$panels title 'kolo beside Open MPI on $(hostname), $cores cores'"
    for ranks in $RANKS; do
      echo "set title 'N = $ranks'"
      echo "plot '$OUT_DIR/main_job.tsv' using (\$1 == $ranks ? \$2 : 1/0):3 with linespoints" \
           "title 'kolo', '' using (\$1 == $ranks ? \$2 : 1/0):4 with linespoints title 'Open MPI'"
      panel=$((panel + 1))
    done
    echo "unset multiplot"
  } | gnuplot 2>"$OUT_DIR/gnuplot.log" && echo "plot: $OUT_DIR/main_job.png" ||
    echo "main_job.sh: gnuplot failed ($OUT_DIR/gnuplot.log): no plot" >&2
else
  echo "main_job.sh: no gnuplot (Debian: gnuplot-nox): no plot; the figures are in" \
       "$OUT_DIR/main_job.tsv" >&2
fi
exit $failed
