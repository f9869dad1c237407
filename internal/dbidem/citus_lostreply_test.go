//go:build citus

package dbidem_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestCitusAnswerCheckAndQueuedWaiters: on a real Citus cluster (make test-citus), a lease's
// answer whose reply was lost is found stored (PersistAnswer's read-only check through the
// coordinator), the check of an answer that is not there claims nothing (no token drawn on the
// worker, no claim left), and a third request queued on a key's row is a key wait.
func TestCitusAnswerCheckAndQueuedWaiters(t *testing.T) {
	db := pgtest.CitusDB(t)
	pgtest.CitusInstall(t, db)
	pgtest.CitusDistribute(t, db)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()

	lost := &lostReply{Pool: pool}
	c := claim("citus-lost", `{}`)
	c.Lease = 5 * time.Second
	d, err := dbidem.Begin(ctx, pool, c)
	if err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("claim: %+v %v", d, err)
	}
	if err := dbidem.PersistAnswer(ctx, lost, pool, c, d.Attempt, dbidem.Response{Status: 201}); err != nil || !lost.lost.Load() {
		t.Fatalf("PersistAnswer, the reply lost: %v (lost %v)", err, lost.lost.Load())
	}

	// An expired key's answer checked for a later attempt: the check's claim is refused or
	// rolled back, and the key stays as it was.
	e := claim("citus-expired", `{}`)
	e.Lease = 5 * time.Second
	d, err = dbidem.Begin(ctx, pool, e)
	if err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("claim: %+v %v", d, err)
	}
	pgtest.Exec(t, pool, `UPDATE idem.idempotency_keys SET expires_at = now() - interval '1 hour',
		lease_expires_at = now() - interval '1 hour' WHERE principal_id = $1 AND key = 'citus-expired'`, e.Principal)
	lost.lost.Store(false)
	start := time.Now()
	if err := dbidem.PersistAnswer(ctx, lost, pool, e, d.Attempt, dbidem.Response{Status: 201}); err == nil {
		t.Fatal("PersistAnswer of an expired claim succeeded")
	}
	t.Logf("the check of an expired claim took %s", time.Since(start).Round(time.Millisecond))
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'citus-expired' AND attempt = $1 AND state = 'p'`, d.Attempt); n != 1 {
		t.Fatalf("the expired claim's row changed under the check (%d rows as it was)", n)
	}

	thirdInLineSeen(t, pool, "citus-third", "citus_stat_activity")
}
