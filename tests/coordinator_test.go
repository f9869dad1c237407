package tests

import (
	"context"
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
	insertLeases(t, conn, "idem.keys_w1", "a", "run", 2, 5*time.Minute, time.Hour)
	insertLeases(t, conn, "idem.keys_w1", "a", "dead", 1, 20*time.Minute, -time.Minute)
	insertLeases(t, conn, "idem.keys_w2", "b", "run", 3, 50*time.Minute, time.Hour)
	pgtest.InsertKeys(t, conn, "idem.keys_w1", "a", "old", 500, true)
	pgtest.InsertKeys(t, conn, "idem.keys_w2", "b", "old", 300, true)
	pgtest.InsertKeys(t, conn, "idem.keys_w2", "b", "live", 100, false)
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
