//go:build citus

// The SQL API on a real Citus cluster (make test-citus, CITUS_URL): what the stand-in tests
// (pgtest.CitusStandIn) show with "workers" that are tables of one database, here with real
// workers behind a coordinator.

package tests

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// citusDB is a database of its own on every node of the cluster at CITUS_URL, with the SQL
// API installed and distributed as docs/scale-out.md says (steps 2 to 5), and a pool on it
// at the coordinator.
func citusDB(t *testing.T) (string, *pgxpool.Pool) {
	t.Helper()
	db := pgtest.CitusDB(t)
	pgtest.CitusInstall(t, db)
	pgtest.CitusDistribute(t, db)
	pool, err := pgxpool.New(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return db, pool
}

// onWorkers runs a query that returns one integer on every worker (run_command_on_workers)
// and returns their answers, in the order of the workers' groups.
func onWorkers(t *testing.T, pool *pgxpool.Pool, sql string) []int64 {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT success, result FROM run_command_on_workers($1) ORDER BY nodeport`, sql)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []int64
	for rows.Next() {
		var ok bool
		var r string
		if err := rows.Scan(&ok, &r); err != nil {
			t.Fatal(err)
		}
		if !ok {
			t.Fatalf("on a worker: %s: %s", sql, r)
		}
		var n int64
		if _, err := fmt.Sscan(r, &n); err != nil {
			t.Fatalf("on a worker: %s: %q", sql, r)
		}
		out = append(out, n)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// insertCitusExpired writes n expired completed keys through the coordinator, spread over
// principals principals (so over the shards of every worker).
func insertCitusExpired(t *testing.T, q pgtest.Querier, prefix string, n, principals int) {
	t.Helper()
	pgtest.Exec(t, q, `INSERT INTO idem.idempotency_keys (expires_at, attempt, action_hash, state, principal_id, key,
		request_sha256, response_status, response_headers)
		SELECT now() - interval '1 day' + i * interval '1 ms', i, 0, 'c', $1 || (i % $3), 'old-' || i,
		       sha256(i::text::bytea), 200, '{}'
		  FROM generate_series(1, $2) AS i`, prefix, n, principals)
}

// TestCitusDistribute: sql/citus/distribute.sql, run as the docs say after sql/idem.sql and
// then again, distributes the key table by principal over every worker, makes the guard a
// reference table, gives each worker its own range of fencing tokens and the plan-cache
// workaround of its Citus version, and leaves the functions on the workers executable by the
// application role and by no other (PUBLIC); the API answers through the coordinator.
func TestCitusDistribute(t *testing.T) {
	db, pool := citusDB(t)
	ctx := context.Background()
	if out := pgtest.CitusDistribute(t, db); !strings.Contains(out, "local shards") {
		t.Fatalf("distribute.sql run again:\n%s", out)
	}
	var keys, guard string
	if err := pool.QueryRow(ctx, `SELECT
		(SELECT partmethod::text || repmodel::text FROM pg_dist_partition WHERE logicalrelid = 'idem.idempotency_keys'::regclass),
		(SELECT partmethod::text || repmodel::text FROM pg_dist_partition WHERE logicalrelid = 'idem.claim_guard'::regclass)`).Scan(&keys, &guard); err != nil {
		t.Fatal(err)
	}
	if keys != "hs" || guard != "nt" {
		t.Fatalf("the key table is %q and the guard %q in pg_dist_partition; want hash-distributed (hs) and a reference table (nt)", keys, guard)
	}
	_, workers := pgtest.CitusNodes(t)
	shards := onWorkers(t, pool, `SELECT cardinality(idem.key_relations())`)
	tokens := onWorkers(t, pool, `SELECT min_value FROM pg_sequences WHERE schemaname = 'idem' AND sequencename = 'attempt_seq'`)
	var sum int64
	for i, n := range shards {
		sum += n
		if n == 0 || tokens[i]>>48 == 0 || (i > 0 && tokens[i] == tokens[i-1]) {
			t.Fatalf("the workers' shards %v and token ranges %v: want shards on each and a range of its own", shards, tokens)
		}
	}
	if len(shards) != len(workers) || sum != 32 {
		t.Fatalf("shards on the workers %v, want 32 over %d workers", shards, len(workers))
	}
	for _, w := range workers {
		conn := pgtest.Connect(t, pgtest.CitusNodeURL(t, db, w))
		var app, public, internal bool
		var cache string
		if err := conn.QueryRow(ctx, `SELECT
			has_function_privilege('idem_app', 'idem.idem_begin(text,text,text,bytea,interval,interval,jsonb,interval)', 'EXECUTE'),
			EXISTS (SELECT FROM pg_proc p, aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
			         WHERE p.pronamespace = 'idem'::regnamespace AND a.grantee = 0),
			has_function_privilege('idem_app', 'idem.cleanup_node(integer,double precision,double precision,text)', 'EXECUTE'),
			current_setting('plan_cache_mode')`).Scan(&app, &public, &internal, &cache); err != nil {
			t.Fatal(err)
		}
		if !app || public || internal {
			t.Fatalf("worker %v: idem_app may call idem_begin %v, PUBLIC may call something %v, idem_app may call cleanup_node %v",
				w, app, public, internal)
		}
		var version string
		if err := conn.QueryRow(ctx, `SELECT substring(citus_version() FROM 'Citus ([0-9.]+)')`).Scan(&version); err != nil {
			t.Fatal(err)
		}
		if (version == "13.2.1" || version == "13.2.2") != (cache == "force_custom_plan") {
			t.Fatalf("worker %v runs Citus %s with plan_cache_mode %s", w, version, cache)
		}
	}

	// The API through the coordinator: a claim, its completion, its replay.
	var outcome string
	var attempt int64
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if err := tx.QueryRow(ctx, `SELECT outcome, attempt FROM idem.idem_begin('alice', 'k1', 'POST /x', sha256('x'))`).Scan(&outcome, &attempt); err != nil || outcome != "claimed" {
		t.Fatalf("a claim through the coordinator: %s %v", outcome, err)
	}
	pgtest.Exec(t, tx, `SELECT idem.idem_complete('alice', 'k1', $1, 201, '{}', 'done')`, attempt)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var body []byte
	if err := pool.QueryRow(ctx, `SELECT outcome, response_body FROM idem.idem_begin('alice', 'k1', 'POST /x', sha256('x'))`).Scan(&outcome, &body); err != nil ||
		outcome != "replay" || string(body) != "done" {
		t.Fatalf("the replay through the coordinator: %s %q %v", outcome, body, err)
	}
}

// TestCitusOperators: on the coordinator idem_health and idem_summary report the whole
// cluster: the keys of every worker, their claims in progress, run-out leases and backlog, the
// size of every shard and their estimated rows; per principal too; idem_key tells one key's
// story wherever it lives.
func TestCitusOperators(t *testing.T) {
	_, pool := citusDB(t)
	ctx := context.Background()
	insertCitusExpired(t, pool, "p", 3000, 100)
	for i := range 6 { // lease claims, of principals on both workers
		pgtest.Exec(t, pool, `SELECT idem.idem_begin($1, 'job', 'POST /jobs', sha256('j'), p_lease => '10 minutes')`, fmt.Sprint("lease", i))
	}
	// (Citus refuses a STABLE function over a column in a distributed UPDATE: the times are
	// parameters.)
	pgtest.Exec(t, pool, `UPDATE idem.idempotency_keys SET claimed_at = $1, lease_expires_at = $2
		WHERE principal_id IN ('lease0', 'lease1')`, time.Now().Add(-time.Hour), time.Now().Add(-time.Minute))
	pgtest.Exec(t, pool, `ANALYZE idem.idempotency_keys`)

	leased := onWorkers(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE state = 'p'`)
	if len(leased) < 2 || leased[0] == 0 || leased[1] == 0 {
		t.Fatalf("the lease claims per worker %v: want some on two workers at least", leased)
	}
	h, err := dbidem.ReadHealth(ctx, pool)
	if err != nil {
		t.Fatalf("idem_health on the coordinator: %v", err)
	}
	if h.InProgress != 6 || h.LeasesRunOut != 2 || h.CleanupBacklog != 3000 || h.OldestAge < time.Hour {
		t.Fatalf("idem_health: %+v; want 6 in progress, 2 run out, the oldest an hour old, a backlog of 3000", h)
	}
	var size, rows int64
	if err := pool.QueryRow(ctx, `SELECT citus_total_relation_size('idem.idempotency_keys'),
		(SELECT sum(result::float8)::bigint FROM run_command_on_shards('idem.idempotency_keys',
		  $$SELECT reltuples FROM pg_class WHERE oid = '%s'::regclass$$))`).Scan(&size, &rows); err != nil {
		t.Fatal(err)
	}
	if h.TableBytes != size || h.EstimatedKeys != rows || rows != 3006 {
		t.Fatalf("idem_health: %d bytes and %d keys estimated; Citus counts %d bytes and %d rows (want 3006) over the shards",
			h.TableBytes, h.EstimatedKeys, size, rows)
	}
	s, err := dbidem.ReadSummary(ctx, pool, false)
	if err != nil || len(s) != 1 {
		t.Fatalf("idem_summary on the coordinator: %+v %v", s, err)
	}
	if got := s[0]; got.Keys != 3006 || got.InProgress != 6 || got.Completed != 3000 || got.Expired != 3000 ||
		got.LeasesRunOut != 2 || got.TableBytes != size {
		t.Fatalf("idem_summary: %+v; want 3006 keys, 6 in progress, 3000 completed and expired, 2 run out, %d bytes", got, size)
	}
	per, err := dbidem.ReadSummary(ctx, pool, true)
	if err != nil || len(per) != 106 {
		t.Fatalf("idem_summary per principal: %d rows, %v; want 106", len(per), err)
	}
	k, ok, err := dbidem.ReadKey(ctx, pool, "lease0", "job")
	if err != nil || !ok || k.State != "in_progress" || k.LeaseExpiresAt.After(time.Now()) {
		t.Fatalf("idem_key on the coordinator: %+v %v %v", k, ok, err)
	}
}

// TestCitusOperatorsOnAWorker: on a worker, in an ordinary session (one that Citus hides the
// shards from: they are not in its pg_class), idem_summary counts the keys of that worker's
// shards only, not the cluster's through the distributed table, and idem_health's estimated
// keys are those shards' rows after ANALYZE, not 0: the workers' figures add up to the
// coordinator's, and the session still hides the shards afterwards.
func TestCitusOperatorsOnAWorker(t *testing.T) {
	db, pool := citusDB(t)
	ctx := context.Background()
	insertCitusExpired(t, pool, "p", 3000, 100)
	// Lease claims in progress, of principals on both workers.
	pgtest.Exec(t, pool, `INSERT INTO idem.idempotency_keys (expires_at, attempt, action_hash, state, principal_id, key,
		request_sha256, claimed_at, lease_expires_at)
		SELECT now() + interval '1 day', 100000 + i, 0, 'p', 'lease' || i, 'job', sha256('j'),
		       now() - interval '1 hour', now() + interval '10 minutes'
		  FROM generate_series(0, 5) AS i`)
	pgtest.Exec(t, pool, `ANALYZE idem.idempotency_keys`)
	total, err := dbidem.ReadSummary(ctx, pool, false)
	if err != nil || len(total) != 1 || total[0].Keys != 3006 {
		t.Fatalf("idem_summary on the coordinator: %+v %v; want 3006 keys", total, err)
	}
	whole, err := dbidem.ReadHealth(ctx, pool)
	if err != nil || whole.EstimatedKeys != 3006 {
		t.Fatalf("idem_health on the coordinator: %+v %v; want 3006 keys estimated", whole, err)
	}

	// Each worker's keys and estimated rows as Citus counts them, shard by shard.
	type figures struct{ keys, rows, progress int64 }
	want := map[int]*figures{}
	rows, err := pool.Query(ctx, `SELECT p.nodeport, sum(c.result::bigint)::bigint, sum(e.result::float8)::bigint, sum(i.result::bigint)::bigint
		  FROM run_command_on_shards('idem.idempotency_keys', $$SELECT count(*) FROM %s$$) AS c
		  JOIN run_command_on_shards('idem.idempotency_keys', $$SELECT reltuples FROM pg_class WHERE oid = '%s'::regclass$$) AS e USING (shardid)
		  JOIN run_command_on_shards('idem.idempotency_keys', $$SELECT count(*) FROM %s WHERE state = 'p'$$) AS i USING (shardid)
		  JOIN pg_dist_shard_placement AS p USING (shardid)
		 GROUP BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var port int
		var f figures
		if err := rows.Scan(&port, &f.keys, &f.rows, &f.progress); err != nil {
			t.Fatal(err)
		}
		want[port] = &f
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}

	_, workers := pgtest.CitusNodes(t)
	var keys, estimated, inProgress, principals int64
	for _, w := range workers {
		conn := pgtest.Connect(t, pgtest.CitusNodeURL(t, db, w))
		f := want[w.Port]
		if f == nil || f.keys == 0 || f.keys >= 3006 {
			t.Fatalf("worker :%d holds %+v keys; want some, not all (keys on every worker)", w.Port, f)
		}
		hidden := `SELECT count(*) FROM pg_class WHERE relnamespace = 'idem'::regnamespace AND relname ~ '^idempotency_keys_[0-9]+$'`
		if n := pgtest.Count(t, conn, hidden); n != 0 {
			t.Fatalf("worker :%d: this session sees %d shards in pg_class; the test wants one that Citus hides them from", w.Port, n)
		}
		s, err := dbidem.ReadSummary(ctx, conn, false)
		if err != nil || len(s) != 1 {
			t.Fatalf("idem_summary on worker :%d: %+v %v", w.Port, s, err)
		}
		h, err := dbidem.ReadHealth(ctx, conn)
		if err != nil {
			t.Fatalf("idem_health on worker :%d: %v", w.Port, err)
		}
		t.Logf("worker :%d: idem_summary %d keys (%d in progress), idem_health %d estimated, %d in progress; Citus counts %d keys, %d rows, %d in progress",
			w.Port, s[0].Keys, s[0].InProgress, h.EstimatedKeys, h.InProgress, f.keys, f.rows, f.progress)
		if s[0].Keys != f.keys || s[0].InProgress != f.progress || s[0].Completed != f.keys-f.progress ||
			s[0].Expired != f.keys-f.progress || s[0].TableBytes != h.TableBytes {
			t.Fatalf("idem_summary on worker :%d: %+v; want its shards' %d keys, %d in progress, %d bytes", w.Port, s[0], f.keys, f.progress, h.TableBytes)
		}
		if h.EstimatedKeys == 0 || h.EstimatedKeys != f.rows || h.InProgress != f.progress {
			t.Fatalf("idem_health on worker :%d: %d keys estimated, %d in progress; want its shards' %d rows, %d in progress",
				w.Port, h.EstimatedKeys, h.InProgress, f.rows, f.progress)
		}
		per, err := dbidem.ReadSummary(ctx, conn, true)
		if err != nil {
			t.Fatalf("idem_summary per principal on worker :%d: %v", w.Port, err)
		}
		// The session hides the shards as before: the figures did not change its setting.
		var visibility string
		if err := conn.QueryRow(ctx, `SELECT current_setting('citus.override_table_visibility')`).Scan(&visibility); err != nil || visibility != "on" {
			t.Fatalf("worker :%d: citus.override_table_visibility is %q after the figures (%v); want on, as before", w.Port, visibility, err)
		}
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := dbidem.ReadHealth(ctx, tx); err != nil {
			t.Fatal(err)
		}
		// (Planned afresh: the session's prepared statement of the same text keeps its plan, filter included.)
		if n := pgtest.Count(t, tx, hidden, pgx.QueryExecModeSimpleProtocol); n != 0 {
			t.Fatalf("worker :%d: after idem_health in a transaction, the transaction sees %d shards in pg_class; want them hidden, as before", w.Port, n)
		}
		if err := tx.QueryRow(ctx, `SELECT current_setting('citus.override_table_visibility')`).Scan(&visibility); err != nil || visibility != "on" {
			t.Fatalf("worker :%d: citus.override_table_visibility is %q after idem_health in a transaction (%v); want on, as before", w.Port, visibility, err)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		keys += s[0].Keys
		estimated += h.EstimatedKeys
		inProgress += h.InProgress
		principals += int64(len(per))
	}
	if keys != total[0].Keys || estimated != whole.EstimatedKeys || inProgress != whole.InProgress || principals != 106 {
		t.Fatalf("the workers add up to %d keys, %d estimated, %d in progress, %d principals; the coordinator reports %d, %d, %d (want 106 principals)",
			keys, estimated, inProgress, principals, total[0].Keys, whole.EstimatedKeys, whole.InProgress)
	}
}

// TestCitusCleanup: from the coordinator, idem_cleanup_workers has every worker clean its own
// shards until it is drained, through one session per worker for the whole pass (not one per
// batch), and touches no live key; idem_cleanup's rounds, CALL idem_cleanup_all and the Go
// cleaner (dbidem.Cleanup) clean the whole cluster too; a pass cancelled on the coordinator
// ends on the workers at once.
func TestCitusCleanup(t *testing.T) {
	_, pool := citusDB(t)
	ctx := context.Background()
	pgtest.Exec(t, pool, `INSERT INTO idem.idempotency_keys (expires_at, attempt, action_hash, state, principal_id, key,
		request_sha256, response_status, response_headers)
		SELECT now() + interval '1 day', i, 0, 'c', 'live' || (i % 50), 'live-' || i, sha256(i::text::bytea), 200, '{}'
		  FROM generate_series(1, 500) AS i`)
	expired := func() int64 {
		var n int64
		for _, c := range onWorkers(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE expires_at <= now()`) {
			n += c
		}
		return n
	}
	sessions := func() int64 {
		var n int64
		for _, c := range onWorkers(t, pool, `SELECT sessions FROM pg_stat_database WHERE datname = current_database()`) {
			n += c
		}
		return n
	}

	// 20,000 keys in batches of 100: 200 batches, over two workers.
	insertCitusExpired(t, pool, "p", 20_000, 200)
	before := sessions()
	var deleted int64
	var done bool
	if err := pool.QueryRow(ctx, `SELECT deleted, done FROM idem.idem_cleanup_workers(100, 1, '1 minute')`).Scan(&deleted, &done); err != nil {
		t.Fatal(err)
	}
	opened := sessions() - before
	if deleted != 20_000 || !done || expired() != 0 {
		t.Fatalf("idem_cleanup_workers: %d deleted, done %v, %d expired left; want 20000, done, none", deleted, done, expired())
	}
	// Each sessions() opens one session on each worker itself; a round per batch would open
	// a hundred on each.
	if _, workers := pgtest.CitusNodes(t); opened > int64(4*len(workers)) {
		t.Fatalf("the pass opened %d sessions on the workers; want one on each (and those that count them)", opened)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys`); n != 500 {
		t.Fatalf("%d keys left, want the 500 live ones", n)
	}

	// idem_cleanup, one batch a call, round by round.
	insertCitusExpired(t, pool, "q", 2500, 100)
	var batches []int
	for len(batches) < 10 {
		n := pgtest.Count(t, pool, `SELECT idem.idem_cleanup(1000)`)
		batches = append(batches, n)
		if n < 1000 {
			break
		}
	}
	if fmt.Sprint(batches) != "[1000 1000 500]" || expired() != 0 {
		t.Fatalf("idem_cleanup on the coordinator: batches %v, %d expired left; want [1000 1000 500]", batches, expired())
	}

	// CALL idem_cleanup_all, and the Go cleaner.
	insertCitusExpired(t, pool, "r", 7000, 100)
	var all int64
	if err := pool.QueryRow(ctx, `CALL idem.idem_cleanup_all(500, NULL)`).Scan(&all); err != nil || all != 7000 || expired() != 0 {
		t.Fatalf("CALL idem_cleanup_all on the coordinator: %d, %v, %d expired left; want 7000", all, err, expired())
	}
	insertCitusExpired(t, pool, "s", 4000, 100)
	if n, err := dbidem.CleanupPaced(ctx, pool, 250, 0.5); err != nil || n != 4000 || expired() != 0 {
		t.Fatalf("dbidem.CleanupPaced on the coordinator: %d, %v, %d expired left; want 4000", n, err, expired())
	}

	// A long paced pass, cancelled on the coordinator: the workers stop too.
	insertCitusExpired(t, pool, "t", 20_000, 100)
	cctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	_, _, _, err := dbidem.CleanupWorkers(cctx, pool, 10, 0.01, time.Minute)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a pass cut short: %v, want the context's error", err)
	}
	running := func() int64 {
		var n int64
		for _, c := range onWorkers(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'CALL idem.cleanup_node%'`) {
			n += c
		}
		return n
	}
	for i := 0; i < 50 && running() > 0; i++ {
		time.Sleep(100 * time.Millisecond)
	}
	if n := running(); n > 0 {
		t.Fatalf("%d workers still clean 5 s after the pass was cancelled on the coordinator", n)
	}
}
