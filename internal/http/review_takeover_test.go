package idemhttp_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/canon"
)

// TestWaitingDuplicateTakesOverADeadHoldersLease (review, passes): the holder of a lease key is
// another process that died (a committed lease claim of 1 s that nobody extends or completes):
// nothing wakes the key's watch but the looks. The duplicate waiting on it must see the lease
// run out, take the key over as soon as it did (not at DuplicateWait), run the work, and run it
// under the dead holder's provider key (the same generation).
func TestWaitingDuplicateTakesOverADeadHoldersLease(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	const body = `{"amount":1}`
	fp, _ := canon.ComputeCanonical("POST", "/jobs", []byte(body))
	var deadKey string
	if err := a.pool.QueryRow(context.Background(), `SELECT provider_key FROM idem.idem_begin('alice', 'dead', 'POST /jobs', $1,
		p_lease => interval '1 second')`, fp.Sum[:]).Scan(&deadKey); err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	r := a.do("POST", "/jobs", "alice", "dead", body)
	took := time.Since(began)
	t.Logf("the duplicate: %d %s after %v", r.status, r.body, took.Round(time.Millisecond))
	if r.status != http.StatusAccepted {
		t.Fatalf("the duplicate of a dead holder: %d %s, want the work's 202 after a takeover", r.status, r.body)
	}
	// The lease ran out within 1 s; a duplicate that waited for DuplicateWait (10 s) instead
	// would take 10 s. 5 s tells the two apart with room for a loaded CI machine (2.4 s once).
	if took > 5*time.Second {
		t.Fatalf("the takeover came %v after the duplicate arrived; the lease ran out within 1 s, DuplicateWait is 10 s", took)
	}
	if got := *a.provider.Load(); got != deadKey {
		t.Fatalf("the takeover ran under provider key %s, the dead holder's generation has %s", got, deadKey)
	}
}
