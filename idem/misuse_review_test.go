package idem_test

// API misuse: a developer who read only `go doc` makes the mistakes real users make. Each test
// checks that the outcome is what the docs say, and that nothing worse happens (a key held
// forever, a double effect, a stored answer for work that rolled back, a leaked statement on a
// connection of the pool).

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

func misuseEffects(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	cc := pgtest.Connect(t, url)
	pgtest.Exec(t, cc, `CREATE TABLE IF NOT EXISTS misuse_eff (id serial PRIMARY KEY, note text)`)
	return cc
}

// TestMisuseSavepointAfterSQLRollback: docs/http.md, "Rules for handlers": "Nor send COMMIT,
// ROLLBACK or ROLLBACK AND CHAIN as SQL through it: every statement after one returns
// idem.ErrTxOwned, and the request is answered 500 internal_error ..., with nothing of its work
// committed." A handler that made a savepoint first (tx.Begin, "nested Begin makes savepoints
// as usual") and then sent ROLLBACK goes on writing through the savepoint's pgx.Tx, in a
// separate call. The savepoint checked nothing before it sent: the statement autocommitted
// outside the key, once per try, and QueryRow even returned nil (D223). It is refused before
// it is sent now.
func TestMisuseSavepointAfterSQLRollback(t *testing.T) {
	t.Parallel()
	for _, via := range []string{"exec", "queryrow", "batch"} {
		t.Run(via, func(t *testing.T) {
			pool, url := pgtest.NewPool(t, 4)
			cc := misuseEffects(t, url)
			var laterErr atomic.Value
			srv, _ := auditServer(t, idem.Options{DB: pool}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
				ctx := r.Context()
				tx := idem.TxFrom(ctx)
				sp, err := tx.Begin(ctx)
				if err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				_, rbErr := tx.Exec(ctx, `ROLLBACK`) // the mistake: ErrTxOwned, which the handler ignores
				_ = rbErr
				var err2 error
				switch via {
				case "exec":
					_, err2 = sp.Exec(ctx, `INSERT INTO misuse_eff (note) VALUES ('after rollback')`)
				case "queryrow":
					var id int
					err2 = sp.QueryRow(ctx, `INSERT INTO misuse_eff (note) VALUES ('after rollback') RETURNING id`).Scan(&id)
				case "batch":
					b := &pgx.Batch{}
					b.Queue(`INSERT INTO misuse_eff (note) VALUES ($1)`, "after rollback")
					err2 = sp.SendBatch(ctx, b).Close()
				}
				if err2 == nil {
					laterErr.Store("<nil>")
				} else {
					laterErr.Store(err2.Error())
				}
				w.WriteHeader(http.StatusCreated)
			})
			s1, _, b1 := auditPost(t, srv.URL, "sp-rb-"+via, `{}`)
			s2, _, b2 := auditPost(t, srv.URL, "sp-rb-"+via, `{}`)
			n := pgtest.Count(t, cc, `SELECT count(*) FROM misuse_eff`)
			t.Logf("%s: first %d %s, retry %d %s; the savepoint's statement after ROLLBACK: %v; effect rows committed: %d",
				via, s1, auditCode(b1), s2, auditCode(b2), laterErr.Load(), n)
			if n != 0 {
				t.Errorf("%s: %d effect row(s) committed outside the key by a statement sent through a savepoint after the handler's "+
					"ROLLBACK (one per try of the request); the docs promise every statement after it returns ErrTxOwned, with nothing "+
					"of the work committed", via, n)
			}
			if e, _ := laterErr.Load().(string); !strings.Contains(e, "RunTx") && !strings.Contains(e, "ended the transaction") {
				t.Errorf("%s: the savepoint's statement after ROLLBACK returned %q; want ErrTxOwned", via, e)
			}
		})
	}
}

// TestMisuseDoSavepointAfterSQLRollback: the same through Do (ErrTxOwned's doc: "every
// statement after a statement sent through it ended it (COMMIT, ROLLBACK, END or ABORT as SQL)"
// is refused; "nothing of the unit of work is committed"). Do returned ErrTxOwned, yet each
// call had committed its row: a double effect (D223).
func TestMisuseDoSavepointAfterSQLRollback(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 4)
	cc := misuseEffects(t, url)
	job := idem.Job{Principal: "alice", Key: "do-sp-rb", Action: "a"}
	fn := func(ctx context.Context, tx pgx.Tx) (int, error) {
		sp, err := tx.Begin(ctx)
		if err != nil {
			return 0, err
		}
		_, _ = tx.Exec(ctx, `ROLLBACK`)
		_, err = sp.Exec(ctx, `INSERT INTO misuse_eff (note) VALUES ('after rollback')`)
		return 1, err
	}
	_, _, err1 := idem.Do(ctx, pool, job, idem.TxOptions{}, fn)
	_, _, err2 := idem.Do(ctx, pool, job, idem.TxOptions{}, fn)
	n := pgtest.Count(t, cc, `SELECT count(*) FROM misuse_eff`)
	t.Logf("Do: %v; again: %v; effect rows committed: %d", err1, err2, n)
	if !errors.Is(err1, idem.ErrTxOwned) || n != 0 {
		t.Errorf("Do whose fn wrote through a savepoint after ROLLBACK: %v, %d effect row(s) committed (one per Do); "+
			"want ErrTxOwned and nothing committed", err1, n)
	}
}

// TestMisuseKeptSavepointAfterHandlerReturned: docs/http.md: "The Tx refuses everything once
// the request's unit of work is over: a goroutine that keeps it gets pgx.ErrTxClosed". A
// goroutine that keeps a savepoint made from it (tx.Begin) instead of the Tx itself. Its
// statements went to a connection that was back in the pool, where they autocommitted, or ran
// inside whichever request held that connection then (D223).
func TestMisuseKeptSavepointAfterHandlerReturned(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 1) // one connection: the kept savepoint's is the next user's
	cc := misuseEffects(t, url)
	var kept atomic.Value
	srv, _ := auditServer(t, idem.Options{DB: pool}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		sp, err := idem.TxFrom(r.Context()).Begin(r.Context())
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		kept.Store(sp)
		w.WriteHeader(http.StatusCreated)
	})
	if s, _, b := auditPost(t, srv.URL, "kept-sp", `{}`); s != 201 {
		t.Fatalf("first: %d %s", s, b)
	}
	sp := kept.Load().(pgx.Tx)
	ctx := context.Background()
	_, execErr := sp.Exec(ctx, `INSERT INTO misuse_eff (note) VALUES ('from a kept savepoint')`)
	n := pgtest.Count(t, cc, `SELECT count(*) FROM misuse_eff`)
	t.Logf("a kept savepoint after the handler returned: Exec %v; rows committed %d", execErr, n)
	if n != 0 {
		t.Errorf("a savepoint of the request's Tx, kept past the unit of work: Exec returned %v, yet %d row(s) were committed on the "+
			"pool's connection (the statement was sent, autocommitted, and only then refused); want pgx.ErrTxClosed and nothing sent "+
			"(as the Tx itself)", execErr, n)
	}

	// Worse: while another request holds the pool's one connection in its unit of work, the kept
	// savepoint's statement runs inside that request's transaction and commits with its key.
	inB, releaseB := make(chan struct{}), make(chan struct{})
	srvB, _ := auditServer(t, idem.Options{DB: pool}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		if _, err := idem.TxFrom(r.Context()).Exec(r.Context(), `SELECT 1`); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		close(inB)
		<-releaseB
		w.WriteHeader(http.StatusCreated)
	})
	done := make(chan int, 1)
	go func() { s, _, _ := auditPost(t, srvB.URL, "kept-sp-B", `{}`); done <- s }()
	<-inB
	_, execErr2 := sp.Exec(ctx, `INSERT INTO misuse_eff (note) VALUES ('inside B')`)
	close(releaseB)
	sB := <-done
	nB := pgtest.Count(t, cc, `SELECT count(*) FROM misuse_eff WHERE note = 'inside B'`)
	t.Logf("during request B: Exec %v; B answered %d; rows of the kept savepoint committed with B: %d", execErr2, sB, nB)
	if nB != 0 {
		t.Errorf("a kept savepoint's statement ran inside another request's transaction (committed with its key, %d row(s)), "+
			"error %v; want it refused before it is sent", nB, execErr2)
	}
}

// TestMisuseCompleteAfterReplay: Tx.CompleteOnCommit's doc: "After a Claim whose outcome was
// not Claimed ... RunTx rolls back and returns an error wrapping ErrClaimLost." A caller that
// ignored a Replay (or Mismatch) outcome and called CompleteOnCommit got an error that blamed
// the work for ending the transaction (ErrTxOwned, "the work sent ROLLBACK AND CHAIN?"), SQL
// it never wrote (D223).
func TestMisuseCompleteAfterReplay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	c := idem.Claim{Principal: "alice", Key: "complete-after-replay", Action: "a"}
	if err := idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		if _, err := tx.Claim(ctx, c); err != nil {
			return err
		}
		tx.CompleteOnCommit(idem.Response{Status: 201, Header: http.Header{}, Body: []byte(`{}`)})
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	for _, other := range []bool{false, true} {
		cl := c
		if other {
			cl.Fingerprint[0] = 1 // another request under the key: Mismatch
		}
		var outcome idem.Outcome
		err := idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
			d, err := tx.Claim(ctx, cl)
			outcome = d.Outcome
			if err != nil {
				return err
			}
			tx.CompleteOnCommit(idem.Response{Status: 201, Header: http.Header{}, Body: []byte(`{}`)})
			return nil
		})
		t.Logf("CompleteOnCommit after %s: %v", outcome, err)
		if !errors.Is(err, idem.ErrClaimLost) || errors.Is(err, idem.ErrTxOwned) {
			t.Errorf("CompleteOnCommit after a %s outcome: RunTx returned %v; want ErrClaimLost (as CompleteOnCommit's doc says), "+
				"not ErrTxOwned blaming SQL the work never sent", outcome, err)
		}
	}
}

// TestMisuseBeginOnPool: Begin of a transactional claim (Lease 0) on a pool, outside a
// transaction ("the transaction must complete the claim before it commits"): the statement's
// own implicit transaction commits at once, which the commit guard refuses. The caller must
// learn that (ErrClaimNotCompleted), and nothing may stay behind.
func TestMisuseBeginOnPool(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	c := idem.Claim{Principal: "alice", Key: "pool-begin", Action: "a"}
	d, err := idem.Begin(ctx, pool, c)
	_, found, rerr := idem.ReadKey(ctx, pool, "alice", "pool-begin")
	t.Logf("Begin on a pool: %+v %v; key found %v (%v)", d.Outcome, err, found, rerr)
	if !errors.Is(err, idem.ErrClaimNotCompleted) || found {
		t.Errorf("Begin of a transactional claim on a pool: %v (outcome %q), key left: %v; want ErrClaimNotCompleted and no key",
			err, d.Outcome, found)
	}
}

// TestMisuseLeaseCallsOutOfOrder: the calls of a lease claim made by hand, twice, late and with
// the wrong token. Complete, Extend and RecordStep return ErrClaimLost "when no lease claim
// with this attempt is in progress"; Release and Yield false. The first answer stays.
func TestMisuseLeaseCallsOutOfOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	c := idem.Claim{Principal: "alice", Key: "lease-ooo", Action: "a", Lease: 30 * time.Second}
	d, err := idem.Begin(ctx, pool, c)
	if err != nil || d.Outcome != idem.Claimed {
		t.Fatalf("claim: %+v %v", d, err)
	}
	// the wrong token first
	if err := idem.Complete(ctx, pool, "alice", "lease-ooo", d.Attempt+1, idem.Response{Status: 500}); !errors.Is(err, idem.ErrClaimLost) {
		t.Errorf("Complete with another token: %v; want ErrClaimLost", err)
	}
	if err := idem.Complete(ctx, pool, "alice", "lease-ooo", d.Attempt-1, idem.Response{Status: 500}); !errors.Is(err, idem.ErrClaimLost) {
		t.Errorf("Complete with an earlier token: %v; want ErrClaimLost", err)
	}
	first := idem.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"id":1}`)}
	if err := idem.Complete(ctx, pool, "alice", "lease-ooo", d.Attempt, first); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	if err := idem.Complete(ctx, pool, "alice", "lease-ooo", d.Attempt, idem.Response{Status: 202, Body: []byte(`{"id":2}`)}); !errors.Is(err, idem.ErrClaimLost) {
		t.Errorf("a second Complete: %v; want ErrClaimLost", err)
	}
	if ok, err := idem.Yield(ctx, pool, "alice", "lease-ooo", d.Attempt); ok || err != nil {
		t.Errorf("Yield after Complete: %v %v; want false", ok, err)
	}
	if ok, err := idem.Release(ctx, pool, "alice", "lease-ooo", d.Attempt); ok || err != nil {
		t.Errorf("Release after Complete: %v %v; want false", ok, err)
	}
	if _, err := idem.Extend(ctx, pool, "alice", "lease-ooo", d.Attempt, time.Minute); !errors.Is(err, idem.ErrClaimLost) {
		t.Errorf("Extend after Complete: %v; want ErrClaimLost", err)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return idem.RecordStep(ctx, tx, "alice", "lease-ooo", d.Attempt, "late", nil)
	})
	if !errors.Is(err, idem.ErrClaimLost) {
		t.Errorf("RecordStep after Complete: %v; want ErrClaimLost", err)
	}
	d2, err := idem.Begin(ctx, pool, c)
	if err != nil || d2.Outcome != idem.Replay || d2.Response.Status != 201 || string(d2.Response.Body) != `{"id":1}` {
		t.Errorf("the key after the misuse: %+v %v; want the first answer replayed", d2, err)
	}
}

// TestMisuseTxClaimIgnoringOutcome: RunTx with Tx.Claim whose caller ignores the Outcome (a
// Replay) and does the work and completes anyway. The stored answer must stay the first's, and
// the repeated work must not commit.
func TestMisuseTxClaimIgnoringOutcome(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 4)
	cc := misuseEffects(t, url)
	c := idem.Claim{Principal: "alice", Key: "ignore-outcome", Action: "a"}
	first := idem.Response{Status: 201, Header: http.Header{}, Body: []byte(`{"id":1}`)}
	if err := idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		if d, err := tx.Claim(ctx, c); err != nil || d.Outcome != idem.Claimed {
			return errors.Join(err, errors.New(string(d.Outcome)))
		}
		if _, err := tx.Exec(ctx, `INSERT INTO misuse_eff (note) VALUES ('first')`); err != nil {
			return err
		}
		tx.CompleteOnCommit(first)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	for _, how := range []string{"complete", "final"} {
		var outcome idem.Outcome
		err := idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
			d, err := tx.Claim(ctx, c)
			if err != nil {
				return err
			}
			outcome = d.Outcome // Replay, ignored
			if _, err := tx.Exec(ctx, `INSERT INTO misuse_eff (note) VALUES ('again')`); err != nil {
				return err
			}
			if how == "complete" {
				tx.CompleteOnCommit(idem.Response{Status: 202, Header: http.Header{}, Body: []byte(`{"id":2}`)})
			} else {
				tx.FinalOnCommit(idem.Response{Status: 404, Header: http.Header{}, Body: []byte(`{"gone":true}`)})
			}
			return nil
		})
		d, derr := idem.Begin(ctx, pool, c) // a read: the row is completed, so it replays
		n := pgtest.Count(t, cc, `SELECT count(*) FROM misuse_eff WHERE note = 'again'`)
		t.Logf("%s after %s: RunTx %v; key now %s %d %s; repeated work committed %d", how, outcome, err, d.Outcome, d.Response.Status, d.Response.Body, n)
		if derr != nil || d.Response.Status != 201 || string(d.Response.Body) != `{"id":1}` {
			t.Errorf("%s after %s: the stored answer is now %d %s (%v); want the first's", how, outcome, d.Response.Status, d.Response.Body, derr)
		}
		if how == "final" && n != 0 {
			t.Errorf("final after %s: %d repeated effect row(s) committed; FinalOnCommit rolls the work back to the claim's savepoint", outcome, n)
		}
		if how == "complete" && (err == nil) != (n == 1) {
			t.Errorf("complete after %s: RunTx %v with %d repeated effect row(s) committed", outcome, err, n)
		}
	}
}

// TestMisuseCanceledContext: Do and DoLease called with a context that ended already: fn does
// not run, the context's error comes back, and no key is left behind (in progress or
// otherwise).
func TestMisuseCanceledContext(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var ran atomic.Int32
	_, _, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: "done-do", Action: "a"}, idem.TxOptions{},
		func(context.Context, pgx.Tx) (int, error) { ran.Add(1); return 1, nil })
	_, _, lerr := idem.DoLease(ctx, pool, idem.Job{Principal: "alice", Key: "done-lease", Action: "a", Lease: 5 * time.Second},
		func(context.Context, idem.LeaseClaim) (int, error) { ran.Add(1); return 1, nil })
	bg := context.Background()
	_, f1, _ := idem.ReadKey(bg, pool, "alice", "done-do")
	_, f2, _ := idem.ReadKey(bg, pool, "alice", "done-lease")
	t.Logf("Do %v; DoLease %v; fn ran %d; keys left %v %v", err, lerr, ran.Load(), f1, f2)
	if !errors.Is(err, context.Canceled) || !errors.Is(lerr, context.Canceled) || ran.Load() != 0 || f1 || f2 {
		t.Errorf("with a context that ended: Do %v, DoLease %v, fn ran %d times, keys left %v %v; want context.Canceled, no run, no key",
			err, lerr, ran.Load(), f1, f2)
	}
}

// TestMisuseResponseControllerAndHijack: docs/http.md: "http.ResponseController's deadlines,
// EnableFullDuplex and Hijack return http.ErrNotSupported, and a 1xx such as 103 Early Hints is
// not sent". A handler that tries them all, then answers 201: the answer is stored and replayed
// as sent.
func TestMisuseResponseControllerAndHijack(t *testing.T) {
	t.Parallel()
	var errs atomic.Value
	srv, _ := auditServer(t, idem.Options{}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		rc := http.NewResponseController(w)
		var got []error
		got = append(got, rc.SetWriteDeadline(time.Now().Add(time.Second)), rc.SetReadDeadline(time.Now().Add(time.Second)),
			rc.EnableFullDuplex())
		_, _, herr := rc.Hijack()
		got = append(got, herr)
		errs.Store(got)
		w.Header().Set("Link", "</a.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		_ = rc.Flush()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":7}`))
	})
	s1, _, b1 := auditPost(t, srv.URL, "rc-1", `{}`)
	s2, h2, b2 := auditPost(t, srv.URL, "rc-1", `{}`)
	got, _ := errs.Load().([]error)
	t.Logf("controller errors %v; first %d %s; repeat %d %s replayed %q", got, s1, b1, s2, b2, h2.Get("Idempotent-Replayed"))
	for i, e := range got {
		if !errors.Is(e, http.ErrNotSupported) {
			t.Errorf("ResponseController call %d: %v; want http.ErrNotSupported", i, e)
		}
	}
	if s1 != 201 || b1 != `{"id":7}` || s2 != 201 || b2 != `{"id":7}` || h2.Get("Idempotent-Replayed") != "true" {
		t.Errorf("first %d %s, repeat %d %s; want 201 {\"id\":7} both, the second replayed", s1, b1, s2, b2)
	}
}

// TestMisuseRollbackBeginThenFinal: a handler that sends "ROLLBACK; BEGIN" as one Exec (the
// claim's transaction ends, a new one starts, so the Tx sees a transaction in progress), then
// answers a final status (404). Its claim is gone; nothing is stored, nothing committed. The
// store did not fail: the docs answer a transaction ended by the handler 500 internal_error
// ("the handler's failure, counted acquired"). It was 503 store_unavailable, counted
// store_error, which a client retries forever (the claim's savepoint gone, 3B001; D223).
func TestMisuseRollbackBeginThenFinal(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 4)
	cc := misuseEffects(t, url)
	obs := &countingObserver{}
	srv, _ := auditServer(t, idem.Options{DB: pool, Metrics: obs}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		tx := idem.TxFrom(ctx)
		_, _ = tx.Exec(ctx, `ROLLBACK; BEGIN`)
		_, _ = tx.Exec(ctx, `INSERT INTO misuse_eff (note) VALUES ('in the new transaction')`)
		http.Error(w, `{"not":"found"}`, http.StatusNotFound)
	})
	s, h, b := auditPost(t, srv.URL, "rb-begin-final", `{}`)
	n := pgtest.Count(t, cc, `SELECT count(*) FROM misuse_eff`)
	_, found, _ := idem.ReadKey(context.Background(), pool, "alice", "rb-begin-final")
	t.Logf("answered %d %s (Retry-After %q); store_error counted %d; effects %d; key stored %v", s, auditCode(b), h.Get("Retry-After"),
		obs.get(idem.StateStoreError), n, found)
	if n != 0 || found {
		t.Errorf("%d effect row(s) committed, key stored %v; want nothing", n, found)
	}
	if s != 500 || auditCode(b) != "internal_error" || obs.get(idem.StateStoreError) != 0 {
		t.Errorf("a handler that ended its transaction and answered 404: %d %s, store_error %d; want 500 internal_error, "+
			"the handler's failure, not a failing store", s, auditCode(b), obs.get(idem.StateStoreError))
	}
}
