package dbidem_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestPersistAnswerReadsALandedAnswerAgain: PersistAnswer tells an answer that landed from one
// that did not when a reply was lost. The completion's reply is lost, the next try finds the
// claim completed (ErrClaimLost), and PersistAnswer reads the key's row (idem_key). It read it
// once: when that read failed (its backend killed, as in a restart or a failover to a
// synchronous standby that has the answer; or the key table locked by maintenance for longer
// than idem_key's lock_timeout), the answer was taken for "not stored" and PersistAnswer
// returned ErrClaimLost for an answer stored with this attempt (DoLease returned ErrLeaseLost
// for work that ran and whose result was stored; a lease route answered 409). The read is
// tried again now, as the completion is.
func TestPersistAnswerReadsALandedAnswerAgain(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// kill: answered's read, caught waiting on the table lock, has its backend terminated;
		// otherwise the lock is held past idem_key's lock_timeout
		kill bool
	}{
		{"backend killed during the read", true},
		{"key table locked past idem_key's lock_timeout", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pool, url := pgtest.NewPool(t, 8)
			ctx := context.Background()
			admin := pgtest.Connect(t, url)
			watcher := pgtest.Connect(t, url)
			c := dbidem.Claim{Principal: "p", Key: "read-fails", Action: "payout", Fingerprint: [32]byte{7},
				Lease: 30 * time.Second}
			d, err := dbidem.Begin(ctx, pool, c)
			if err != nil || d.Outcome != dbidem.Claimed {
				t.Fatalf("claim: %+v %v", d, err)
			}
			var killed atomic.Bool
			done := make(chan struct{})
			q := &lostReply{Pool: pool}
			q.next = func() {
				// Maintenance (or a migration's swap) locks the key table just now.
				pgtest.Exec(t, admin, `BEGIN`)
				pgtest.Exec(t, admin, `LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`)
				go func() {
					defer close(done)
					defer func() { _, _ = admin.Exec(context.Background(), `ROLLBACK`) }()
					deadline := time.Now().Add(10 * time.Second)
					for time.Now().Before(deadline) {
						var pid int
						err := watcher.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query LIKE '%idem.idem_key(%'
							AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()`).Scan(&pid)
						if err == nil {
							if tc.kill {
								var ok bool
								_ = watcher.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, pid).Scan(&ok)
								killed.Store(ok)
								return
							}
							// hold the lock past idem_key's lock_timeout (2 s)
							time.Sleep(2500 * time.Millisecond)
							killed.Store(true)
							return
						}
						time.Sleep(5 * time.Millisecond)
					}
				}()
			}
			pctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			err = dbidem.PersistAnswer(pctx, q, pool, c, d.Attempt, dbidem.Response{Status: 201, Body: []byte(`{"paid":1}`)})
			<-done
			t.Logf("PersistAnswer: %v; Complete calls %d", err, q.n.Load())
			if !killed.Load() {
				t.Fatal("the read of the key's row was never caught waiting on the lock")
			}
			var state string
			var attempt int64
			if err := pool.QueryRow(ctx, `SELECT state, attempt FROM idem.idem_key('p', 'read-fails')`).Scan(&state, &attempt); err != nil {
				t.Fatal(err)
			}
			if state != "completed" || attempt != d.Attempt {
				t.Fatalf("the key: %s attempt %d; want completed with %d (the answer landed)", state, attempt, d.Attempt)
			}
			if err != nil {
				t.Errorf("PersistAnswer whose answer is stored with its attempt (key %s, attempt %d): %v (ErrClaimLost: %v); want nil: "+
					"one failed read of the key's row was taken for \"not answered\"", state, attempt, err, errors.Is(err, dbidem.ErrClaimLost))
			}
		})
	}
}
