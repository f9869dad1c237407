package idemhttp_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/canon"
	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLooksOfWaitingDuplicatesDoNotStarveLeaseExtensions (review finding): the duplicates of
// lease requests held by another process look at their keys every DefaultAnswerPoll, one look
// per key and process, with no bound on the looks a second across keys (only MaxWaitingBytes
// bounds the keys: about 4000 by default), each through the lease slots (MaxWaitingClaims of
// them), which the heartbeats and the answers of this process's own lease work share. Many keys
// waited on at once make thousands of looks a second; an extension that waits behind them (for a
// slot, or for the CPU the looks take) longer than the lease's rest loses the lease, and the
// work's answer is thrown away: its client gets 409, and a retry runs the work again.
//
// Here: one lease slot (a pool of 4), 1000 keys held by another process (committed lease claims
// of 10 minutes), a duplicate of each waiting (10,000 looks a second), and this process's own
// lease work (a lease of 1 s, extended every third of a second) held 3 s by a channel. The work
// must keep its lease and its answer must be recorded. It loses its lease every time here; with
// 300 keys, one run in three; with none (the control, const waiting = 0) never.
func TestLooksOfWaitingDuplicatesDoNotStarveLeaseExtensions(t *testing.T) {
	t.Parallel()
	const waiting = 1000
	pool, _ := pgtest.NewPool(t, 4)
	obs := newObserver()
	m, err := idemhttp.New(idemhttp.Options{
		DB:               pool,
		Principal:        func(r *http.Request) (string, bool) { return "alice", true },
		Logger:           slog.New(slog.NewTextHandler(io.Discard, nil)),
		MaxWaitingClaims: 1,
		Metrics:          obs,
	})
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	t.Cleanup(unblock)
	started := make(chan struct{}, 1)
	mux := http.NewServeMux()
	mux.Handle("POST /pay", m.Route(idemhttp.Route{Lease: 2 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Hold") != "" {
			started <- struct{}{}
			select {
			case <-release:
			case <-r.Context().Done():
				http.Error(w, fmt.Sprint(context.Cause(r.Context())), http.StatusServiceUnavailable)
				return
			}
		}
		w.WriteHeader(http.StatusAccepted)
	})))
	srv := httptest.NewServer(mux)
	t.Cleanup(func() { unblock(); srv.Close() })

	// Another process holds `waiting` keys under long leases.
	const body = `{"amount":1}`
	fp, _ := canon.ComputeCanonical("POST", "/pay", []byte(body))
	pgtest.Exec(t, pool, `SELECT idem.idem_begin('alice', 'remote-' || g, 'POST /pay', $1, p_lease => interval '10 minutes')
		FROM generate_series(1, $2) AS g`, fp.Sum[:], waiting)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	for i := 1; i <= waiting; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+"/pay", strings.NewReader(body))
			req.Header.Set("Idempotency-Key", fmt.Sprintf("remote-%d", i))
			if resp, err := http.DefaultClient.Do(req); err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}()
	}
	waitUntil(t, "the duplicates wait", func() bool { return m.GateStats().Waiting >= waiting })

	// This process's own lease work, 4 s under a lease of 2 s (each extension may take a third
	// of it: under the race detector on a loaded CI machine, a third of 1 s was once not enough
	// twice in a row, starved or not).
	done := make(chan reply, 1)
	go func() {
		s, h, b := pgtest.Send(t, context.Background(), "POST", srv.URL+"/pay", body, "Idempotency-Key", "local", "X-Hold", "1")
		done <- reply{s, h, b}
	}()
	<-started
	time.Sleep(4 * time.Second)
	unblock()
	r := <-done
	ext, lost := obs.leases()
	t.Logf("the local lease work: %d %s; %v extensions, %v leases lost", r.status, r.body, ext, lost)
	if lost != 0 || r.status != http.StatusAccepted {
		t.Fatalf("the looks of %d waiting duplicates starved this process's lease extensions: the work lost its lease "+
			"(%d %s)", waiting, r.status, r.body)
	}
}
