package idem_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/internal/pgtest"
	idemsql "github.com/pgidem/pgidem/sql"
)

// A replay reached through the claim under an earlier release's fingerprint (D178: a
// text/plain body whose key a release before it stored under canon.Compute's fingerprint),
// whose bytes took the client longer to read than the server's idle-in-transaction bound (a
// DBA's 2 s on a transactional route, the lease claim's own 5 s on a lease route): the second
// idem_begin, under a savepoint, made the transaction look as if it had written, the server
// ended the session before the COMMIT, and the client owed the stored answer got 503 (D226's
// sibling; Tx.Redecided).
func TestReplayUnderAnEarlierReleasesFingerprintOutlastsTheIdleTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct, url := pgtest.NewPool(t, 4)
	p := pgtest.NewProxy(t, pgtest.TCPAddr(t))
	p.Buffered.Store(true)
	p.Rate.Store(100 << 10)
	slow := newPool(t, pgtest.Via(t, url, p.Addr)+" idle_in_transaction_session_timeout=2000 pool_max_conns=4")
	m, err := idem.New(ctx, idem.Options{DB: slow, Principal: alice, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte("ran again"))
	})
	mux := http.NewServeMux()
	mux.Handle("POST /things", m.Route(idem.Route{Required: true})(h))
	mux.Handle("POST /pay", m.Route(idem.Route{Required: true, Lease: 30 * time.Second})(h))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	big := strings.Repeat("z", 800<<10) // 8 s at 100 kB/s
	body := `{"amount":12}`
	for _, tc := range []struct{ path, ctype string }{
		{"/things", "text/plain"}, // D178's fallback, transactional route
		{"/pay", "text/plain"},    // D178's fallback, lease route (its claim's own 5 s)
	} {
		t.Run(tc.path+" "+tc.ctype, func(t *testing.T) {
			key := "earlier-" + tc.path + "-" + tc.ctype
			// What the release before D178 stored: canon.Compute's fingerprint whatever the
			// Content-Type (the JSON body's fingerprint today too).
			fp := idem.ComputeFingerprint("POST", tc.path, []byte(body))
			err := idem.RunTx(ctx, direct, idem.TxOptions{}, func(tx *idem.Tx) error {
				d, err := tx.Claim(ctx, idem.Claim{Principal: "alice", Key: key, Action: "POST " + tc.path,
					Fingerprint: fp.Sum, Fields: fp.Fields})
				if err != nil || d.Outcome != idem.Claimed {
					return fmt.Errorf("claim: %+v %v", d, err)
				}
				tx.CompleteOnCommit(idem.Response{Status: 201, Body: []byte(big)})
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			before := runs.Load()
			rctx, cancel := context.WithTimeout(ctx, 60*time.Second)
			defer cancel()
			start := time.Now()
			st, hd, got := pgtest.Send(t, rctx, "POST", srv.URL+tc.path, body, "Idempotency-Key", key, "Content-Type", tc.ctype)
			took := time.Since(start)
			if st != 201 || got != big || hd.Get("Idempotent-Replayed") != "true" || runs.Load() != before {
				t.Fatalf("the identical retry of a key whose answer is stored, after %s: %d %.200q (%d bytes), replayed %q, handler runs %d; "+
					"want the stored 201 replayed", took.Round(time.Millisecond), st, got, len(got), hd.Get("Idempotent-Replayed"), runs.Load()-before)
			}
			if took < 6*time.Second {
				t.Fatalf("the link forwarded the replay in %s: the transaction never sat idle past its bound", took)
			}
		})
	}
}

// A statement_timeout on the role below the lock timeout ends a claim's wait with 57014, which
// docs/sql-api.md says to take as 55P03, and Claim.LockTimeout's doc promises ErrInProgress when
// another holder keeps the key. Only the Gate mapped it (D163): Tx.Claim and Begin returned the
// raw 57014, so a caller that answers errors.Is(err, ErrInProgress) with 409 answered 500 (D227).
func TestClaimCutByAStatementTimeoutIsInProgress(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, url := pgtest.NewPool(t, 2)
	guarded := newPool(t, url+" statement_timeout=1000 pool_max_conns=2") // a DBA's guard rail, below the 2 s lock timeout
	holder := pgtest.Connect(t, url)
	claim := idem.Claim{Principal: "alice", Key: "held", Action: "POST /x", Fingerprint: [32]byte{1}}
	htx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = htx.Rollback(ctx) }()
	if d, err := idem.Begin(ctx, htx, claim); err != nil || d.Outcome != idem.Claimed {
		t.Fatalf("holder: %+v %v", d, err)
	}
	// The holder's uncommitted claim holds the key's row lock for the whole test.

	t.Run("Tx.Claim", func(t *testing.T) {
		start := time.Now()
		err := idem.RunTx(ctx, guarded, idem.TxOptions{MaxAttempts: 1}, func(tx *idem.Tx) error {
			_, err := tx.Claim(ctx, claim)
			return err
		})
		if !errors.Is(err, idem.ErrInProgress) {
			t.Fatalf("a claim whose wait on the held key the role's statement_timeout ended (after %s): %v; want ErrInProgress",
				time.Since(start).Round(time.Millisecond), err)
		}
	})
	t.Run("Begin", func(t *testing.T) {
		start := time.Now()
		err := pgx.BeginFunc(ctx, guarded, func(tx pgx.Tx) error {
			_, err := idem.Begin(ctx, tx, claim)
			return err
		})
		if !errors.Is(err, idem.ErrInProgress) {
			t.Fatalf("Begin whose wait on the held key the role's statement_timeout ended (after %s): %v; want ErrInProgress",
				time.Since(start).Round(time.Millisecond), err)
		}
	})
}

// CleanerOptions.Wait (what `server cleanup` sets) promises that a transaction holding
// CleanupLock holds the pass up until it ends; the batch lifts lock_timeout for that. A role's
// statement_timeout (1 s here) ended the wait instead: the pass failed with 57014 a second into
// a 3-second window and deleted nothing (D227).
func TestWaitingCleanerOutlastsAStatementTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, url := pgtest.NewPool(t, 2)
	owner := pgtest.Connect(t, url)
	pgtest.InsertExpired(t, owner, "alice", 10)
	guarded := newPool(t, url+" statement_timeout=1000 pool_max_conns=2")
	c, err := idem.NewCleaner(guarded, idem.CleanerOptions{Wait: true, Duty: 1, SkipVacuum: true,
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	window := pgtest.Connect(t, url)
	wtx, err := window.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := wtx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, idem.CleanupLock); err != nil {
		t.Fatal(err)
	}
	ended := make(chan struct{})
	time.AfterFunc(3*time.Second, func() { defer close(ended); _ = wtx.Commit(context.Background()) })
	defer func() { <-ended }() // before the connection's cleanup closes it
	start := time.Now()
	n, ran, err := c.Pass(ctx)
	took := time.Since(start)
	if err != nil || !ran || n != 10 {
		t.Fatalf("a waiting pass behind a 3 s maintenance window, under a 1 s statement_timeout: deleted %d, ran %v, err %v after %s; "+
			"want the 10 expired keys deleted once the window ended", n, ran, err, took.Round(time.Millisecond))
	}
	if took < 2500*time.Millisecond {
		t.Fatalf("the pass took %s: it did not wait for the window", took)
	}
}

// idemmigrate.Migrate may run from several processes at once: they take turns on tern's
// advisory lock. Under a statement_timeout on the database or the owner's role (1 s here), a
// second migrate that waited longer than that failed with 57014 instead of taking its turn
// (D227). The first is stood in for by a transaction that holds tern's lock for 3 s.
func TestMigratesTakeTurnsUnderAStatementTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	first := pgtest.Connect(t, url)
	ftx, err := first.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ftx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, idemsql.TernLock); err != nil {
		t.Fatal(err)
	}
	second := pgtest.Connect(t, url+" statement_timeout=1000")
	ended := make(chan struct{})
	var committing atomic.Int64 // when the other's COMMIT was sent: its lock is held until then
	time.AfterFunc(3*time.Second, func() {
		defer close(ended)
		committing.Store(time.Now().UnixNano())
		_ = ftx.Commit(context.Background())
	})
	defer func() { <-ended }() // before the connection's cleanup closes it
	start := time.Now()
	err = idemmigrate.Migrate(ctx, second, idemmigrate.Options{})
	took := time.Since(start)
	if err != nil {
		t.Fatalf("a migrate that waits its turn behind another for 3 s, under a 1 s statement_timeout: %v after %s; want it to take its turn",
			err, took.Round(time.Millisecond))
	}
	if c := committing.Load(); c == 0 || time.Now().UnixNano() < c || took < time.Second {
		t.Fatalf("the migrate took %s and returned before the other's COMMIT was sent: it did not wait for the other", took)
	}
}
