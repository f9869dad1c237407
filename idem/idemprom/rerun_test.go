package idemprom_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemprom"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestRerunWhoseClaimFailsCountsNoAcquired: a claim that was rolled back is not counted
// acquired (D186). The unit claimed, its handler met a deadlock (40P01), and the unit rolled
// back and ran again; the rerun's idem_begin found the key table locked (a LOCK TABLE queued
// behind the first run, as a migration's swap or VACUUM FULL would be). The first mend reset
// what a run decided inside the unit's callback, which runs only after a claim: the request,
// answered 503 with nothing claimed, was still counted acquired from the rolled-back run, and
// its retry acquired again. What a run decided is forgotten as each run starts now.
func TestRerunWhoseClaimFailsCountsNoAcquired(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 8)
	reg := prometheus.NewRegistry()
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true },
		Metrics: idemprom.NewObserver(reg), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	locker := pgtest.Connect(t, url)
	locked := make(chan error, 1)
	var runs atomic.Int32
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if runs.Add(1) == 1 {
			// A maintenance lock queues behind this run's transaction (which holds the key's
			// row and the table's RowExclusiveLock).
			go func() {
				tx, err := locker.Begin(ctx)
				if err != nil {
					locked <- err
					return
				}
				if _, err := tx.Exec(ctx, `LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`); err != nil {
					locked <- err
					return
				}
				time.Sleep(1500 * time.Millisecond)
				locked <- tx.Commit(ctx)
			}()
			pgtest.WaitFor(t, pool, `SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'idem.idempotency_keys'::regclass`)
			failByDeadlock(t, w, r)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})))
	defer srv.Close()

	st1, _, body1 := pgtest.Send(t, ctx, "POST", srv.URL+"/t", `{"n":1}`, "Idempotency-Key", "rerun-locked")
	if err := <-locked; err != nil {
		t.Fatal(err)
	}
	acqAfterFirst := value(t, reg, "idempotency_requests_total", "state", "acquired")
	storeErr := value(t, reg, "idempotency_requests_total", "state", "store_error")
	st2, _, body2 := pgtest.Send(t, ctx, "POST", srv.URL+"/t", `{"n":1}`, "Idempotency-Key", "rerun-locked")
	acq := value(t, reg, "idempotency_requests_total", "state", "acquired")
	t.Logf("first: %d %s; retry: %d %s; handler runs %d; acquired after first %v, store_error %v, acquired in all %v",
		st1, body1, st2, body2, runs.Load(), acqAfterFirst, storeErr, acq)
	if st1 != http.StatusServiceUnavailable {
		t.Fatalf("the rerun's claim behind the table lock: %d %s, want 503 (the rerun did not meet the locked table)", st1, body1)
	}
	if st2 != http.StatusCreated || runs.Load() != 2 {
		t.Fatalf("the retry: %d %s after %d handler runs, want 201 after 2", st2, body2, runs.Load())
	}
	if acqAfterFirst != 0 || acq != 1 {
		t.Fatalf("one claim stuck (the retry's); counted acquired %v times (%v by the 503'd request whose claim was rolled back, store_error %v)",
			acq, acqAfterFirst, storeErr)
	}
}

// TestRerunThatWaitsPastAnOuterDeadlineIsBusy: a request whose context ended by a deadline
// while it waited for another holder of its key is answered 409 with Retry-After and counted
// busy (D186). A claimed; its handler met a deadlock and the unit ran again; meanwhile B
// (which waited on the key's row) claimed the key and kept working. A's rerun waited for B
// until A's outer deadline ended the wait, and A, still marked acquired by its rolled-back
// first run, was answered 503 and counted acquired and store_error.
func TestRerunThatWaitsPastAnOuterDeadlineIsBusy(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 8)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	principal := func(*http.Request) (string, bool) { return "alice", true }
	regA := prometheus.NewRegistry()
	a, err := idem.New(ctx, idem.Options{DB: pool, Principal: principal, Metrics: idemprom.NewObserver(regA), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	b, err := idem.New(ctx, idem.Options{DB: pool, Principal: principal, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	var runsA atomic.Int32
	aClaimed, bWaits, bRelease := make(chan struct{}), make(chan struct{}), make(chan struct{})
	innerA := a.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if runsA.Add(1) == 1 {
			close(aClaimed)
			<-bWaits
			failByDeadlock(t, w, r)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	srvA := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, cancel := context.WithTimeout(r.Context(), 1500*time.Millisecond)
		defer cancel()
		innerA.ServeHTTP(w, r.WithContext(c))
	}))
	defer srvA.Close()
	srvB := httptest.NewServer(b.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-bRelease
		w.WriteHeader(http.StatusCreated)
	})))
	defer srvB.Close()
	defer close(bRelease)

	type answer struct {
		st   int
		hdr  http.Header
		body string
	}
	ansA := make(chan answer, 1)
	go func() {
		st, hdr, body := pgtest.Send(t, ctx, "POST", srvA.URL+"/t", `{"n":1}`, "Idempotency-Key", "rerun-deadline")
		ansA <- answer{st, hdr, body}
	}()
	<-aClaimed
	go func() {
		_, _, _ = pgtest.Send(t, ctx, "POST", srvB.URL+"/t", `{"n":1}`, "Idempotency-Key", "rerun-deadline")
	}()
	pgtest.WaitFor(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`)
	close(bWaits)
	got := <-ansA
	storeErr := value(t, regA, "idempotency_requests_total", "state", "store_error")
	busy := value(t, regA, "idempotency_requests_total", "state", "busy")
	acq := value(t, regA, "idempotency_requests_total", "state", "acquired")
	t.Logf("A: %d (Retry-After %q) %s; runs %d; acquired %v busy %v store_error %v", got.st, got.hdr.Get("Retry-After"), got.body,
		runsA.Load(), acq, busy, storeErr)
	if runsA.Load() != 1 {
		t.Fatalf("A's handler ran %d times; want once (its rerun waits for B)", runsA.Load())
	}
	if got.st != http.StatusConflict || got.hdr.Get("Retry-After") == "" || storeErr != 0 || acq != 0 {
		t.Fatalf("A, past its outer deadline while waiting for B: %d %s, counted acquired %v busy %v store_error %v; "+
			"want 409 with Retry-After, counted busy only", got.st, got.body, acq, busy, storeErr)
	}
}
