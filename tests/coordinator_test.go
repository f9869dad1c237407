package tests

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// insertLeases writes n lease claims in progress of principal into rel, claimed ago, whose
// leases end in lease (negative: they ran out).
func insertLeases(t *testing.T, q pgtest.Querier, rel, principal, prefix string, n int, ago, lease time.Duration) {
	t.Helper()
	pgtest.Exec(t, q, `INSERT INTO `+rel+` (expires_at, attempt, action_hash, state, principal_id, key, request_sha256,
		claimed_at, lease_expires_at)
		SELECT now() + interval '1 day', nextval('idem.token_seq'), 0, 'p', $1, $2 || '-' || i, sha256(i::text::bytea),
		       now() - $3::interval, now() + $4::interval
		  FROM generate_series(1, $5) AS i`, principal, prefix, ago, lease, n)
}

// fillStandInWorkers puts the same keys on the stand-in's two workers for the operators'
// tests: worker 1 has 2 leases running, 1 run out (20 minutes old) and 500 expired keys;
// worker 2 has 3 leases running (the oldest 50 minutes old), 300 expired and 100 live keys.
func fillStandInWorkers(t *testing.T, conn pgtest.Querier) {
	t.Helper()
	insertLeases(t, conn, "idem.keys_w1", "a", "run", 2, 5*time.Minute, time.Hour)
	insertLeases(t, conn, "idem.keys_w1", "a", "dead", 1, 20*time.Minute, -time.Minute)
	insertLeases(t, conn, "idem.keys_w2", "b", "run", 3, 50*time.Minute, time.Hour)
	pgtest.InsertKeys(t, conn, "idem.keys_w1", "a", "old", 500, true)
	pgtest.InsertKeys(t, conn, "idem.keys_w2", "b", "old", 300, true)
	pgtest.InsertKeys(t, conn, "idem.keys_w2", "b", "live", 100, false)
}

// TestOperatorsOnACoordinator: on a Citus coordinator (the stand-in, whose two "workers" hold
// the keys), idem_health reports the whole cluster: the claims in progress, the leases that
// ran out and the cleanup backlog of both workers, the oldest claim of either, and the size
// and estimated rows of the workers' key relations, added up; idem_summary's size is the
// same sum (its counts come from the distributed table, which Citus reads on the workers:
// checked on a real cluster by make test-citus). It used to fail on a coordinator (a query
// Citus cannot plan) and report the coordinator's own, empty, size.
func TestOperatorsOnACoordinator(t *testing.T) {
	t.Parallel()
	conn := pgtest.Connect(t, pgtest.NewDB(t))
	ctx := context.Background()
	pgtest.CitusStandIn(t, conn)
	fillStandInWorkers(t, conn)
	pgtest.Exec(t, conn, `ANALYZE idem.keys_w1, idem.keys_w2`)
	var bytes, rows int64
	if err := conn.QueryRow(ctx, `SELECT pg_total_relation_size('idem.keys_w1') + pg_total_relation_size('idem.keys_w2'),
		(SELECT sum(reltuples)::bigint FROM pg_class WHERE oid IN ('idem.keys_w1'::regclass, 'idem.keys_w2'::regclass))`).Scan(&bytes, &rows); err != nil {
		t.Fatal(err)
	}

	h, err := dbidem.ReadHealth(ctx, conn)
	if err != nil {
		t.Fatalf("idem_health on a coordinator: %v", err)
	}
	if h.InProgress != 6 || h.LeasesRunOut != 1 || h.CleanupBacklog != 800 {
		t.Fatalf("idem_health: %d in progress, %d leases run out, backlog %d; want 6, 1 and 800, both workers'", h.InProgress, h.LeasesRunOut, h.CleanupBacklog)
	}
	if h.OldestAge < 50*time.Minute || h.OldestAge > 2*time.Hour {
		t.Fatalf("idem_health: the oldest claim is %v old, want the 50 minutes of worker 2's", h.OldestAge)
	}
	if h.TableBytes != bytes || h.EstimatedKeys != rows || rows != 906 {
		t.Fatalf("idem_health: %d bytes, %d keys estimated; want the workers' %d bytes and %d rows (906)", h.TableBytes, h.EstimatedKeys, bytes, rows)
	}
	s, err := dbidem.ReadSummary(ctx, conn, false)
	if err != nil || len(s) != 1 || s[0].TableBytes != bytes {
		t.Fatalf("idem_summary on a coordinator: %+v %v; want one row with the workers' %d bytes", s, err, bytes)
	}
}

// TestOperatorsOnAWorker: on a Citus worker (the stand-in's "worker" 1 or 2: the same
// database with idem.test_group set), idem_summary counts that worker's key relations only,
// not the distributed table (the whole cluster's keys on a real worker; here, where the
// stand-in's table holds keys of its own, those), and idem_health reports their figures and
// estimated rows: the figures of a worker's shards (checked on a real cluster, where Citus
// hides the shards from pg_class, by TestCitusOperatorsOnAWorker). The session's
// citus.override_table_visibility (a placeholder here), which key_figures turns off for its
// own reading of pg_class, is as it was after each call.
func TestOperatorsOnAWorker(t *testing.T) {
	t.Parallel()
	conn := pgtest.Connect(t, pgtest.NewDB(t))
	ctx := context.Background()
	pgtest.CitusStandIn(t, conn)
	fillStandInWorkers(t, conn)
	pgtest.InsertKeys(t, conn, "idem.idempotency_keys", "c", "elsewhere", 50, false)
	pgtest.Exec(t, conn, `ANALYZE idem.keys_w1, idem.keys_w2`)
	pgtest.Exec(t, conn, `SET citus.override_table_visibility = on`)

	for _, w := range []struct {
		group                                        int
		rel                                          string
		keys, inProgress, runOut, expired, principal int64
	}{
		{1, "idem.keys_w1", 503, 3, 1, 500, 1},
		{2, "idem.keys_w2", 403, 3, 0, 300, 1},
	} {
		pgtest.Exec(t, conn, `SELECT set_config('idem.test_group', $1, false)`, fmt.Sprint(w.group))
		var bytes, rows int64
		if err := conn.QueryRow(ctx, `SELECT pg_total_relation_size($1::regclass), (SELECT reltuples::bigint FROM pg_class WHERE oid = $1::regclass)`,
			w.rel).Scan(&bytes, &rows); err != nil {
			t.Fatal(err)
		}
		s, err := dbidem.ReadSummary(ctx, conn, false)
		if err != nil || len(s) != 1 {
			t.Fatalf("idem_summary on worker %d: %+v %v", w.group, s, err)
		}
		if got := s[0]; got.Keys != w.keys || got.InProgress != w.inProgress || got.LeasesRunOut != w.runOut ||
			got.Expired != w.expired || got.TableBytes != bytes {
			t.Fatalf("idem_summary on worker %d: %+v; want %s's %d keys, %d in progress, %d run out, %d expired, %d bytes",
				w.group, got, w.rel, w.keys, w.inProgress, w.runOut, w.expired, bytes)
		}
		per, err := dbidem.ReadSummary(ctx, conn, true)
		if err != nil || int64(len(per)) != w.principal || per[0].Keys != w.keys {
			t.Fatalf("idem_summary per principal on worker %d: %+v %v; want one principal's %d keys", w.group, per, err, w.keys)
		}
		h, err := dbidem.ReadHealth(ctx, conn)
		if err != nil {
			t.Fatalf("idem_health on worker %d: %v", w.group, err)
		}
		if h.InProgress != w.inProgress || h.LeasesRunOut != w.runOut || h.CleanupBacklog != w.expired ||
			h.TableBytes != bytes || h.EstimatedKeys != rows || rows != w.keys {
			t.Fatalf("idem_health on worker %d: %+v; want %s's %d in progress, %d run out, backlog %d, %d bytes, %d rows estimated (%d)",
				w.group, h, w.rel, w.inProgress, w.runOut, w.expired, bytes, rows, w.keys)
		}
		var visibility string
		if err := conn.QueryRow(ctx, `SELECT current_setting('citus.override_table_visibility')`).Scan(&visibility); err != nil || visibility != "on" {
			t.Fatalf("citus.override_table_visibility is %q after the figures on worker %d (%v); want on, as the session set it", visibility, w.group, err)
		}
	}

	// The coordinator reads the distributed table (here the stand-in's own table) and adds up
	// the workers' figures, as before.
	pgtest.Exec(t, conn, `RESET idem.test_group`)
	s, err := dbidem.ReadSummary(ctx, conn, false)
	if err != nil || len(s) != 1 || s[0].Keys != 50 {
		t.Fatalf("idem_summary on the coordinator: %+v %v; want the distributed table's 50 keys", s, err)
	}
	h, err := dbidem.ReadHealth(ctx, conn)
	if err != nil || h.InProgress != 6 || h.EstimatedKeys != 906 {
		t.Fatalf("idem_health on the coordinator: %+v %v; want both workers' 6 in progress and 906 rows", h, err)
	}
}
