#!/usr/bin/env bash
# Cleanup on a Citus cluster, from the coordinator against per worker (docs/benchmarks.md,
# "Cleanup on Citus"). Each run loads the same backlog (KEYS expired keys over PRINCIPALS
# principals, then VACUUM ANALYZE and a CHECKPOINT on every node), then times one way of
# deleting it; the ways take turns, round after round (every other round in the opposite
# order), so that the machine's drift reaches all of them alike. Prints one line per run and,
# at the end, each way's median rows/s and its ratio to the per-worker call.
#
#   CITUS_URL=$(scripts/citus-dev-cluster.sh url) scripts/citus-cleanup-bench.sh
#
# The database must hold the reference server's schema, distributed (scripts/citus-dev-cluster.sh
# idem), and nothing else that matters: every round deletes all the expired keys in it.
# Settings: ROUNDS (5), KEYS (300000), PRINCIPALS (1000), WAYS (by name, comma-separated; by
# default all but rounds-1000, idem_cleanup's one batch per call, which takes minutes).
set -euo pipefail

: "${CITUS_URL:?set CITUS_URL to the coordinator (scripts/citus-dev-cluster.sh url)}"
ROUNDS=${ROUNDS:-5}
KEYS=${KEYS:-300000}
PRINCIPALS=${PRINCIPALS:-1000}
REPO=$(cd "$(dirname "$0")/.." && pwd)
(cd "$REPO" && go build -o bin/server ./cmd/server)

# Each way, by name: the SQL run in one psql session (or the server's own cleanup pass).
declare -A WAY=(
    [workers-1000]='SELECT run_command_on_workers($$CALL idem.idem_cleanup_all(1000)$$)'
    [workers-5000]='SELECT run_command_on_workers($$CALL idem.idem_cleanup_all(5000)$$)'
    [coordinator-all-1000]='CALL idem.idem_cleanup_all(1000)'
    [coordinator-all-5000]='CALL idem.idem_cleanup_all(5000)'
    [server-cleanup-1000]='server'
    [rounds-1000]='DO $$DECLARE n integer; BEGIN LOOP n := idem.idem_cleanup(1000); COMMIT; EXIT WHEN n < 1000; END LOOP; END$$'
)
ORDER=(workers-1000 coordinator-all-1000 server-cleanup-1000 workers-5000 coordinator-all-5000)
if [ -n "${WAYS:-}" ]; then IFS=, read -r -a ORDER <<<"$WAYS"; fi

psql_q() { psql -X -q -v ON_ERROR_STOP=1 -d "$CITUS_URL" "$@"; }

# The backlog is written once into public.idem_bench_keys, a table of the key table's shape
# distributed with it, and copied from there before each run (Citus runs the copy on every
# shard at once).
setup() {
    psql_q -c "INSERT INTO ledger.principals (id, name) SELECT 'bench' || i, 'bench' || i FROM generate_series(1, $PRINCIPALS) AS i
                 ON CONFLICT DO NOTHING" \
           -c "DROP TABLE IF EXISTS public.idem_bench_keys" \
           -c "CREATE TABLE public.idem_bench_keys (LIKE idem.idempotency_keys)" \
           -c "SELECT create_distributed_table('public.idem_bench_keys', 'principal_id', colocate_with => 'idem.idempotency_keys')" \
           -c "INSERT INTO public.idem_bench_keys (expires_at, attempt, action_hash, state, principal_id, key, request_sha256,
                 response_status, response_headers)
               SELECT now() - interval '1 day' + i * interval '1 ms', i, 0, 'c', 'bench' || (i % $PRINCIPALS + 1), 'old-' || i,
                      sha256(i::text::bytea), 200, '{}'
                 FROM generate_series(1, $KEYS) AS i" >/dev/null
}
load() {
    psql_q -c "INSERT INTO idem.idempotency_keys SELECT * FROM public.idem_bench_keys" \
           -c "VACUUM ANALYZE idem.idempotency_keys" \
           -c "CHECKPOINT" -c "SELECT run_command_on_workers('CHECKPOINT')" >/dev/null
}

left() { psql_q -At -c "SELECT count(*) FROM idem.idempotency_keys WHERE expires_at <= now()"; }

declare -A RATES
echo "$(date -u +%FT%TZ) $KEYS expired keys over $PRINCIPALS principals, $ROUNDS rounds; $(psql_q -At -c 'SELECT citus_version()' | cut -d' ' -f1-2)"
psql_q -c "DELETE FROM idem.idempotency_keys WHERE expires_at <= now()"
setup
trap 'psql_q -c "DROP TABLE IF EXISTS public.idem_bench_keys"' EXIT
for round in $(seq 1 "$ROUNDS"); do
    # Every other round in the opposite order, so that a drift within a round evens out.
    ways=("${ORDER[@]}")
    if [ $((round % 2)) = 0 ]; then
        ways=()
        for ((i = ${#ORDER[@]} - 1; i >= 0; i--)); do ways+=("${ORDER[$i]}"); done
    fi
    for way in "${ways[@]}"; do
        load
        if [ "${WAY[$way]}" = server ]; then
            # The pass's own time, as `server cleanup` reports it (the process's start excluded).
            took=$(DATABASE_URL=$CITUS_URL CLEANUP_BATCH_SIZE=1000 CLEANUP_VACUUM=false "$REPO/bin/server" cleanup |
                sed -n 's/^deleted [0-9]* expired keys in \([0-9.]*\) s$/\1/p')
        else
            began=$(date +%s.%N)
            psql_q -c "${WAY[$way]}" >/dev/null
            took=$(echo "$(date +%s.%N) - $began" | bc)
        fi
        n=$(left)
        if [ "$n" != 0 ]; then echo "$way left $n expired keys" >&2; exit 1; fi
        rate=$(echo "$KEYS / $took" | bc)
        RATES[$way]="${RATES[$way]:-} $rate"
        printf 'round %d  %-22s %8.3f s  %7d rows/s\n' "$round" "$way" "$took" "$rate"
    done
done
median() { sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
echo "medians (rows/s), and every run:"
declare -A MEDIAN
for way in "${ORDER[@]}"; do
    read -r -a r <<<"${RATES[$way]}"
    MEDIAN[$way]=$(printf '%s\n' "${r[@]}" | median)
    printf '  %-22s %7.0f  (%s)\n' "$way" "${MEDIAN[$way]}" "${RATES[$way]# }"
done
# Each coordinator way against the per-worker call of the same batch size: the ratio of the
# medians, and the median of the rounds' ratios (each round's runs are neighbours in time).
for way in "${ORDER[@]}"; do
    batch=${way##*-}
    base=workers-$batch
    case $way in workers-*) continue ;; esac
    [ -n "${RATES[$base]:-}" ] || continue
    read -r -a a <<<"${RATES[$way]}"
    read -r -a b <<<"${RATES[$base]}"
    ratios=$(for i in "${!a[@]}"; do echo "scale=3; ${a[$i]} / ${b[$i]}" | bc; done | tr '\n' ' ')
    printf '  %-22s / %-13s medians %.2f, rounds %.2f  (%s)\n' "$way" "$base" \
        "$(echo "scale=3; ${MEDIAN[$way]} / ${MEDIAN[$base]}" | bc)" "$(echo "$ratios" | tr ' ' '\n' | grep . | median)" "${ratios% }"
done
