package idem_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// ebSetup: a lease route's request with a text/plain body, claimed by a release before D178
// (its canonical fingerprint) whose lease ran out, and a transaction of the test's that holds
// the key's row lock, so that the retry's ask under that fingerprint (the takeover) waits on
// it. It returns the server, the holder and the count of the handler's runs.
func ebSetup(t *testing.T, pool *pgxpool.Pool, url, key string, lockTimeout time.Duration) (*httptest.Server, func(), *atomic.Int32) {
	t.Helper()
	ctx := context.Background()
	m, err := idem.New(ctx, idem.Options{DB: pool, LockTimeout: lockTimeout, DuplicateWait: time.Minute,
		Principal: func(*http.Request) (string, bool) { return "alice", true },
		Logger:    slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	runs := new(atomic.Int32)
	mux := http.NewServeMux()
	mux.Handle("POST /pay", m.Route(idem.Route{Required: true, Lease: time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		b, _ := io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "paid %s", b)
	})))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	fp := idem.ComputeFingerprint("POST", "/pay", []byte(ebBody))
	d, err := idem.Begin(ctx, pool, idem.Claim{Principal: "alice", Key: key, Action: "POST /pay",
		Fingerprint: fp.Sum, Fields: fp.Fields, Lease: time.Second})
	if err != nil || d.Outcome != idem.Claimed {
		t.Fatalf("the crashed holder's claim: %+v %v", d, err)
	}
	time.Sleep(1200 * time.Millisecond) // its lease runs out
	holder := pgtest.Connect(t, url)
	tx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, tx, `SELECT 1 FROM idem.idempotency_keys WHERE principal_id = 'alice' AND key = $1 FOR UPDATE`, key)
	var once sync.Once // a second call waits for the first: the holder's end happened before
	release := func() { once.Do(func() { _ = tx.Commit(ctx) }) }
	t.Cleanup(release)
	return srv, release, runs
}

const ebBody = `{"to":"bob","amount":12}`

// TestEarlierReleaseAskWaitsItsLockTimeoutOnALeaseRoute: on a lease route, the middleware's
// ask under the fingerprint of a release before D178 (the takeover of a text/plain request's
// lease that ran out) waits on the key's row within its lock timeout (8 s here). It ran outside
// the lease claim's bound, which went on ClaimReplyMargin (5 s) from the mismatch's answer:
// past it the unit was given up under the ask, and its COMMIT with it. Each ask has the bound of
// its own now, which the unit waits for: the takeover claims and runs the handler once.
func TestEarlierReleaseAskWaitsItsLockTimeoutOnALeaseRoute(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 4)
	srv, release, runs := ebSetup(t, pool, url, "slow-earlier", 8*time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	time.AfterFunc(6500*time.Millisecond, release)
	start := time.Now()
	st, _, got := pgtest.Send(t, ctx, "POST", srv.URL+"/pay", ebBody, "Idempotency-Key", "slow-earlier", "Content-Type", "text/plain")
	took := time.Since(start)
	release()
	if st != http.StatusCreated || got != "paid "+ebBody || runs.Load() != 1 {
		t.Fatalf("the takeover under the earlier fingerprint, behind a row lock held 6.5 s (lock timeout 8 s): %d %q after %s, handler runs %d; want 201 and one run",
			st, got, took, runs.Load())
	}
	if took < 6*time.Second {
		t.Fatalf("answered after %s: the ask did not wait for the row lock (held 6.5 s); the test did not hold the gap open", took)
	}
}

// TestEarlierReleaseAskBlackHoledOnALeaseRoute: the same ask, on a link that stops answering
// while it waits on the key's row (lock timeout 2 s). On the work context, which has no
// deadline on a lease route, it waited for the operating system to give up on the connection,
// minutes later, and held the request. It is given up at its bound now (the lock timeout and
// ClaimReplyMargin), told 503 store_unavailable, and nothing ran.
func TestEarlierReleaseAskBlackHoledOnALeaseRoute(t *testing.T) {
	t.Parallel()
	_, url := pgtest.NewPool(t, 1)
	p := pgtest.NewProxy(t, pgtest.TCPAddr(t))
	cfg, err := pgxpool.ParseConfig(pgtest.Via(t, url, p.Addr))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	srv, _, runs := ebSetup(t, pool, url, "held-earlier", 2*time.Second)
	direct := pgtest.Connect(t, url)
	held := make(chan bool, 1)
	go func() {
		// Once the ask waits on the row lock, the link stops answering.
		for range 2000 {
			var n int
			err := direct.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			    WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&n)
			if err == nil && n > 0 {
				p.SetFault(pgtest.Hold)
				held <- true
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
		held <- false
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	start := time.Now()
	st, _, got := pgtest.Send(t, ctx, "POST", srv.URL+"/pay", ebBody, "Idempotency-Key", "held-earlier", "Content-Type", "text/plain")
	took := time.Since(start)
	p.SetFault(pgtest.Forward) // the pool's closing of the lost connection is not held too
	if !<-held {
		t.Fatalf("the ask never waited on the key's row lock (answered %d %q after %s): the test did not hold the gap open", st, got, took)
	}
	if st != http.StatusServiceUnavailable || runs.Load() != 0 {
		t.Fatalf("the ask under the earlier fingerprint, black-holed while it waits: %d %q after %s, handler runs %d; want 503 and no run",
			st, got, took, runs.Load())
	}
	if took > 12*time.Second {
		t.Fatalf("the black-holed ask was given up after %s; its bound is the lock timeout (2 s) and 5 s", took)
	}
}
