#!/usr/bin/env bash
# The cleanup lease's cost per batch (docs/benchmarks.md, "The cleanup lease"): batches of 1000
# expired keys deleted by idem_cleanup(1000) against idem_cleanup_leased(pass, 1000, 1), the
# lease's read and update included, one client, pgbench, on a throwaway cluster of the local
# PostgreSQL (fsync on). Each run loads the same 300,000 expired keys (then VACUUM ANALYZE) and
# times 290 full batches; the two ways take turns for ROUNDS rounds (3). Run as root (the
# cluster runs as the postgres user) or as that user; it prints one line per run.
#
#   scripts/cleanup-lease-cost.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${PG_BIN:-/usr/lib/postgresql/15/bin}
port=${PORT:-5499}
rounds=${ROUNDS:-3}
dir=$(mktemp -d /tmp/lease-cost.XXXXXX)
as_pg() { if [ "$(id -u)" = 0 ]; then su postgres -c "$*"; else bash -c "$*"; fi; }
chmod 755 "$dir"; [ "$(id -u)" = 0 ] && chown postgres "$dir"
cleanup() { as_pg "$bin/pg_ctl -s -D $dir/data stop -m fast" >/dev/null 2>&1 || true; rm -rf "$dir"; }
trap cleanup EXIT
as_pg "$bin/initdb -D $dir/data -A trust" >/dev/null
as_pg "$bin/pg_ctl -s -D $dir/data -o '-p $port -k $dir -c shared_buffers=256MB' -l $dir/log start"
psql=(psql -X -q -h "$dir" -p "$port" -U postgres)
"${psql[@]}" -c 'CREATE DATABASE lease_cost' >/dev/null
"${psql[@]}" -d lease_cost -v ON_ERROR_STOP=1 -f "$root/sql/idem.sql" >/dev/null 2>&1
fill() {
	"${psql[@]}" -d lease_cost -c "INSERT INTO idem.idempotency_keys (expires_at, attempt, action_hash, state, principal_id,
	    key, request_sha256, response_status, response_headers)
	  SELECT now() - interval '1 day' + i * interval '1 ms', nextval('idem.token_seq'), 0, 'c', 'p',
	         'old-' || i || '-' || random(), sha256(i::text::bytea), 200, '{}'
	    FROM generate_series(1, 300000) AS i" >/dev/null
	"${psql[@]}" -d lease_cost -c 'VACUUM ANALYZE idem.idempotency_keys' >/dev/null
}
echo 'SELECT idem.idem_cleanup(1000);' > "$dir/plain.sql"
echo "SELECT idem.idem_cleanup_leased('00000000-0000-4000-8000-000000000001', 1000, 1);" > "$dir/leased.sql"
chmod 644 "$dir"/*.sql
for round in $(seq "$rounds"); do
	for way in plain leased; do
		fill
		ms=$(as_pg "pgbench -n -h $dir -p $port -U postgres -t 290 -f $dir/$way.sql lease_cost" | awk '/latency average/ {print $4}')
		echo "round $round $way: $ms ms per batch of 1000"
	done
done
