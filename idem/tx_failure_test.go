package idem_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestReviewSilentTxHandlerFailureIs500: a transactional handler whose own
// statement failed (a unique violation it did not map to a final error) writes 201. The work
// cannot commit (the transaction is aborted), so the middleware answered 503 store_unavailable
// "the request could not be recorded; nothing was changed; retry with the same key" with
// Retry-After: 1: the store was healthy, and every retry got the same 503 (a client told the
// database is down). The same for a deferred constraint that fails at COMMIT. PostgreSQL's
// refusals of the work's own statements are 500 internal_error now (D173).
func TestReviewSilentTxHandlerFailureIs500(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	pgtest.Exec(t, pool, `CREATE TABLE rs_uniq (id int PRIMARY KEY); INSERT INTO rs_uniq VALUES (1);
		CREATE TABLE rs_parent (id int PRIMARY KEY);
		CREATE TABLE rs_child (p int REFERENCES rs_parent DEFERRABLE INITIALLY DEFERRED)`)
	rec := &recorder{}
	m := quietMiddleware(t, idem.Options{DB: pool, Metrics: rec})
	var runs atomic.Int32
	mux := http.NewServeMux()
	mux.Handle("POST /aborted", m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		_, _ = idem.TxFrom(r.Context()).Exec(r.Context(), `INSERT INTO rs_uniq VALUES (1)`) // fails: ignored (a handler bug)
		w.WriteHeader(201)
	})))
	mux.Handle("POST /deferred", m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		if _, err := idem.TxFrom(r.Context()).Exec(r.Context(), `INSERT INTO rs_child VALUES (42)`); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.WriteHeader(201) // the FK is checked at COMMIT
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	var bad []string
	for _, path := range []string{"/aborted", "/deferred"} {
		for i := range 3 {
			st, h, body := pgtest.Send(t, ctx, "POST", srv.URL+path, `{"a":1}`, "Idempotency-Key", "rs-f"+path)
			t.Logf("%s try %d: %d Retry-After %q %s", path, i, st, h.Get("Retry-After"), strings.TrimSpace(body))
			if strings.Contains(body, idem.CodeStoreUnavailable) {
				bad = append(bad, path)
				break
			}
		}
	}
	if len(bad) > 0 {
		t.Fatalf("a handler's own failed work (%v) is answered 503 %s (\"the database failed\", Retry-After 1) on every retry; "+
			"want the handler's failure told as one (500 %s), not a store outage", bad, idem.CodeStoreUnavailable, idem.CodeInternalError)
	}
	// Counted acquired, never store_error: the store-errors alert reads that as the database failing.
	if strings.Contains(rec.String(), string(idem.StateStoreError)) {
		t.Fatalf("a handler's own failed work was counted %v; want acquired only", rec)
	}
}

// TestReviewSilentTxContextEndedAnswer: a transactional handler whose context ended (Shutdown's
// ErrShutdown, the route's WorkTimeout) and that returns without writing is rolled back, as
// promised; but the client was told 503 store_unavailable ("the idempotency store is
// unavailable", logged at Error as a failed unit of work), not shutting_down (a lease route's
// answer to the same handler at Shutdown) nor a timeout of the work. Now 503 shutting_down at
// Shutdown, 500 internal_error at WorkTimeout (D173).
func TestReviewSilentTxContextEndedAnswer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	m := quietMiddleware(t, idem.Options{DB: pool})
	hIn := make(chan struct{}, 4)
	mux := http.NewServeMux()
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hIn <- struct{}{}
		<-r.Context().Done() // stops; writes nothing
	})
	mux.Handle("POST /wt", m.Route(idem.Route{WorkTimeout: 300 * time.Millisecond})(h))
	mux.Handle("POST /sd", m.Route(idem.Route{})(h))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/wt", `{"a":1}`, "Idempotency-Key", "zz-wt")
	<-hIn
	t.Logf("WorkTimeout: %d %s", st, strings.TrimSpace(body))
	wt := body
	res := shutdownSend(t, srv.URL+"/sd", `{"a":1}`, "zz-sd")
	<-hIn
	sctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	_ = m.Shutdown(sctx)
	r := <-res
	t.Logf("Shutdown: %d %s", r.status, strings.TrimSpace(r.body))
	if !strings.Contains(r.body, idem.CodeShuttingDown) || strings.Contains(wt, idem.CodeStoreUnavailable) {
		t.Fatalf("a transactional handler stopped by Shutdown got %d %s; one stopped by WorkTimeout %d %s: "+
			"want 503 %s for the first, and no store_unavailable (the store did not fail) for either",
			r.status, strings.TrimSpace(r.body), st, strings.TrimSpace(wt), idem.CodeShuttingDown)
	}
}

// TestReviewSilentHandlerLockTimeoutRunsOnce (D173): a transactional handler's own statement
// meets a lock timeout (a row another session holds; the handler asked for a short
// lock_timeout). The Gate took every lock timeout of its first try for its probe's (the key
// table locked by maintenance): it ran the whole unit again, each time with RunTx's own
// attempts (Options.MaxAttempts, 3: a lock timeout of the work's statements may pass), twelve
// runs in all, and answered "the idempotency store is locked for maintenance". The work's
// errors are its own now: the handler runs MaxAttempts times, then its answer is sent.
func TestReviewSilentHandlerLockTimeoutRunsMaxAttempts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 4)
	pgtest.Exec(t, pool, `CREATE TABLE rs_held (id int PRIMARY KEY); INSERT INTO rs_held VALUES (1)`)
	m := quietMiddleware(t, idem.Options{DB: pool})
	holder := pgtest.Connect(t, url)
	pgtest.Exec(t, holder, `BEGIN`)
	pgtest.Exec(t, holder, `SELECT * FROM rs_held WHERE id = 1 FOR UPDATE`)
	var runs atomic.Int32
	mux := http.NewServeMux()
	mux.Handle("POST /held", m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		tx := idem.TxFrom(r.Context())
		if _, err := tx.Exec(r.Context(), `SET LOCAL lock_timeout = '50ms'`); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if _, err := tx.Exec(r.Context(), `UPDATE rs_held SET id = 1 WHERE id = 1`); err != nil {
			http.Error(w, "held", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(201)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/held", `{"a":1}`, "Idempotency-Key", "rs-held")
	pgtest.Exec(t, holder, `ROLLBACK`)
	t.Logf("%d %s; handler runs %d", st, strings.TrimSpace(body), runs.Load())
	if runs.Load() != 3 || strings.Contains(body, "maintenance") {
		t.Fatalf("a handler whose own statement met a lock timeout ran %d times and was answered %d %s; want MaxAttempts (3) runs and no maintenance",
			runs.Load(), st, body)
	}
}
