package dbidem_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"reflect"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// modes runs f once with pgx's default statement cache and once with QueryExecModeExec
// (no named prepared statements: PgBouncer in transaction mode), each on a fresh database.
func modes(t *testing.T, f func(t *testing.T, pool *pgxpool.Pool)) {
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			cfg, err := pgxpool.ParseConfig(pgtest.NewDB(t))
			if err != nil {
				t.Fatal(err)
			}
			cfg.ConnConfig.DefaultQueryExecMode = mode
			cfg.MaxConns = 8
			pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			f(t, pool)
		})
	}
}

func claim(key, body string) dbidem.Claim {
	fp := canon.Compute("POST", "/v1/transfers", []byte(body))
	return dbidem.Claim{Principal: "alice", Key: key, Action: "POST /v1/transfers", Fingerprint: fp.Sum, Fields: fp.Fields}
}

func TestOutcomes(t *testing.T) {
	t.Parallel()
	modes(t, func(t *testing.T, pool *pgxpool.Pool) {
		ctx := context.Background()
		c := claim("k1", `{"amount":100,"to":"acc_2"}`)
		want := dbidem.Response{Status: 201, Body: []byte("{\"id\":7}\n\x00\xff"), ResourceID: "7",
			Header: http.Header{"Content-Type": {"application/json"}, "Vary": {"Accept, Origin"}}}
		err := dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
			d, err := tx.Claim(ctx, c)
			if err != nil {
				return err
			}
			if d.Outcome != dbidem.Claimed || d.Attempt < 1 {
				t.Errorf("fresh key: %+v", d)
			}
			tx.CompleteOnCommit(want)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}

		d, err := dbidem.Begin(ctx, pool, c)
		if err != nil {
			t.Fatal(err)
		}
		if d.Outcome != dbidem.Replay || !reflect.DeepEqual(d.Response, want) {
			t.Errorf("replay: %+v, want response %+v", d, want)
		}

		d, err = dbidem.Begin(ctx, pool, claim("k1", `{"amount":500,"to":"acc_2","memo":"x"}`))
		if err != nil {
			t.Fatal(err)
		}
		if d.Outcome != dbidem.Mismatch || !reflect.DeepEqual(d.ChangedFields, []string{"amount", "memo"}) {
			t.Errorf("mismatch: %+v", d)
		}
		other := claim("k1", `not json`)
		if d, err = dbidem.Begin(ctx, pool, other); err != nil {
			t.Fatal(err)
		}
		if d.Outcome != dbidem.Mismatch || d.ChangedFields != nil {
			t.Errorf("mismatch without fields: %+v, want nil ChangedFields", d)
		}
		moved := claim("k1", `{"amount":100,"to":"acc_2"}`)
		moved.Fingerprint = canon.Compute("POST", "/v1/elsewhere", []byte(`{"amount":100,"to":"acc_2"}`)).Sum
		if d, err = dbidem.Begin(ctx, pool, moved); err != nil {
			t.Fatal(err)
		}
		if d.Outcome != dbidem.Mismatch || d.ChangedFields == nil || len(d.ChangedFields) != 0 {
			t.Errorf("mismatch on the path: %+v, want empty ChangedFields", d)
		}

		lease := claim("job", `{}`)
		lease.Lease = time.Minute
		if d, err = dbidem.Begin(ctx, pool, lease); err != nil || d.Outcome != dbidem.Claimed {
			t.Fatalf("lease: %+v %v", d, err)
		}
		d, err = dbidem.Begin(ctx, pool, lease)
		if err != nil || d.Outcome != dbidem.InProgress || d.RetryAfter <= 59*time.Second || d.RetryAfter > time.Minute {
			t.Errorf("running lease: %+v %v", d, err)
		}
		job := d.Attempt
		if ok, err := dbidem.Release(ctx, pool, "alice", "job", job); err != nil || !ok {
			t.Errorf("release: %v %v", ok, err)
		}
		if err := dbidem.Complete(ctx, pool, "alice", "job", job, dbidem.Response{Status: 200}); !errors.Is(err, dbidem.ErrClaimLost) {
			t.Errorf("complete after release: %v, want ErrClaimLost", err)
		}
		var pgErr *pgconn.PgError
		if err := dbidem.Complete(ctx, pool, "alice", "job", job, dbidem.Response{Status: 200}); !errors.As(err, &pgErr) || pgErr.Code != "55000" {
			t.Errorf("the PgError is not reachable: %v", err)
		}
		if _, err := dbidem.Begin(ctx, pool, claim("has space", `{}`)); !errors.Is(err, dbidem.ErrInvalidArgument) {
			t.Errorf("bad key: %v, want ErrInvalidArgument", err)
		}
	})
}

func TestSaveFinalAndCleanup(t *testing.T) {
	t.Parallel()
	modes(t, func(t *testing.T, pool *pgxpool.Pool) {
		ctx := context.Background()
		c := claim("final", `{"amount":1}`)
		r := dbidem.Response{Status: 422, Header: http.Header{"Content-Type": {"application/problem+json"}}, Body: []byte(`{"code":"insufficient_funds"}`)}
		if ok, err := dbidem.SaveFinal(ctx, pool, c, r); err != nil || !ok {
			t.Fatalf("save_final: %v %v", ok, err)
		}
		if ok, err := dbidem.SaveFinal(ctx, pool, c, dbidem.Response{Status: 404}); err != nil || ok {
			t.Fatalf("second save_final: %v %v, want false", ok, err)
		}
		if d, err := dbidem.Begin(ctx, pool, c); err != nil || d.Outcome != dbidem.Replay || d.Response.Status != 422 {
			t.Fatalf("replay of the final response: %+v %v", d, err)
		}

		pgtest.InsertExpired(t, pool, "p", 2500)
		if n, err := dbidem.Cleanup(ctx, pool, 1000); err != nil || n != 2500 {
			t.Fatalf("cleanup: %d %v, want 2500", n, err)
		}
		if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys`); n != 1 {
			t.Fatalf("%d rows left, want the live one", n)
		}
		pgtest.InsertExpired(t, pool, "p", 1500)
		if n, err := dbidem.Cleanup(ctx, pool, 0); err != nil || n != 1500 { // 0: the SQL default, 1000
			t.Fatalf("cleanup with the default batch size: %d %v, want 1500", n, err)
		}
		cancelled, cancel := context.WithCancel(ctx)
		cancel()
		if _, err := dbidem.Cleanup(cancelled, pool, 1000); !errors.Is(err, context.Canceled) {
			t.Fatalf("cleanup with an ended context: %v", err)
		}
	})
}

func TestErrors(t *testing.T) {
	t.Parallel()
	modes(t, func(t *testing.T, pool *pgxpool.Pool) {
		ctx := context.Background()
		// The guard: a claim committed without its completion.
		err := dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
			_, err := tx.Claim(ctx, claim("forgot", `{}`))
			return err
		})
		if !errors.Is(err, dbidem.ErrClaimNotCompleted) {
			t.Fatalf("commit without completion: %v, want ErrClaimNotCompleted", err)
		}
		if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys`); n != 0 {
			t.Fatalf("%d rows after the refused commit", n)
		}

		// A concurrent holder past the lock timeout.
		holder, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer holder.Rollback(ctx)
		if _, err := dbidem.Begin(ctx, holder, claim("busy", `{}`)); err != nil {
			t.Fatal(err)
		}
		c := claim("busy", `{}`)
		c.LockTimeout = 100 * time.Millisecond
		err = dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
			_, err := tx.Claim(ctx, c)
			return err
		})
		if !errors.Is(err, dbidem.ErrInProgress) || dbidem.IsRetryable(err) {
			t.Fatalf("lock timeout: %v, want ErrInProgress (not retryable)", err)
		}
		_ = holder.Rollback(ctx)

		// An application's foreign key on the principal.
		if _, err := pool.Exec(ctx, `CREATE TABLE principals (id text PRIMARY KEY);
			INSERT INTO principals VALUES ('alice');
			ALTER TABLE idem.idempotency_keys ADD FOREIGN KEY (principal_id) REFERENCES principals (id) ON DELETE CASCADE`); err != nil {
			t.Fatal(err)
		}
		stranger := claim("k", `{}`)
		stranger.Principal = "mallory"
		err = dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
			_, err := tx.Claim(ctx, stranger)
			return err
		})
		if !errors.Is(err, dbidem.ErrUnknownPrincipal) {
			t.Fatalf("unknown principal: %v, want ErrUnknownPrincipal", err)
		}
	})
}

// TestRunTxRetries: a serialization failure reruns the whole unit; the effect commits once.
func TestRunTxRetries(t *testing.T) {
	t.Parallel()
	modes(t, func(t *testing.T, pool *pgxpool.Pool) {
		ctx := context.Background()
		if _, err := pool.Exec(ctx, `CREATE TABLE effects (n int)`); err != nil {
			t.Fatal(err)
		}
		var runs atomic.Int32
		c := claim("retry", `{"a":1}`)
		err := dbidem.RunTx(ctx, pool, dbidem.TxOptions{Backoff: time.Millisecond}, func(tx *dbidem.Tx) error {
			n := runs.Add(1)
			if _, err := tx.Claim(ctx, c); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, n); err != nil {
				return err
			}
			if n < 3 {
				_, err := tx.Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$`)
				return err
			}
			tx.CompleteOnCommit(dbidem.Response{Status: 201})
			return nil
		})
		if err != nil || runs.Load() != 3 {
			t.Fatalf("RunTx: %v after %d runs, want success after 3", err, runs.Load())
		}
		if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 1 {
			t.Fatalf("%d effects, want 1", n)
		}
		runs.Store(0)
		err = dbidem.RunTx(ctx, pool, dbidem.TxOptions{MaxAttempts: 2, Backoff: time.Millisecond}, func(tx *dbidem.Tx) error {
			runs.Add(1)
			_, err := tx.Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION 'deadlock' USING ERRCODE = '40P01'; END $$`)
			return err
		})
		if !dbidem.IsRetryable(err) || runs.Load() != 2 {
			t.Fatalf("bounded retries: %v after %d runs, want a retryable error after 2", err, runs.Load())
		}
	})
}

func TestDo(t *testing.T) {
	t.Parallel()
	modes(t, func(t *testing.T, pool *pgxpool.Pool) {
		ctx := context.Background()
		if _, err := pool.Exec(ctx, `CREATE TABLE shipments (order_id int, id serial)`); err != nil {
			t.Fatal(err)
		}
		type result struct{ ShipmentID int }
		ship := func(order int) (result, bool, error) {
			job := dbidem.Job{Principal: "worker", Key: "msg-42", Action: "ship", Input: map[string]int{"order": order}}
			return dbidem.Do(ctx, pool, job, dbidem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (result, error) {
				var r result
				err := tx.QueryRow(ctx, `INSERT INTO shipments (order_id) VALUES ($1) RETURNING id`, order).Scan(&r.ShipmentID)
				return r, err
			})
		}
		first, replayed, err := ship(7)
		if err != nil || replayed || first.ShipmentID == 0 {
			t.Fatalf("first: %+v %v %v", first, replayed, err)
		}
		again, replayed, err := ship(7)
		if err != nil || !replayed || again != first {
			t.Fatalf("repeat: %+v %v %v, want %+v replayed", again, replayed, err, first)
		}
		if _, _, err := ship(8); !errors.Is(err, dbidem.ErrMismatch) {
			t.Fatalf("other input: %v, want ErrMismatch", err)
		}
		if n := pgtest.Count(t, pool, `SELECT count(*) FROM shipments`); n != 1 {
			t.Fatalf("%d shipments, want 1", n)
		}
		failing := dbidem.Job{Principal: "worker", Key: "msg-43", Action: "ship"}
		boom := errors.New("boom")
		if _, _, err := dbidem.Do(ctx, pool, failing, dbidem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
			return 0, boom
		}); !errors.Is(err, boom) {
			t.Fatalf("failing job: %v", err)
		}
		if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'msg-43'`); n != 0 {
			t.Fatalf("a failed job left its key")
		}
	})
}

// roundTrips counts what goes over the wire: each query, batch and prepare is one round trip.
type roundTrips struct{ n atomic.Int32 }

func (r *roundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	r.n.Add(1)
	return ctx
}
func (r *roundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (r *roundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	r.n.Add(1)
	return ctx
}
func (r *roundTrips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (r *roundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}
func (r *roundTrips) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	r.n.Add(1)
	return ctx
}
func (r *roundTrips) TracePrepareEnd(context.Context, *pgx.Conn, pgx.TracePrepareEndData) {}

// TestRoundTrips: a keyed transaction costs no more round trips than the same transaction
// without a key (counted through a pgx tracer, once the statements are cached): BEGIN,
// idem_begin and the savepoint travel together, and so do idem_complete and COMMIT.
func TestRoundTrips(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			cfg, err := pgxpool.ParseConfig(pgtest.NewDB(t))
			if err != nil {
				t.Fatal(err)
			}
			tracer := &roundTrips{}
			cfg.ConnConfig.Tracer = tracer
			cfg.ConnConfig.DefaultQueryExecMode = mode
			cfg.MaxConns = 1
			pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			ctx := context.Background()
			if _, err := pool.Exec(ctx, `CREATE TABLE effects (n int)`); err != nil {
				t.Fatal(err)
			}
			plain := func(i int) error {
				return dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
					_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, i)
					return err
				})
			}
			keyed := func(i int) error {
				return dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
					c := claim("k"+string(rune('a'+i)), `{}`)
					if _, err := tx.Claim(ctx, c); err != nil {
						return err
					}
					if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, i); err != nil {
						return err
					}
					tx.CompleteOnCommit(dbidem.Response{Status: 201, Body: []byte("{}")})
					return nil
				})
			}
			measure := func(f func(int) error, i int) int32 {
				before := tracer.n.Load()
				if err := f(i); err != nil {
					t.Fatal(err)
				}
				return tracer.n.Load() - before
			}
			measure(plain, 0) // warm the statement cache
			measure(keyed, 0)
			p, k := measure(plain, 1), measure(keyed, 1)
			if k != p {
				t.Fatalf("round trips: %d without a key, %d with one; want as many", p, k)
			}
			t.Logf("%s: %d round trips without a key, %d with one", mode, p, k)
			if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE state = 'completed'`); n != 2 {
				t.Fatalf("%d completed keys, want 2", n)
			}
		})
	}
}

func ExampleRunTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pgtest.ExampleDB())
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	_, _ = pool.Exec(ctx, `CREATE TABLE transfers (id serial PRIMARY KEY, amount int)`)

	body := []byte(`{"amount": 100}`)
	fp := canon.Compute("POST", "/v1/transfers", body)
	claim := dbidem.Claim{Principal: "alice", Key: "k1", Action: "POST /v1/transfers",
		Fingerprint: fp.Sum, Fields: fp.Fields}

	handle := func() {
		err := dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
			d, err := tx.Claim(ctx, claim)
			if err != nil {
				return err
			}
			switch d.Outcome {
			case dbidem.Replay:
				fmt.Printf("replay: %d %s\n", d.Response.Status, d.Response.Body)
				return nil
			case dbidem.Claimed:
				var id int
				if err := tx.QueryRow(ctx, `INSERT INTO transfers (amount) VALUES (100) RETURNING id`).Scan(&id); err != nil {
					return err
				}
				resp := fmt.Sprintf(`{"id":%d}`, id)
				fmt.Printf("claimed: attempt %d, created %s\n", d.Attempt, resp)
				tx.CompleteOnCommit(dbidem.Response{
					Status: 201, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(resp)})
				return nil
			}
			return fmt.Errorf("refused: %s", d.Outcome)
		})
		if err != nil {
			fmt.Println("error:", err)
		}
	}
	handle() // the first request does the work
	handle() // the retry gets the first answer

	// Output:
	// claimed: attempt 1, created {"id":1}
	// replay: 201 {"id":1}
}
