package idemhttp_test

import (
	"context"
	"testing"
	"time"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestDuplicateQueuedOnAKeyRowIsInProgress (review finding): a key whose answer expired is
// claimed again by another process (uncommitted), and a third process's duplicate already
// waits on the row. This process's duplicate queues behind it; the key is held, the table is
// not locked, so it waits DuplicateWait and gets 409 request_in_progress. It got 503
// store_unavailable within about 100 ms.
func TestDuplicateQueuedOnAKeyRowIsInProgress(t *testing.T) {
	t.Parallel()
	a := newApp(t, func(o *idemhttp.Options) { o.DuplicateWait = time.Second })
	if r := a.do("POST", "/transfers", "alice", "exp", `{"amount":1}`); r.status/100 != 2 {
		t.Fatalf("first: %d %s", r.status, r.body)
	}
	pgtest.Exec(t, a.pool, `UPDATE idem.idempotency_keys SET expires_at = now() - interval '1 hour',
		lease_expires_at = now() - interval '1 hour' WHERE key = 'exp'`)
	url := pgtest.URLOf(t, a.pool)
	// Another process: a new first request re-claims the expired key and works (uncommitted).
	holder := pgtest.Connect(t, url)
	pgtest.Exec(t, holder, `BEGIN`)
	var outcome string
	if err := holder.QueryRow(context.Background(), `SELECT b.outcome FROM idem.idempotency_keys k,
		idem.idem_begin(k.principal_id, k.key, 'POST /transfers', k.request_sha256) b WHERE k.key = 'exp'`).Scan(&outcome); err != nil || outcome != "claimed" {
		t.Fatalf("holder: %q %v", outcome, err)
	}
	// A third process: a duplicate waiting on the row.
	waiter := pgtest.Connect(t, url)
	waited := make(chan struct{})
	go func() {
		defer close(waited)
		_, _ = waiter.Exec(context.Background(), `SELECT idem.idem_begin(k.principal_id, k.key, 'POST /transfers', k.request_sha256,
			p_lock_timeout => '10s') FROM idem.idempotency_keys k WHERE k.key = 'exp'`)
	}()
	pgtest.WaitFor(t, a.pool, lockWaiters)
	start := time.Now()
	r := a.do("POST", "/transfers", "alice", "exp", `{"amount":1}`)
	took := time.Since(start)
	pgtest.Exec(t, holder, `ROLLBACK`)
	<-waited
	if r.status != 409 || r.header.Get("Retry-After") == "" || took < 500*time.Millisecond {
		t.Fatalf("a duplicate of a held key queued on its row: %d %s after %s, want 409 request_in_progress after DuplicateWait",
			r.status, r.body, took.Round(time.Millisecond))
	}
}
