#!/bin/bash
# callgrind-keyed.sh NAME IDEM_SQL [PART...]: instructions per transaction (callgrind) of the keyed
# part of a request, minus those of a prepared SELECT, on a private cluster (as the postgres
# user; run as root) with IDEM_SQL (a build of sql/idem.sql) installed and 50,000 completed
# keys: fresh (idem_begin and idem_complete in one statement), replay (idem_begin on a
# completed key; replayall: every column, as BeginSQL reads them; replayrow: the row as one
# record, as BeginRecordSQL reads it), seed001 (the seed tutorial's DELETE, INSERT and UPDATE)
# and handwritten (the same statements on our table); freshtx: the driver's statements, BEGIN,
# idem_begin as one record, idem_complete, COMMIT, minus basetx (the same with SELECT $1). Each part runs 200 and then 600 times in
# single-user mode, each line its own transaction; the difference over 400 leaves out every one-time cost.
# Needs valgrind. docs/benchmarks.md, "Where a keyed transaction's time goes".
set -euo pipefail
name=$1; sql=$2; shift 2
what=${*:-base fresh replay seed001 handwritten}
B=/usr/lib/postgresql/15/bin
W=/tmp/cg-$name
rm -rf $W; mkdir -p $W; chown postgres $W
cp "$sql" $W/idem.sql; chmod 644 $W/idem.sql
su postgres -c "$B/initdb -D $W/data -A trust -E UTF8 --locale=C >/dev/null"
port=$((20000 + RANDOM % 5000))
su postgres -c "$B/pg_ctl -D $W/data -o '-p $port -k $W -c fsync=off -c synchronous_commit=off' -l $W/log start >/dev/null"
P="$B/psql -X -q -h $W -p $port -v ON_ERROR_STOP=1"
su postgres -c "$P -d postgres -c 'CREATE DATABASE cg'"
su postgres -c "$P -d cg -f $W/idem.sql" >/dev/null
fp="'\\x$(printf 'a%.0s' {1..64})'::bytea"
fields="'{\"from\":\"$(printf 'b%.0s' {1..64})\",\"to\":\"$(printf 'c%.0s' {1..64})\",\"amount\":\"$(printf 'd%.0s' {1..64})\"}'"
fblob="'\\x66726f6d00bbbbbbbbbbbbbbbb746f00cccccccccccccccc616d6f756e7400dddddddddddddddd'::bytea"
su postgres -c "$P -d cg" <<SQL
SELECT count(*) FROM generate_series(1, 50000) i,
  LATERAL (SELECT idem.idem_complete('p', 'k' || i, b.attempt, 201, '{"Content-Type":"application/json"}', '\x7b7d')
             FROM idem.idem_begin('p', 'k' || i, 'POST /v1/transfers', $fp, NULL, NULL, $fields, NULL) b) c;
CREATE TABLE seed_keys (user_id bigint, key text, fingerprint bytea, response_status int,
   response_body bytea, created_at timestamptz, PRIMARY KEY (user_id, key));
CREATE INDEX ON seed_keys (created_at);
INSERT INTO seed_keys SELECT 2, 'k' || i, $fp, 201, '\x7b7d', now() FROM generate_series(1, 50000) i;
VACUUM ANALYZE;
CHECKPOINT;
SQL
su postgres -c "$B/pg_ctl -D $W/data stop -m fast >/dev/null"
gen() { # name prepare execute-template(with @): NAME.sql runs it 200 times, NAME.long.sql 600
  { echo "$2"; for i in $(seq 1 200); do echo "${3//@/$i}"; done; } > $W/$1.sql
  { echo "$2"; for i in $(seq 1001 1600); do echo "${3//@/$i}"; done; } > $W/$1.long.sql
}
gen replayrow "PREPARE s(text) AS SELECT idem.idem_begin('p', \$1, 'POST /v1/transfers', $fp, NULL, NULL, $fields, NULL);" "EXECUTE s('k@7');"
gen replayall "PREPARE s(text) AS SELECT * FROM idem.idem_begin('p', \$1, 'POST /v1/transfers', $fp, NULL, NULL, $fields, NULL);" "EXECUTE s('k@7');"
gen base "PREPARE s(text) AS SELECT \$1;" "EXECUTE s('g@');"
gen fresh "PREPARE s(text) AS SELECT idem.idem_complete('p', \$1, b.attempt, 201, '{\"Content-Type\":\"application/json\"}', '\\x7b7d') FROM idem.idem_begin('p', \$1, 'POST /v1/transfers', $fp, NULL, NULL, $fields, NULL) b;" "EXECUTE s('g@');"
gen freshtx "PREPARE b(text) AS SELECT idem.idem_begin('p', \$1, 'POST /v1/transfers', $fp, NULL, NULL, $fields, NULL); PREPARE c(text) AS SELECT idem.idem_complete('p', \$1, currval('idem.token_seq'), 201, '{\"Content-Type\":\"application/json\"}', '\\x7b7d');" "BEGIN; EXECUTE b('t@'); EXECUTE c('t@'); COMMIT;"
gen basetx "PREPARE s(text) AS SELECT \$1;" "BEGIN; EXECUTE s('t@'); EXECUTE s('t@'); COMMIT;"
gen replay "PREPARE s(text) AS SELECT outcome, provider_key FROM idem.idem_begin('p', \$1, 'POST /v1/transfers', $fp, NULL, NULL, $fields, NULL);" "EXECUTE s('k@7');"
gen seed001 "PREPARE d(text) AS DELETE FROM seed_keys WHERE user_id = 1 AND key = \$1 AND created_at < now() - interval '24 hours'; PREPARE i(text) AS INSERT INTO seed_keys (user_id, key, fingerprint, created_at) VALUES (1, \$1, $fp, now()) ON CONFLICT DO NOTHING; PREPARE u(text) AS UPDATE seed_keys SET response_status = 201, response_body = '\\x7b7d' WHERE user_id = 1 AND key = \$1;" "BEGIN; EXECUTE d('g@'); EXECUTE i('g@'); EXECUTE u('g@'); COMMIT;"
gen handwritten "PREPARE d(text) AS DELETE FROM idem.idempotency_keys WHERE principal_id = 'p' AND key = \$1 AND expires_at <= now(); PREPARE i(text) AS INSERT INTO idem.idempotency_keys (expires_at, attempt, action_hash, state, uncompleted, principal_id, key, request_sha256, request_fields) VALUES (now() + interval '24 hours', nextval('idem.token_seq'), hashtextextended('POST /v1/transfers', 0), 'p', true, 'p', \$1, $fp, $fblob) ON CONFLICT DO NOTHING RETURNING attempt; PREPARE u(text) AS UPDATE idem.idempotency_keys SET state = 'c', uncompleted = NULL, response_status = 201, response_headers = '{\"Content-Type\":\"application/json\"}', response_body = '\\x7b7d' WHERE principal_id = 'p' AND key = \$1;" "BEGIN; EXECUTE d('h@'); EXECUTE i('h@'); EXECUTE u('h@'); COMMIT;"
chown postgres $W/*.sql
run() { # script -> total instructions
  su postgres -c "cd $W && valgrind --tool=callgrind --callgrind-out-file=$W/cg.$1.out $B/postgres --single -D $W/data cg < $W/$1.sql > $W/$1.stdout 2>$W/$1.vg" || true
  callgrind_annotate $W/cg.$1.out 2>/dev/null > $W/$1.annot || true; grep -m1 'PROGRAM TOTALS' $W/$1.annot | awk '{gsub(",","",$1); print $1}'
}
declare -A n
for w in $what; do s=$(run $w); l=$(run $w.long); n[$w]=$(( (l - s) / 400 )); done
for w in $what; do
  errs=$(cat $W/$w.long.stdout $W/$w.long.vg $W/$w.stdout $W/$w.vg | grep -c 'ERROR' || true)
  echo "$name $w $(( n[$w] - n[base] )) (errors $errs)"
done
