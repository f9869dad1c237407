package dbidem_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// passes records the results of a cleaner's passes.
type passes struct {
	mu      sync.Mutex
	results []string
}

func (p *passes) PassEnded(result string, _ int, _ time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.results = append(p.results, result)
}

func (p *passes) Vacuumed() {}

// TestCleanerBatchBoundFailsThePass (D171): a scheduled pass's batch statement that gets no
// answer was held until the kernel gave the connection up (about 15 minutes of a black-holed
// network), with no failed pass in the metrics and no log. Each batch is bounded now
// (CleanupBatchTimeout): here a bound of 300 ms cuts a batch that waits on the key table's
// lock (held by another session; idem_cleanup would wait 2 s for it), and the pass counts as
// failed, with an error that names the bound. A pass that waits for the cleanup lock
// (CleanerOptions.Wait, `server cleanup`) is not bounded: it waits as long as the lock is held.
func TestCleanerBatchBoundFailsThePass(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 4)
	rec := &passes{}
	c, err := dbidem.NewCleaner(pool, dbidem.CleanerOptions{Observer: rec, SkipVacuum: true})
	if err != nil {
		t.Fatal(err)
	}
	dbidem.SetBatchBound(c, 300*time.Millisecond)
	locker := pgtest.Connect(t, url)
	pgtest.Exec(t, locker, `BEGIN`)
	pgtest.Exec(t, locker, `LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`)
	start := time.Now()
	_, ran, err := c.Pass(context.Background())
	took := time.Since(start)
	pgtest.Exec(t, locker, `ROLLBACK`)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	t.Logf("pass: ran %v, %v after %s; results %v", ran, err, took.Round(time.Millisecond), rec.results)
	if err == nil || !strings.Contains(err.Error(), "CleanupBatchTimeout") || took > 1500*time.Millisecond {
		t.Fatalf("a batch held past its bound: %v after %s, want an error naming CleanupBatchTimeout after about 300 ms", err, took)
	}
	if len(rec.results) != 1 || rec.results[0] != dbidem.PassFailed {
		t.Fatalf("the pass's results %v, want one %q", rec.results, dbidem.PassFailed)
	}
}
