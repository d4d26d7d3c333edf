#!/usr/bin/env bash
# compare_mpi.sh — kolo's allreduce next to Open MPI's MPI_Allreduce on this machine, over shared
# memory (btl vader) and over TCP on loopback (btl tcp), for 2 and 4 ranks, and a markdown table of
# the out-of-place bus bandwidth of each. kolo runs over its TCP transport and, where it was built
# with UCX, over UCX (KOLO_TRANSPORT=ucx with UCX's default transports: shared memory and CMA here;
# UCX_TLS and UCX_NET_DEVICES from the environment apply). The "loopback" column is what TCP over
# the loopback carries in the same pattern with nothing else to do (bench/tcp_loopback: every
# process sending to the next and receiving from the previous at once, the rate one process sends
# at), with kolo's socket options and congestion control (reno within a host): the ceiling of
# kolo's TCP column. Open MPI keeps the kernel's default congestion control (bbr on some kernels,
# which is slower over the loopback: docs/performance.md, "Large buffers over TCP").
#
# Open MPI's allreduce mallocs a temporary buffer of the message's size on every call, which glibc
# maps fresh (and pays page faults for) above its mmap threshold. The "MPI shm kept" column runs the
# shared-memory case again with MALLOC_MMAP_MAX_=0 and a huge MALLOC_TRIM_THRESHOLD_, so that
# freed memory is kept and reused: Open MPI's figure without that handicap.
#
#   bench/compare_mpi.sh            64 KiB .. 256 MiB, every 4x
#   bench/compare_mpi.sh --quick    64 KiB .. 16 MiB, fewer iterations (about a minute)
#
# On a shared machine one run says little: ROUNDS=8 runs every configuration eight times,
# interleaved (round 1 of each, then round 2 ...), and each cell is the median of its rounds.
# With PLOT=file.svg and gnuplot installed (Debian: gnuplot-nox) the table is also drawn, one
# panel per rank count; the numbers behind it are in LOG_DIR/busbw.tsv either way.
#
# Settings come from the environment:
#   BUILD=./build            the meson build directory (kolorun, all_reduce_perf, mpi_allreduce_perf)
#   RANKS="2 4"              rank counts to run
#   MIN_BYTES=64K MAX_BYTES=256M FACTOR=4
#   SPLIT_BYTES=4M           sizes below run SMALL_ITERS timed calls, the others LARGE_ITERS
#   SMALL_ITERS=20 SMALL_WARMUP=5 LARGE_ITERS=5 LARGE_WARMUP=2
#   CHECK=1                  check every result (0: skip the checks, faster)
#   DTYPE=float OP=sum
#   ROUNDS=1                 interleaved rounds; cells are medians
#   PLOT=                    an SVG file to draw the table into (needs gnuplot)
#   LOG_DIR=<new temporary>  where the full nccl-tests-style output of every run is kept
#   MPIRUN_ARGS="--bind-to none"   extra mpirun flags (kolorun pins nothing either)
#   CONFIGS="kolo kolo_ucx mpi_shm mpi_shm_kept mpi_tcp loopback"   the columns (those available)
#
# A cell reads "fail" when the run failed and ends in "!" when some element was wrong; the logs
# say why.
set -uo pipefail

quick=0
for argument in "$@"; do
  case "$argument" in
    --quick) quick=1 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "compare_mpi.sh: unknown argument $argument (try --help)" >&2; exit 2 ;;
  esac
done

BUILD=${BUILD:-./build}
RANKS=${RANKS:-"2 4"}
MIN_BYTES=${MIN_BYTES:-64K}
FACTOR=${FACTOR:-4}
SPLIT_BYTES=${SPLIT_BYTES:-4M}
CHECK=${CHECK:-1}
DTYPE=${DTYPE:-float}
OP=${OP:-sum}
MPIRUN_ARGS=${MPIRUN_ARGS:---bind-to none}
ROUNDS=${ROUNDS:-1}
PLOT=${PLOT:-}
if [[ $quick == 1 ]]; then
  MAX_BYTES=${MAX_BYTES:-16M}
  SMALL_ITERS=${SMALL_ITERS:-10} SMALL_WARMUP=${SMALL_WARMUP:-2}
  LARGE_ITERS=${LARGE_ITERS:-3} LARGE_WARMUP=${LARGE_WARMUP:-1}
else
  MAX_BYTES=${MAX_BYTES:-256M}
  SMALL_ITERS=${SMALL_ITERS:-20} SMALL_WARMUP=${SMALL_WARMUP:-5}
  LARGE_ITERS=${LARGE_ITERS:-5} LARGE_WARMUP=${LARGE_WARMUP:-2}
fi
LOG_DIR=${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/compare_mpi.XXXXXX")}
mkdir -p "$LOG_DIR"

kolorun=$BUILD/src/kolorun
kolo_perf=$BUILD/bench/all_reduce_perf
mpi_perf=$BUILD/bench/mpi_allreduce_perf
for program in "$kolorun" "$kolo_perf"; do
  [[ -x $program ]] || { echo "compare_mpi.sh: $program is not built (BUILD=$BUILD)" >&2; exit 1; }
done
have_mpi=1
if [[ ! -x $mpi_perf ]] || ! command -v mpirun >/dev/null; then
  echo "compare_mpi.sh: no $mpi_perf or no mpirun: only kolo is measured" >&2
  have_mpi=0
fi

# "64K" -> 65536 (powers of 1024, as the benchmarks read them).
to_bytes() {
  local number=${1%%[KkMmGg]*} unit=${1##*[0-9]}
  case "$unit" in
    K|k) echo $((number << 10)) ;; M|m) echo $((number << 20)) ;; G|g) echo $((number << 30)) ;;
    *) echo "$number" ;;
  esac
}
# 65536 -> "64K", for the table.
human() {
  local bytes=$1
  if ((bytes >= 1 << 30 && bytes % (1 << 30) == 0)); then echo "$((bytes >> 30))G"
  elif ((bytes >= 1 << 20 && bytes % (1 << 20) == 0)); then echo "$((bytes >> 20))M"
  elif ((bytes >= 1 << 10 && bytes % (1 << 10) == 0)); then echo "$((bytes >> 10))K"
  else echo "$bytes"; fi
}

# The sizes of the grid, split into the small pass (below SPLIT_BYTES) and the large one.
min=$(to_bytes "$MIN_BYTES") max=$(to_bytes "$MAX_BYTES") split=$(to_bytes "$SPLIT_BYTES")
sizes=() small_last=0 large_first=0
for ((size = min; size <= max; size = size * FACTOR)); do
  sizes+=("$size")
  if ((size < split)); then small_last=$size; elif ((large_first == 0)); then large_first=$size; fi
  ((FACTOR > 1)) || break
done

# Runs one benchmark command over both passes, appending to one log.
#   measure LOG COMMAND...
measure() {
  local log=$1 status=0
  shift
  : >"$log"
  if ((small_last > 0)); then
    "$@" -b "$min" -e "$small_last" -f "$FACTOR" -n "$SMALL_ITERS" -w "$SMALL_WARMUP" \
      -c "$CHECK" -d "$DTYPE" -o "$OP" >>"$log" 2>&1 || status=$?
  fi
  if ((large_first > 0 && status == 0)); then
    "$@" -b "$large_first" -e "$max" -f "$FACTOR" -n "$LARGE_ITERS" -w "$LARGE_WARMUP" \
      -c "$CHECK" -d "$DTYPE" -o "$OP" >>"$log" 2>&1 || status=$?
  fi
  return $status
}

# The btl is only honoured by the ob1 pml, hence --mca pml ob1 (where UCX is installed, the ucx pml
# would otherwise win and ignore --mca btl).
# Open MPI's shared-memory transport copies with CMA (process_vm_readv), which some containers
# forbid; fall back to copying through the shared segment when a tiny run fails.
if ((have_mpi)) && ! mpirun --allow-run-as-root --oversubscribe -np 2 --mca pml ob1 \
    --mca btl self,vader "$mpi_perf" -b 1M -e 1M -n 1 -w 0 -c 1 >"$LOG_DIR/mpi_probe.log" 2>&1; then
  export OMPI_MCA_btl_vader_single_copy_mechanism=none
  echo "compare_mpi.sh: vader with CMA failed (see $LOG_DIR/mpi_probe.log); using" \
       "OMPI_MCA_btl_vader_single_copy_mechanism=none" >&2
fi

# A build without UCX refuses KOLO_TRANSPORT=ucx at once: no UCX column then.
have_ucx=1
if ! KOLO_TRANSPORT=ucx "$kolorun" -np 2 "$kolo_perf" -b 1M -e 1M -n 1 -w 0 -c 1 \
    >"$LOG_DIR/ucx_probe.log" 2>&1; then
  echo "compare_mpi.sh: kolo over UCX failed (see $LOG_DIR/ucx_probe.log): no UCX column" >&2
  have_ucx=0
fi

available=(kolo)
((have_ucx)) && available+=(kolo_ucx)
((have_mpi)) && available+=(mpi_shm mpi_shm_kept mpi_tcp)
[[ -x $BUILD/bench/tcp_loopback ]] && available+=(loopback)
configs=()
for config in ${CONFIGS:-${available[*]}}; do
  if [[ " ${available[*]} " == *" $config "* ]]; then configs+=("$config")
  else echo "compare_mpi.sh: no column $config here (available: ${available[*]})" >&2; exit 2; fi
done

# The loopback's ceiling at every size, as rows of the benchmarks' table (field 8: the slowest
# process's median rate, field 9: no wrong elements; tcp_loopback checks what arrived itself).
#   loopback_rows RANKS
loopback_rows() {
  local size iterations status=0
  for size in "${sizes[@]}"; do
    iterations=$LARGE_ITERS
    ((size < split)) && iterations=$SMALL_ITERS
    "$BUILD/bench/tcp_loopback" "$1" "$size" "$iterations" >"$LOG_DIR/tcp_loopback.out" 2>&1 ||
      status=1
    cat "$LOG_DIR/tcp_loopback.out"
    awk -v size="$size" '/median/ { rate = $(NF - 4) + 0; if (min == "" || rate < min) min = rate }
      END { if (min != "") print size, 0, "float", "sum", -1, 0, 0, min, 0, 0, 0, 0, 0 }' \
      "$LOG_DIR/tcp_loopback.out"
  done
  return $status
}
declare -A busbw  # every round's figures of a cell, space-separated
started=$SECONDS
# Other work on the machine skews every column; the table says how busy it was.
load_at_start=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo '?')
for ((round = 1; round <= ROUNDS; round++)); do
for ranks in $RANKS; do
  for config in "${configs[@]}"; do
    log=$LOG_DIR/${config}_np${ranks}_round${round}.log
    echo "compare_mpi.sh: round $round of $ROUNDS: $config with $ranks ranks ..." >&2
    # shellcheck disable=SC2086  # MPIRUN_ARGS is a list of flags
    case "$config" in
      kolo) measure "$log" env KOLO_TRANSPORT=tcp "$kolorun" -np "$ranks" "$kolo_perf" ;;
      kolo_ucx) measure "$log" env KOLO_TRANSPORT=ucx "$kolorun" -np "$ranks" "$kolo_perf" ;;
      mpi_shm) measure "$log" mpirun --allow-run-as-root --oversubscribe $MPIRUN_ARGS -np "$ranks" \
                 --mca pml ob1 --mca btl self,vader "$mpi_perf" ;;
      mpi_shm_kept) measure "$log" env MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 \
                 mpirun --allow-run-as-root --oversubscribe $MPIRUN_ARGS -np "$ranks" \
                 -x MALLOC_MMAP_MAX_ -x MALLOC_TRIM_THRESHOLD_ \
                 --mca pml ob1 --mca btl self,vader "$mpi_perf" ;;
      loopback) loopback_rows "$ranks" >"$log" 2>&1 ;;
      mpi_tcp) measure "$log" mpirun --allow-run-as-root --oversubscribe $MPIRUN_ARGS -np "$ranks" \
                 --mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include lo "$mpi_perf" ;;
    esac
    status=$?
    # Rows are the lines that are not comments, once kolorun's "[rank] " prefix is dropped: field 1
    # is the size, 8 the out-of-place busbw, 9 its #wrong.
    while read -r size value wrong; do
      [[ $wrong =~ ^[0-9]+$ && $wrong != 0 ]] && value="$value!"
      busbw[$config,$ranks,$size]+="$value "
    done < <(awk '{ sub(/^\[[0-9]+\] /, "") }
                  !/^#/ && NF >= 13 && $1 ~ /^[0-9]+$/ { print $1, $8, $9 }' "$log")
    if ((status != 0)); then
      echo "compare_mpi.sh: $config with $ranks ranks failed (exit $status), see $log:" >&2
      tail -n 5 "$log" | sed 's/^/    /' >&2
    fi
  done
done
done

# The median of a cell's rounds; "fail" when a round is missing, a "!" when any round had a wrong
# element.
median() {
  local values=$1 mark=""
  [[ $values == *!* ]] && mark="!"
  values=${values//!/}
  local count
  count=$(wc -w <<<"$values")
  ((count == ROUNDS)) || { echo fail; return; }
  printf '%s\n' $values | sort -g | awk -v mark="$mark" '{ v[NR] = $1 }
    END { m = NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%.2f%s\n", m, mark }'
}

declare -A titles=([kolo]="kolo tcp" [kolo_ucx]="kolo ucx" [mpi_shm]="MPI shm"
                   [mpi_shm_kept]="MPI shm kept" [mpi_tcp]="MPI tcp" [loopback]="loopback")
what="allreduce busbw in GB/s (out of place, $DTYPE $OP"
((ROUNDS > 1)) && what+=", median of $ROUNDS interleaved rounds"
what+=") on $(hostname), $(nproc) cores, load $load_at_start at the start and"
what+=" $(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo '?') at the end; $((SECONDS - started)) s"
echo
echo "$what; logs in $LOG_DIR"
echo
header="| size |" rule="|-----:|" tsv_header="bytes"
for ranks in $RANKS; do
  for config in "${configs[@]}"; do
    header+=" ${titles[$config]} N=$ranks |"
    rule+="------:|"
    tsv_header+=$'\t'"${titles[$config]} N=$ranks"
  done
done
echo "$header"
echo "$rule"
tsv=$LOG_DIR/busbw.tsv
echo "$tsv_header" >"$tsv"
wrong=0
for size in "${sizes[@]}"; do
  line="| $(human "$size") |" row=$size
  for ranks in $RANKS; do
    for config in "${configs[@]}"; do
      value=$(median "${busbw[$config,$ranks,$size]:-}")
      [[ $value == *! || $value == fail ]] && wrong=1
      line+=" $value |"
      row+=$'\t'"${value%!}"
    done
  done
  echo "$line"
  echo "$row" >>"$tsv"
done

# The plot: busbw against size, one panel per rank count, one line per configuration.
if [[ -n $PLOT ]]; then
  if ! command -v gnuplot >/dev/null; then
    echo "compare_mpi.sh: no gnuplot (apt-get install gnuplot-nox): no plot" >&2
  else
    panels=$(wc -w <<<"$RANKS") columns=${#configs[@]} panel=0
    {
      echo "set terminal svg size $((480 * panels)),400 dynamic font 'sans,11'"
      echo "set output '$PLOT'"
      echo "set datafile separator tab; set datafile missing 'fail'"
      echo "set logscale x 2; set format x '%.0b%B'; set xlabel 'bytes'"
      echo "set ylabel 'busbw (GB/s)'; set yrange [0:*]; set key top left; set grid"
      echo "set multiplot layout 1,$panels title \"${what//\"/}\" font 'sans,10'"
      for ranks in $RANKS; do
        plots=()
        for ((c = 0; c < columns; c++)); do
          plots+=("'$tsv' using 1:$((2 + panel * columns + c)) with linespoints title columnhead")
        done
        echo "set title 'N = $ranks'"
        (IFS=,; echo "plot ${plots[*]}")
        panel=$((panel + 1))
      done
      echo "unset multiplot"
    } | gnuplot || echo "compare_mpi.sh: gnuplot failed: no plot" >&2
  fi
fi
exit $wrong
