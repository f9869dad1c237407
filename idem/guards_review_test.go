package idem_test

// The guards of D221 to D223 seen from the other side: savepoints used as pgx's idiom has it are
// not refused, a cleaner whose observer and logger both panic still counts its pass, and what
// a kept handle hands out after the unit of work.

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestGuardsRowsConnKeptPastUnit: the promise "Conn() returns nil" once the unit of work is
// over, reached through the rows of a query: pgx.Rows.Conn() handed out the raw connection,
// back in the pool, perhaps another request's (D223).
func TestGuardsRowsConnKeptPastUnit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 1)
	var rows pgx.Rows
	c := idem.Claim{Principal: "alice", Key: "rows-conn", Action: "a"}
	err := idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		if _, err := tx.Claim(ctx, c); err != nil {
			return err
		}
		var err error
		rows, err = tx.Query(ctx, `SELECT 1`)
		if err != nil {
			return err
		}
		rows.Close()
		tx.CompleteOnCommit(idem.Response{Status: 201, Header: http.Header{}, Body: []byte(`{}`)})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	conn := rows.Conn()
	t.Logf("rows kept past RunTx: Conn() = %p", conn)
	if conn != nil {
		t.Errorf("the rows of a query kept past the unit of work hand out its connection (%p), now the pool's: "+
			"the Tx's Conn() is nil then, and a savepoint's too (D223)", conn)
	}
}

// TestGuardsSavepointLegitimateUse: docs/http.md: "nested Begin makes savepoints as
// usual". The owner checks on every savepoint method (D223) refuse no legitimate use: a
// savepoint whose statement failed (the transaction aborted, 'E'), rolled back to, a savepoint
// inside it released with Commit, a nested one rolled back, and the handler's answer committed
// (201) or final (404), with `defer sp.Rollback` after Commit as pgx's idiom has it.
func TestGuardsSavepointLegitimateUse(t *testing.T) {
	t.Parallel()
	for _, status := range []int{http.StatusCreated, http.StatusNotFound} {
		t.Run(http.StatusText(status), func(t *testing.T) {
			pool, url := pgtest.NewPool(t, 4)
			cc := pgtest.Connect(t, url)
			pgtest.Exec(t, cc, `CREATE TABLE guards_sp (id int PRIMARY KEY, note text)`)
			pgtest.Exec(t, cc, `INSERT INTO guards_sp VALUES (1, 'there')`)
			var runs atomic.Int32
			var problem atomic.Value
			fail := func(w http.ResponseWriter, what string, err error) {
				problem.Store(what + ": " + err.Error())
				http.Error(w, what+": "+err.Error(), 500)
			}
			srv, _ := auditServer(t, idem.Options{DB: pool}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				ctx := r.Context()
				tx := idem.TxFrom(ctx)
				sp, err := tx.Begin(ctx)
				if err != nil {
					fail(w, "begin", err)
					return
				}
				defer sp.Rollback(ctx) //nolint:errcheck // pgx's idiom: a no-op after Commit
				if _, err := sp.Exec(ctx, `INSERT INTO guards_sp VALUES (1, 'dup')`); err == nil {
					fail(w, "dup insert", errors.New("no unique violation"))
					return
				}
				if err := sp.Rollback(ctx); err != nil { // ROLLBACK TO SAVEPOINT, out of 'E'
					fail(w, "rollback to savepoint", err)
					return
				}
				sp2, err := tx.Begin(ctx)
				if err != nil {
					fail(w, "begin 2", err)
					return
				}
				inner, err := sp2.Begin(ctx) // a savepoint inside a savepoint
				if err != nil {
					fail(w, "nested begin", err)
					return
				}
				if _, err := inner.Exec(ctx, `INSERT INTO guards_sp VALUES (2, 'inner, rolled back')`); err != nil {
					fail(w, "inner insert", err)
					return
				}
				if err := inner.Rollback(ctx); err != nil {
					fail(w, "inner rollback", err)
					return
				}
				inner2, err := sp2.Begin(ctx)
				if err != nil {
					fail(w, "nested begin 2", err)
					return
				}
				var id int
				if err := inner2.QueryRow(ctx, `INSERT INTO guards_sp VALUES (3, 'kept') RETURNING id`).Scan(&id); err != nil {
					fail(w, "inner2 insert", err)
					return
				}
				if err := inner2.Commit(ctx); err != nil {
					fail(w, "inner2 release", err)
					return
				}
				b := &pgx.Batch{}
				b.Queue(`INSERT INTO guards_sp VALUES (4, 'batch')`)
				if err := sp2.SendBatch(ctx, b).Close(); err != nil {
					fail(w, "batch", err)
					return
				}
				if _, err := sp2.CopyFrom(ctx, pgx.Identifier{"guards_sp"}, []string{"id", "note"}, pgx.CopyFromRows([][]any{{5, "copy"}})); err != nil {
					fail(w, "copy", err)
					return
				}
				if sp2.Conn() == nil {
					fail(w, "conn", errors.New("nil during the unit of work"))
					return
				}
				if err := sp2.Commit(ctx); err != nil {
					fail(w, "release", err)
					return
				}
				w.WriteHeader(status)
			})
			s1, _, b1 := auditPost(t, srv.URL, "sp-legit", `{}`)
			s2, h2, _ := auditPost(t, srv.URL, "sp-legit", `{}`)
			n := pgtest.Count(t, cc, `SELECT count(*) FROM guards_sp`)
			t.Logf("answer %d (%s), again %d (replayed %q); handler runs %d; rows %d; problem %v", s1, b1, s2, h2.Get("Idempotent-Replayed"), runs.Load(), n, problem.Load())
			want := 4 // 1, 3, 4, 5
			if status == http.StatusNotFound {
				want = 1 // the final answer rolls back to the claim's savepoint
			}
			if s1 != status || s2 != status || runs.Load() != 1 || n != want {
				t.Errorf("a legitimate use of savepoints: answered %d then %d (want %d twice), ran %d times (want 1), %d rows (want %d); "+
					"handler problem: %v", s1, s2, status, runs.Load(), n, want, problem.Load())
			}
		})
	}
}

// TestGuardsDoSavepointLegitimateUse: the same through Do's fn: a savepoint that failed,
// was rolled back to, and the work then succeeded.
func TestGuardsDoSavepointLegitimateUse(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 4)
	cc := pgtest.Connect(t, url)
	pgtest.Exec(t, cc, `CREATE TABLE guards_sp (id int PRIMARY KEY)`)
	pgtest.Exec(t, cc, `INSERT INTO guards_sp VALUES (1)`)
	job := idem.Job{Principal: "alice", Key: "do-sp-legit", Action: "a"}
	var runs atomic.Int32
	fn := func(ctx context.Context, tx pgx.Tx) (int, error) {
		runs.Add(1)
		sp, err := tx.Begin(ctx)
		if err != nil {
			return 0, err
		}
		if _, err := sp.Exec(ctx, `INSERT INTO guards_sp VALUES (1)`); err == nil {
			return 0, errors.New("no unique violation")
		}
		if err := sp.Rollback(ctx); err != nil {
			return 0, err
		}
		inner, err := tx.Begin(ctx)
		if err != nil {
			return 0, err
		}
		if _, err := inner.Exec(ctx, `INSERT INTO guards_sp VALUES (2)`); err != nil {
			return 0, err
		}
		if err := inner.Commit(ctx); err != nil {
			return 0, err
		}
		return 2, nil
	}
	v1, _, err1 := idem.Do(ctx, pool, job, idem.TxOptions{}, fn)
	v2, _, err2 := idem.Do(ctx, pool, job, idem.TxOptions{}, fn)
	n := pgtest.Count(t, cc, `SELECT count(*) FROM guards_sp`)
	t.Logf("Do: %d %v; again %d %v; runs %d; rows %d", v1, err1, v2, err2, runs.Load(), n)
	if err1 != nil || err2 != nil || v1 != 2 || v2 != 2 || runs.Load() != 1 || n != 2 {
		t.Errorf("Do with a legitimate savepoint: %d %v, then %d %v, %d run(s), %d rows; want 2 twice, one run, 2 rows", v1, err1, v2, err2, runs.Load(), n)
	}
}

type guardsPanicHandler struct{ handled atomic.Int32 }

func (h *guardsPanicHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *guardsPanicHandler) Handle(context.Context, slog.Record) error {
	h.handled.Add(1)
	panic("log handler bug")
}
func (h *guardsPanicHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *guardsPanicHandler) WithGroup(string) slog.Handler      { return h }

// TestGuardsCleanerObserverAndLoggerPanic: CleanupObserver: "A panic of theirs is
// recovered (the first logged at error, with its stack) and costs that event only";
// CleanerOptions.Logger: "A record whose handler panics is dropped". Both at once: the first
// panic's log line goes to a Logger whose handler panics too.
func TestGuardsCleanerObserverAndLoggerPanic(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	obs := &cbCleanupObs{panicAt: "vacuum"}
	pgtest.InsertExpired(t, pool, "alice", 500)
	h := &guardsPanicHandler{}
	c, err := idem.NewCleaner(pool, idem.CleanerOptions{Duty: 1, Metrics: obs, Logger: slog.New(h)})
	if err != nil {
		t.Fatal(err)
	}
	var recovered any
	var deleted int
	var perr error
	func() {
		defer func() { recovered = recover() }()
		deleted, _, perr = c.Pass(context.Background())
	}()
	t.Logf("pass: deleted %d, %v; recovered %v; PassEnded %d, Vacuumed %d; log records tried %d", deleted, perr, recovered,
		obs.passes.Load(), obs.vacuumed.Load(), h.handled.Load())
	if recovered != nil || obs.passes.Load() != 1 || deleted != 500 {
		t.Errorf("a Vacuumed that panics, logged to a Logger that panics: Pass's caller recovered %v, PassEnded %d time(s), %d deleted; "+
			"want no panic, PassEnded once, 500 deleted", recovered, obs.passes.Load(), deleted)
	}
}

// TestGuardsPrincipalAbortHandler: docs/http.md: a panic of the principal function is
// answered 500 internal_error, "http.ErrAbortHandler goes on up, as from a handler": the
// connection is cut without an answer, nothing is logged by the middleware as a panic, nothing
// claimed; the next request with the same key runs.
func TestGuardsPrincipalAbortHandler(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	var armed atomic.Bool
	armed.Store(true)
	var buf guardsLockedBuf
	var runs atomic.Int32
	srv, _ := auditServer(t, idem.Options{DB: pool, Logger: slog.New(slog.NewTextHandler(&buf, nil)), Principal: func(r *http.Request) (string, bool) {
		if armed.Load() {
			panic(http.ErrAbortHandler)
		}
		return "alice", true
	}}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) { runs.Add(1); w.WriteHeader(201) })
	req, _ := http.NewRequest("POST", srv.URL+"/things", strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", "abort-1")
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err == nil {
		resp.Body.Close()
	}
	t.Logf("Principal panicked with ErrAbortHandler: response %v, error %v; log: %q", resp != nil, err, buf.String())
	if err == nil {
		t.Errorf("Principal panicked with http.ErrAbortHandler: the client got an answer (%d); want the connection cut", resp.StatusCode)
	}
	if strings.Contains(buf.String(), "panicked") {
		t.Errorf("ErrAbortHandler logged as a panic: %s", buf.String())
	}
	armed.Store(false)
	if s, _, b := auditPost(t, srv.URL, "abort-1", `{}`); s != 201 || runs.Load() != 1 {
		t.Errorf("after the abort: %d %s, runs %d; want 201 and one run", s, b, runs.Load())
	}
}

type guardsLockedBuf struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *guardsLockedBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *guardsLockedBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestGuardsLeaseClaimInRunTx: Tx.CompleteOnCommit after a lease claim (Lease > 0) made in
// RunTx: a takeover of an expired lease is Claimed, and its answer is stored; a lease in
// progress (InProgress) answered with FinalOnCommit or CompleteOnCommit is refused with an
// error wrapping ErrClaimLost ("After a Claim whose outcome was not Claimed ... RunTx rolls back
// and returns an error wrapping ErrClaimLost") and the holder's lease is untouched.
func TestGuardsLeaseClaimInRunTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	// A takeover.
	c := idem.Claim{Principal: "alice", Key: "lease-runtx-takeover", Action: "a", Lease: time.Second}
	d0, err := idem.Begin(ctx, pool, c)
	if err != nil || d0.Outcome != idem.Claimed {
		t.Fatalf("first claim: %+v %v", d0, err)
	}
	time.Sleep(1200 * time.Millisecond)
	var outcome idem.Outcome
	err = idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		d, err := tx.Claim(ctx, c)
		outcome = d.Outcome
		if err != nil {
			return err
		}
		tx.CompleteOnCommit(idem.Response{Status: 201, Header: http.Header{}, Body: []byte(`{"taken":"over"}`)})
		return nil
	})
	d1, derr := idem.Begin(ctx, pool, c)
	t.Logf("takeover in RunTx: outcome %s, RunTx %v; key then %s %d %s (%v)", outcome, err, d1.Outcome, d1.Response.Status, d1.Response.Body, derr)
	if outcome != idem.Claimed || err != nil || d1.Outcome != idem.Replay || d1.Response.Status != 201 {
		t.Errorf("a lease takeover in RunTx answered with CompleteOnCommit: outcome %s, RunTx %v, key %s %d; want Claimed, nil, the answer replayed",
			outcome, err, d1.Outcome, d1.Response.Status)
	}
	// In progress.
	for _, how := range []string{"complete", "final"} {
		c2 := idem.Claim{Principal: "alice", Key: "lease-runtx-busy-" + how, Action: "a", Lease: 30 * time.Second}
		h, err := idem.Begin(ctx, pool, c2)
		if err != nil || h.Outcome != idem.Claimed {
			t.Fatalf("holder: %+v %v", h, err)
		}
		err = idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
			d, err := tx.Claim(ctx, c2)
			outcome = d.Outcome
			if err != nil {
				return err
			}
			r := idem.Response{Status: 404, Header: http.Header{}, Body: []byte(`{}`)}
			if how == "complete" {
				tx.CompleteOnCommit(r)
			} else {
				tx.FinalOnCommit(r)
			}
			return nil
		})
		cerr := idem.Complete(ctx, pool, "alice", c2.Key, h.Attempt, idem.Response{Status: 201, Header: http.Header{}, Body: []byte(`{"holder":1}`)})
		t.Logf("%s after %s: RunTx %v; the holder's Complete then: %v", how, outcome, err, cerr)
		if outcome != idem.InProgress || !errors.Is(err, idem.ErrClaimLost) || cerr != nil {
			t.Errorf("%s after %s: RunTx %v, the holder's Complete %v; want ErrClaimLost, and the holder's answer stored", how, outcome, err, cerr)
		}
	}
}
