package idemhttp_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/gorilla/mux"
	"github.com/jackc/pgx/v5"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// leaseSlotApp is a lease route of 2 s on a pool of 4 with the default MaxWaitingClaims (one
// lease slot). Its handler works for the request's "work" query parameter (a duration), then
// answers 201; it returns without answering when its lease is lost, as the middleware's
// documentation tells a handler to.
func leaseSlotApp(t *testing.T) (*httptest.Server, string, chan string) {
	t.Helper()
	pool, url := pgtest.NewPool(t, 4)
	m, err := idemhttp.New(idemhttp.Options{DB: pool,
		Principal: func(r *http.Request) (string, bool) { return "alice", true },
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)), RouteTemplate: muxTemplate})
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan string, 64)
	r := mux.NewRouter()
	r.Handle("/jobs", m.Route(idemhttp.Route{Lease: 2 * time.Second, Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		work, err := time.ParseDuration(r.URL.Query().Get("work"))
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		started <- r.Header.Get("Idempotency-Key")
		select {
		case <-time.After(work):
			w.WriteHeader(http.StatusCreated)
		case <-r.Context().Done():
		}
	}))).Methods("POST")
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)
	return srv, url, started
}

// TestLeaseKeepsItsLeaseWhileAnotherKeysRowIsLocked (review finding, D229): lease A's key row
// was held by another session (a claim of another process whose connection stalled holds it
// up to 5 s). A's extensions, then the giving up of its lost lease, waited on the row in the
// one lease slot of a pool of 4, and an unrelated lease B, its row free and three connections
// idle, had its extensions time out in the queue behind them: B was lost, 409, its work done
// for nothing.
func TestLeaseKeepsItsLeaseWhileAnotherKeysRowIsLocked(t *testing.T) {
	t.Parallel()
	srv, url, started := leaseSlotApp(t)
	ctx := context.Background()
	bReply := make(chan int, 1)
	aReply, locker := leaseWithItsRowLocked(t, srv.URL, url, started, "20s")

	began := time.Now()
	go func() {
		status, _, _ := pgtest.Send(t, ctx, "POST", srv.URL+"/jobs?work=6s", `{}`, "Idempotency-Key", "b",
			"Content-Type", "application/json")
		bReply <- status
	}()
	if k := <-started; k != "b" {
		t.Fatalf("started %q, want b", k)
	}
	b := <-bReply
	took := time.Since(began)
	pgtest.Exec(t, locker, `ROLLBACK`)
	a := <-aReply
	t.Logf("A (its row locked): %d; B: %d after %v", a, b, took.Round(time.Millisecond))
	if b != http.StatusCreated {
		t.Errorf("lease B, its row free and the pool idle, answered %d after %v, want 201: its extensions queued behind "+
			"statements waiting on another key's locked row", b, took.Round(time.Millisecond))
	}
	if a != http.StatusConflict {
		t.Errorf("lease A, its row locked past its lease, answered %d, want 409 (lease lost)", a)
	}
}

// TestLeasesKeepTheirLeasesThroughSlowWrites (review finding, D229): every write to the key
// table took 50 ms (a commit waiting for a distant synchronous standby, here a trigger), and 16
// leases of 2 s, each working 4 s, queued their extensions through the one lease slot of a pool
// of 4: some were lost with the pool half idle.
func TestLeasesKeepTheirLeasesThroughSlowWrites(t *testing.T) {
	t.Parallel()
	srv, url, started := leaseSlotApp(t)
	ctx := context.Background()
	owner := pgtest.Connect(t, url)
	// The 50 ms are the write's only wait: its commit does not wait for the WAL's fsync, which
	// a loaded machine's disk makes slower and more variable (under CI's load, by as much as
	// the test's margin: 16 extensions every 667 ms through 2 slots leave each 83 ms).
	pgtest.Exec(t, owner, `CREATE FUNCTION public.slow_write() RETURNS trigger LANGUAGE plpgsql AS
		$$BEGIN PERFORM set_config('synchronous_commit', 'off', true); PERFORM pg_sleep(0.05); RETURN NEW; END$$`)
	pgtest.Exec(t, owner, `CREATE TRIGGER slow_write BEFORE UPDATE ON idem.idempotency_keys
		FOR EACH ROW EXECUTE FUNCTION public.slow_write()`)
	const leases = 16
	var wg sync.WaitGroup
	statuses := make([]int, leases)
	for i := range leases {
		wg.Add(1)
		go func() {
			defer wg.Done()
			statuses[i], _, _ = pgtest.Send(t, ctx, "POST", srv.URL+"/jobs?work=4s", `{}`, "Idempotency-Key",
				fmt.Sprintf("slow-%d", i), "Content-Type", "application/json")
		}()
	}
	for range leases {
		<-started
	}
	wg.Wait()
	lost := 0
	for _, s := range statuses {
		if s != http.StatusCreated {
			lost++
		}
	}
	if lost > 0 {
		t.Errorf("%d of %d leases answered other than 201 (%v): their extensions queued through the lease slots while "+
			"writes took 50 ms", lost, leases, statuses)
	}
}

// leaseWithItsRowLocked sends lease request "a" working work and, once its handler runs, holds
// its key's row FOR UPDATE from a session outside the pool (rolled back when the test ends, if
// not before); aReply gets its status.
func leaseWithItsRowLocked(t *testing.T, srvURL, url string, started chan string, work string) (aReply chan int, locker *pgx.Conn) {
	t.Helper()
	aReply = make(chan int, 1)
	go func() {
		status, _, _ := pgtest.Send(t, context.Background(), "POST", srvURL+"/jobs?work="+work, `{}`, "Idempotency-Key", "a",
			"Content-Type", "application/json")
		aReply <- status
	}()
	if k := <-started; k != "a" {
		t.Fatalf("started %q, want a", k)
	}
	locker = pgtest.Connect(t, url)
	pgtest.Exec(t, locker, `BEGIN`)
	pgtest.Exec(t, locker, `SELECT 1 FROM idem.idempotency_keys WHERE key = 'a' FOR UPDATE`)
	t.Cleanup(func() { _, _ = locker.Exec(context.Background(), `ROLLBACK`) })
	return aReply, locker
}
