package idem_test

// A review of D172 and D173's first build: each test failed then; its comment says what it
// showed, and the test asserts the mended behaviour (D173, "A review of this decision's first
// build").

import (
	"context"
	"errors"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestReviewD173ReadOnlyStoreIs503: the database turns read-only under a running server (a
// failover whose pool still reaches the demoted node, a hot standby, a provider's read-only mode
// on a full disk: default_transaction_read_only). The claim's idem_begin is refused with 25006
// (class 25), which handlerSQLError takes for "the handler's own work": 500 internal_error, no
// Retry-After, "The handler failed". Before D173 it was 503 store_unavailable with
// Retry-After: 1, which it is: the store cannot record anything, a retry may pass.
func TestReviewD173ReadOnlyStoreIs503(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, url := pgtest.NewPool(t, 2)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	cfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	m := quietMiddleware(t, idem.Options{DB: pool})
	var runs atomic.Int32
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /ro"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(201)
	})))
	defer srv.Close()
	st, h, body := pgtest.Send(t, ctx, "POST", srv.URL, `{"a":1}`, "Idempotency-Key", "rv-ro")
	t.Logf("read-only store: %d Retry-After %q %s (handler runs %d)", st, h.Get("Retry-After"), strings.TrimSpace(body), runs.Load())
	if st != http.StatusServiceUnavailable || !strings.Contains(body, idem.CodeStoreUnavailable) || h.Get("Retry-After") == "" {
		t.Fatalf("a store that refuses every write (25006, read-only) was answered %d %s (Retry-After %q); "+
			"want 503 %s with Retry-After: the handler never ran (%d runs), the store failed",
			st, strings.TrimSpace(body), h.Get("Retry-After"), idem.CodeStoreUnavailable, runs.Load())
	}
}

// TestReviewD173SuperfluousInvalidWriteHeaderIgnored: net/http checks a status only for the first
// WriteHeader; a later call (superfluous) is logged and ignored, whatever its code. The
// recorder panics on any call with a code below 100, also after the handler's answer: a handler
// (or a wrapper that replays a captured status at its end) that wrote 201 and then calls
// WriteHeader(0) gets 201 under net/http alone, and 500 internal_error, its work rolled back,
// under the middleware.
func TestReviewD173SuperfluousInvalidWriteHeaderIgnored(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	pgtest.Exec(t, pool, `CREATE TABLE rv_sup (id int)`)
	m := quietMiddleware(t, idem.Options{DB: pool})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if tx := idem.TxFrom(r.Context()); tx != nil {
			if _, err := tx.Exec(r.Context(), `INSERT INTO rv_sup VALUES (1)`); err != nil {
				t.Errorf("insert: %v", err)
			}
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":"1"}`))
		var captured int // a wrapper's status, never set
		w.WriteHeader(captured)
	})
	plain := httptest.NewUnstartedServer(h)
	plain.Config.ErrorLog = log.New(io.Discard, "", 0)
	plain.Start()
	defer plain.Close()
	pst, _, pbody := pgtest.Send(t, ctx, "POST", plain.URL, `{"a":1}`)
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /sup"})(h))
	defer srv.Close()
	st, _, body := pgtest.Send(t, ctx, "POST", srv.URL, `{"a":1}`, "Idempotency-Key", "rv-sup")
	n := pgtest.Count(t, pool, `SELECT count(*) FROM rv_sup`)
	t.Logf("net/http alone: %d %q; idem: %d %q, effects %d", pst, pbody, st, strings.TrimSpace(body), n)
	if pst == http.StatusCreated && (st != http.StatusCreated || n != 1) {
		t.Fatalf("a superfluous WriteHeader(0) after a 201 is ignored by net/http (%d) but panics under the middleware: %d %s, %d effects",
			pst, st, strings.TrimSpace(body), n)
	}
}

// TestReviewD173UnkeyedAbortedTxIs500: D173 says a transaction the handler left aborted is the
// handler's failure (500 internal_error), not a store outage. On a transactional route without
// a key it is 503 outcome_unknown ("the connection to the database was lost while the request
// was committing: it may or may not have taken effect"): the COMMIT of an aborted transaction
// comes back as pgx.ErrTxCommitRollback, which commitError (not a PgError, not SafeToRetry)
// takes for a lost connection, ErrCommitUnknown. Nothing can have committed. (A keyed request
// meets 25P02 at idem_complete instead; idem.RunTx's callers get ErrCommitUnknown too.)
func TestReviewD173UnkeyedAbortedTxIs500(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	pgtest.Exec(t, pool, `CREATE TABLE rv_uniq (id int PRIMARY KEY); INSERT INTO rv_uniq VALUES (1)`)
	m := quietMiddleware(t, idem.Options{DB: pool})
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /ab"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = idem.TxFrom(r.Context()).Exec(r.Context(), `INSERT INTO rv_uniq VALUES (1)`) // fails, ignored
		w.WriteHeader(201)
	})))
	defer srv.Close()
	st, h, body := pgtest.Send(t, ctx, "POST", srv.URL, `{"a":1}`) // no key
	t.Logf("unkeyed: %d Retry-After %q %s", st, h.Get("Retry-After"), strings.TrimSpace(body))
	if st != http.StatusInternalServerError || !strings.Contains(body, idem.CodeInternalError) {
		t.Fatalf("an unkeyed request whose handler left its transaction aborted (nothing can have committed) got %d %s (Retry-After %q); want 500 %s as a keyed one gets",
			st, strings.TrimSpace(body), h.Get("Retry-After"), idem.CodeInternalError)
	}
}

// TestReviewD173HandlerLockTimeoutOnTableNamedLikeKeyTable: D173's workError stops the probe loop for a
// lock timeout of the handler's own statements, but the check after the loop still sends any
// error that IsKeyWait accepts to a second run of the whole unit as a wait on the key's row
// (unit(rest, true)), with MaxAttempts runs of its own. IsKeyWait accepts a row wait on any
// relation whose name contains "idempotency_keys" (an application's own table, e.g. a legacy
// public.idempotency_keys or order_idempotency_keys): the handler runs 2×MaxAttempts times.
func TestReviewD173HandlerLockTimeoutOnTableNamedLikeKeyTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 4)
	pgtest.Exec(t, pool, `CREATE TABLE order_idempotency_keys (id int PRIMARY KEY); INSERT INTO order_idempotency_keys VALUES (1)`)
	m := quietMiddleware(t, idem.Options{DB: pool})
	holder := pgtest.Connect(t, url)
	pgtest.Exec(t, holder, `BEGIN`)
	pgtest.Exec(t, holder, `SELECT * FROM order_idempotency_keys WHERE id = 1 FOR UPDATE`)
	var runs atomic.Int32
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /held"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		tx := idem.TxFrom(r.Context())
		if _, err := tx.Exec(r.Context(), `SET LOCAL lock_timeout = '50ms'`); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if _, err := tx.Exec(r.Context(), `UPDATE order_idempotency_keys SET id = 1 WHERE id = 1`); err != nil {
			http.Error(w, "held", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(201)
	})))
	defer srv.Close()
	st, _, body := pgtest.Send(t, ctx, "POST", srv.URL, `{"a":1}`, "Idempotency-Key", "rv-held")
	pgtest.Exec(t, holder, `ROLLBACK`)
	t.Logf("%d %s; handler runs %d", st, strings.TrimSpace(body), runs.Load())
	if runs.Load() != 3 {
		t.Fatalf("a handler whose own statement met a lock timeout on its table order_idempotency_keys ran %d times; want MaxAttempts (3)", runs.Load())
	}
}

// TestReviewD173NestedDoKeyWaitRunsOuterWorkOnce: the same gap through Do. An outer Do whose fn returns
// an inner Do's ErrInProgress (the inner key held by another transaction past its lock
// timeout) has its whole unit run again as a wait on the outer key's row: fn runs twice, and
// the call takes two inner lock timeouts. The error is fn's (workError), not the outer claim's.
func TestReviewD173NestedDoKeyWaitRunsOuterWorkOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 6)
	holder := pgtest.Connect(t, url)
	pgtest.Exec(t, holder, `BEGIN`)
	// Another transaction claims the inner key and holds it, uncommitted.
	if _, err := idem.Begin(ctx, holder, idem.Claim{Principal: "p", Key: "rv-inner", Action: "inner"}); err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	start := time.Now()
	_, _, err := idem.Do(ctx, pool, idem.Job{Principal: "p", Key: "rv-outer", Action: "outer", LockTimeout: 2 * time.Second},
		idem.TxOptions{MaxAttempts: 1}, func(ctx context.Context, tx pgx.Tx) (int, error) {
			runs.Add(1)
			n, _, err := idem.Do(ctx, pool, idem.Job{Principal: "p", Key: "rv-inner", Action: "inner", LockTimeout: 300 * time.Millisecond},
				idem.TxOptions{MaxAttempts: 1}, func(ctx context.Context, tx pgx.Tx) (int, error) { return 1, nil })
			return n, err
		})
	pgtest.Exec(t, holder, `ROLLBACK`)
	t.Logf("outer Do: %v after %v; outer fn runs %d; ErrInProgress %v", err, time.Since(start).Round(time.Millisecond),
		runs.Load(), errors.Is(err, idem.ErrInProgress))
	if runs.Load() != 1 {
		t.Fatalf("the outer Do's fn ran %d times with MaxAttempts 1: its own failure (an inner key's wait) was taken for a wait on the outer key", runs.Load())
	}
}

// TestReviewD173DoReturnsFnErrorAsIs: before D173, Do returned fn's error as it was; it is now wrapped in
// the unexported workError. Callers that compare it (err == pgx.ErrNoRows, a type switch on
// their own error type) stop matching, although neither the error's text nor go doc changed.
func TestReviewD173DoReturnsFnErrorAsIs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	_, _, err := idem.Do(ctx, pool, idem.Job{Principal: "p", Key: "rv-norows", Action: "x"}, idem.TxOptions{},
		func(ctx context.Context, tx pgx.Tx) (int, error) {
			var n int
			return n, tx.QueryRow(ctx, `SELECT 1 WHERE false`).Scan(&n)
		})
	t.Logf("Do: %T %v; errors.Is %v", err, err, errors.Is(err, pgx.ErrNoRows))
	if err != pgx.ErrNoRows { //nolint:errorlint // the point of the test
		t.Fatalf("Do returned fn's pgx.ErrNoRows as %T (err == pgx.ErrNoRows is false); before, as it was", err)
	}
}
