#!/bin/bash
# perf-sql.sh [CLIENTS] [VARIANTS]: where the machine's CPU goes per committed transaction, side
# by side, for variants of `make bench`'s sql part (default: 16 clients, functions,seed001).
# It runs the part (3 rounds of 20 s) and, in the middle of each run, `perf record -a` for 14 s
# (499 samples a second on each core, every process); then it prints, per variant and summed
# over the rounds, the µs of CPU per transaction of each process and library, and of the
# postgres processes' 40 busiest symbols. A sample stands for 1/499 s of one core; a run's
# transactions while it recorded are its rate times 14 s. Needs perf (linux-perf) and a quiet
# machine; run it as root. docs/benchmarks.md, "The same profile at 16 clients and at 2".
set -euo pipefail
clients=${1:-16}
variants=${2:-functions,seed001}
cd "$(dirname "$0")/.."
W=$(mktemp -d /tmp/perf-sql.XXXXXX)
go build -o "$W/bench" ./internal/tools/bench
cd "$W"
BENCH_CLIENTS=$clients BENCH_ONLY=sql BENCH_SQL_VARIANTS=$variants BENCH_ROUNDS=3 BENCH_SECONDS=20 \
    ./bench >out.txt 2>&1 &
bench=$!
rec() { sleep 3; perf record -a -F 499 -o "perf.$1.data" -- sleep 14 >/dev/null 2>&1; }
until grep -q '^SQL: ' out.txt 2>/dev/null; do
    kill -0 $bench 2>/dev/null || { cat out.txt; exit 1; }
    sleep 0.2
done
# One recording in each run; the part prints a run's line when the run ends, so the i-th
# recording belongs to the i-th progress line.
runs=$((3 * $(tr , '\n' <<<"$variants" | grep -c .)))
for i in $(seq $runs); do
    rec $i
    until [ "$(grep -c '^  round ' out.txt)" -ge $i ]; do
        kill -0 $bench 2>/dev/null || { cat out.txt; exit 1; }
        sleep 0.2
    done
done
wait $bench
grep '^  round ' out.txt
grep '^  round ' out.txt | awk '{ print NR, $3, $4 }' >runs.txt
for v in $(awk '{ print $2 }' runs.txt | sort -u); do
    awk -v v=$v '$2 == v { print $1, $3 }' runs.txt | while read -r i tps; do
        perf report -i "perf.$i.data" --sort comm,dso,sym --stdio -n 2>/dev/null |
            awk -v i=$i -v tps="$tps" '/^#/ || NF < 6 { next } { print i, tps, $2, $3, $4, $6 }'
    done | awk -v v=$v '
        { tx[$1] = $2 * 14; n = $3 / 499 * 1e6; what[$4 " " $5] += n; if ($4 == "postgres") sym[$5 " " $6] += n }
        END {
            for (i in tx) total += tx[i]
            printf "\n== %s: µs of CPU per transaction, by process and library\n", v
            for (k in what) printf "%9.1f  %s\n", what[k] / total, k | "sort -rn | head -12"
            close("sort -rn | head -12")
            printf "== %s: the postgres processes, by symbol\n", v
            for (k in sym) printf "%9.1f  %s\n", sym[k] / total, k | "sort -rn | head -40"
            close("sort -rn | head -40")
        }'
done
echo "recordings and output: $W"
