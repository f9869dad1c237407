package idem_test

// Hostile handlers against the HTTP middleware: the application's code is the adversary.
// Each test counts the effects in a table and checks what a repeat gets.

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// countingObserver counts the states of keyed requests.
type countingObserver struct {
	mu     sync.Mutex
	counts map[idem.State]int
}

func (o *countingObserver) Count(_ string, s idem.State) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.counts == nil {
		o.counts = map[idem.State]int{}
	}
	o.counts[s]++
}
func (o *countingObserver) Done(idem.State, time.Duration)         {}
func (o *countingObserver) LeaseExtended(string)                   {}
func (o *countingObserver) LeaseEnded(string, bool, time.Duration) {}
func (o *countingObserver) get(s idem.State) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.counts[s]
}

// TestRollbackScriptIsTheHandlersFailure: a handler that sends a script whose ROLLBACK comes
// before an INSERT, as one Exec (the simple protocol runs several statements) or one batch:
// the INSERT runs after the claim's transaction, in an implicit transaction of its own, and
// commits before the call returns, which no check of the Tx can stop (docs/http.md says so:
// the handler's bug). The middleware answered 503 store_unavailable "nothing was changed;
// retry with the same key" for the batch, which a client retries, committing the INSERT
// again each time. The end of the transaction is the handler's failure: 500, the handler's
// own or internal_error, never a 503 that says nothing was changed, and counted acquired.
func TestRollbackScriptIsTheHandlersFailure(t *testing.T) {
	t.Parallel()
	for _, form := range []string{"exec", "batch", "lease-step"} {
		t.Run(form, func(t *testing.T) {
			obs := &countingObserver{}
			pool, url := pgtest.NewPool(t, 4)
			cc := pgtest.Connect(t, url)
			pgtest.Exec(t, cc, `CREATE TABLE handler_eff (id serial PRIMARY KEY, note text)`)
			rt := idem.Route{}
			if form == "lease-step" {
				rt.Lease = 2 * time.Second
			}
			srv, _ := auditServer(t, idem.Options{DB: pool, Metrics: obs}, rt, func(w http.ResponseWriter, r *http.Request) {
				ctx := r.Context()
				tx := idem.TxFrom(ctx)
				var err error
				switch form {
				case "lease-step":
					_, err = idem.Step(ctx, "script", func(ctx context.Context, tx pgx.Tx) (int, error) {
						_, err := tx.Exec(ctx, `ROLLBACK; INSERT INTO handler_eff (note) VALUES ('outside')`)
						return 1, err
					})
				case "exec":
					_, err = tx.Exec(ctx, `ROLLBACK; INSERT INTO handler_eff (note) VALUES ('outside')`)
				case "batch":
					b := &pgx.Batch{}
					b.Queue(`ROLLBACK`)
					b.Queue(`INSERT INTO handler_eff (note) VALUES ($1)`, "outside")
					err = tx.SendBatch(ctx, b).Close()
				}
				if err != nil {
					if !errors.Is(err, idem.ErrTxOwned) {
						t.Errorf("%s: the handler's error %v; want ErrTxOwned", form, err)
					}
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				w.WriteHeader(http.StatusCreated)
			})
			s, _, b := auditPost(t, srv.URL, "rb-script", `{}`)
			if s != http.StatusInternalServerError || auditCode(b) == "store_unavailable" || obs.get(idem.StateStoreError) != 0 {
				t.Fatalf("%s: answered %d %s, store_error counted %d; want the handler's failure, 500", form, s, auditCode(b), obs.get(idem.StateStoreError))
			}
		})
	}
}

// TestTxEndedBySQLIsNotAStoreFailure: a handler that ends the claim's transaction itself
// (COMMIT, ROLLBACK, ROLLBACK AND CHAIN sent as SQL through idem.TxFrom) and answers 201. The
// store did not fail: it is the handler's own misuse (ErrTxOwned), met again by every retry.
// It was answered 503 store_unavailable with Retry-After: 1 and counted store_error, on every
// retry; it is 500 internal_error, counted acquired, and nothing is committed.
func TestTxEndedBySQLIsNotAStoreFailure(t *testing.T) {
	t.Parallel()
	for _, stmt := range []string{"COMMIT", "ROLLBACK", "ROLLBACK AND CHAIN"} {
		t.Run(stmt, func(t *testing.T) {
			obs := &countingObserver{}
			pool, url := pgtest.NewPool(t, 4)
			cc := pgtest.Connect(t, url)
			pgtest.Exec(t, cc, `CREATE TABLE handler_eff (id serial PRIMARY KEY, note text)`)
			srv, _ := auditServer(t, idem.Options{DB: pool, Metrics: obs}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
				ctx := r.Context()
				tx := idem.TxFrom(ctx)
				_, _ = tx.Exec(ctx, `INSERT INTO handler_eff (note) VALUES ('before')`)
				_, _ = tx.Exec(ctx, stmt)
				_, _ = tx.Exec(ctx, `INSERT INTO handler_eff (note) VALUES ('after')`)
				w.WriteHeader(http.StatusCreated)
			})
			s, h, b := auditPost(t, srv.URL, "ended-1", `{}`)
			s2, _, b2 := auditPost(t, srv.URL, "ended-1", `{}`)
			n := pgtest.Count(t, cc, `SELECT count(*) FROM handler_eff`)
			if n != 0 {
				t.Errorf("%s: %d effect rows committed", stmt, n)
			}
			if s != 500 || auditCode(b) != "internal_error" || obs.get(idem.StateStoreError) > 0 {
				t.Fatalf("%s sent by the handler: answered %d %s (Retry-After %q), repeat %d %s, store_error counted %d times; "+
					"want the handler's failure (500 internal_error, counted acquired), not a failing store",
					stmt, s, auditCode(b), h.Get("Retry-After"), s2, auditCode(b2), obs.get(idem.StateStoreError))
			}
		})
	}
}

// TestKeptTxPrepareAfterTheHandlerReturned: a handler that keeps idem.TxFrom(ctx) and uses it
// after it returned (a goroutine). Every statement method refused then, but Prepare ran on the
// connection, which was back in the pool and could be another request's: the statement it
// prepared appeared on the connection of whoever held it (with two goroutines on one pgx.Conn,
// a protocol corruption). Everything refuses with pgx.ErrTxClosed once the unit of work is
// over, and nothing is prepared on the pool's connection.
func TestKeptTxPrepareAfterTheHandlerReturned(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 1) // one connection: the kept tx's is the next request's
	var kept atomic.Value
	srv, _ := auditServer(t, idem.Options{DB: pool}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		tx := idem.TxFrom(r.Context())
		if _, err := tx.Exec(r.Context(), `SELECT 1`); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		kept.Store(tx)
		w.WriteHeader(http.StatusCreated)
	})
	if s, _, b := auditPost(t, srv.URL, "kept-1", `{}`); s != 201 {
		t.Fatalf("first: %d %s", s, b)
	}
	tx := kept.Load().(pgx.Tx)
	ctx := context.Background()
	_, execErr := tx.Exec(ctx, `SELECT 1`)
	_, prepErr := tx.Prepare(ctx, "kept_after_return", `SELECT 42`)
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_prepared_statements WHERE name = 'kept_after_return'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	t.Logf("after the handler returned: Exec %v; Prepare %v", execErr, prepErr)
	if !errors.Is(execErr, pgx.ErrTxClosed) {
		t.Errorf("Exec on the kept transaction: %v; want pgx.ErrTxClosed", execErr)
	}
	if prepErr == nil || n != 0 {
		t.Fatalf("Prepare on a transaction whose unit of work ended: error %v, and the statement is on the pool's connection "+
			"(%d of it seen by the next user of the pool); want an error (as Exec's, and as pgx's Tx.Prepare after its end: "+
			"pgx.ErrTxClosed) and nothing sent", prepErr, n)
	}
}
