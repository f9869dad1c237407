package idem_test

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// Findings of a black-box review of the low-level API (Begin, Complete, PersistAnswer,
// RunTx, RecordStep), D271.

func llClaim(key string, lease time.Duration) idem.Claim {
	return idem.Claim{Principal: "alice", Key: key, Action: "POST /x", Fingerprint: sha256.Sum256([]byte("body-" + key)), Lease: lease}
}

// llLease claims a lease key on the pool (it commits on its own) and returns its decision.
func llLease(t *testing.T, pool *pgxpool.Pool, c idem.Claim) idem.Decision {
	t.Helper()
	var d idem.Decision
	err := idem.RunTx(context.Background(), pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		var err error
		d, err = tx.Claim(context.Background(), c)
		return err
	})
	if err != nil || d.Outcome != idem.Claimed {
		t.Fatalf("lease claim: %s %v", d.Outcome, err)
	}
	return d
}

// A Complete that returned ErrCommitUnknown (its context ended while the statement waited on
// the key's row, held here by a real row lock) and landed afterwards is this attempt's
// answer: PersistAnswer, called next as the docs advise, returns nil. Before, it recognised
// only a lost reply of its own tries, and said ErrClaimLost: the caller took a stored payment
// answer for lost.
func TestPersistAnswerAfterCompleteCommitUnknown(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 4)
	ctx := context.Background()
	c := llClaim("pacu", time.Minute)
	d := llLease(t, pool, c)
	r := idem.Response{Status: 201, Body: []byte("paid")}
	locker := pgtest.Connect(t, url)
	ltx, err := locker.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, ltx, `SELECT 1 FROM idem.idempotency_keys WHERE key = $1 FOR UPDATE`, c.Key)
	cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	err = idem.Complete(cctx, pool, c.Principal, c.Key, d.Attempt, r)
	cancel()
	if !errors.Is(err, idem.ErrCommitUnknown) {
		t.Fatalf("Complete behind a row lock with a 200 ms context: %v, want ErrCommitUnknown", err)
	}
	pgtest.WaitFor(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()`)
	if err := ltx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	// The abandoned Complete lands now (its lock timeout, 2 s, not reached): PersistAnswer's
	// own try then finds the claim completed. Had it failed, PersistAnswer's try would land
	// the answer itself, and the test would hold no gap open.
	pgtest.WaitFor(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'pacu' AND state = 'c'`)
	pctx, pcancel := context.WithTimeout(ctx, 10*time.Second)
	defer pcancel()
	if err := idem.PersistAnswer(pctx, pool, c, d.Attempt, r); err != nil {
		ks, _, _ := idem.ReadKey(ctx, pool, c.Principal, c.Key)
		t.Errorf("PersistAnswer after a Complete that landed (ErrCommitUnknown): %v; the key is %s with attempt %d (this attempt: %d)",
			err, ks.State, ks.Attempt, d.Attempt)
	}
}

// PersistAnswer after a Complete that succeeded is nil, also once the answer's TTL passed; a
// claim taken by a later generation, or released, is ErrClaimLost.
func TestPersistAnswerTellsThisAttemptsAnswer(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	ctx := context.Background()
	c := llClaim("pa", time.Minute)
	c.TTL = 200 * time.Millisecond
	d := llLease(t, pool, c)
	r := idem.Response{Status: 201, Body: []byte("x")}
	if err := idem.Complete(ctx, pool, c.Principal, c.Key, d.Attempt, r); err != nil {
		t.Fatal(err)
	}
	if err := idem.PersistAnswer(ctx, pool, c, d.Attempt, r); err != nil {
		t.Errorf("PersistAnswer after a Complete that landed: %v", err)
	}
	time.Sleep(400 * time.Millisecond)
	if err := idem.PersistAnswer(ctx, pool, c, d.Attempt, r); err != nil {
		t.Errorf("PersistAnswer after a Complete that landed, its TTL passed: %v", err)
	}
	c2 := c
	c2.Fingerprint = sha256.Sum256([]byte("other"))
	d2 := llLease(t, pool, c2)
	if err := idem.PersistAnswer(ctx, pool, c, d.Attempt, r); !errors.Is(err, idem.ErrClaimLost) {
		t.Errorf("PersistAnswer after the expired key was claimed by a new generation: %v, want ErrClaimLost", err)
	}
	if err := idem.PersistAnswer(ctx, pool, c2, d2.Attempt+1000, r); !errors.Is(err, idem.ErrClaimLost) {
		t.Errorf("PersistAnswer with another attempt: %v, want ErrClaimLost", err)
	}
	c3 := llClaim("pa-rel", time.Minute)
	d3 := llLease(t, pool, c3)
	if ok, err := idem.Release(ctx, pool, c3.Principal, c3.Key, d3.Attempt); !ok || err != nil {
		t.Fatal(ok, err)
	}
	if err := idem.PersistAnswer(ctx, pool, c3, d3.Attempt, r); !errors.Is(err, idem.ErrClaimLost) {
		t.Errorf("PersistAnswer of a released claim: %v, want ErrClaimLost", err)
	}
}

// CompleteOnCommit or FinalOnCommit with no Tx.Claim before it stored the answer nowhere and
// RunTx committed the work and returned nil: a retry ran it again. Now RunTx rolls back and
// returns ErrInvalidArgument.
func TestAnswerWithoutAClaimIsRefused(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 2)
	ctx := context.Background()
	pgtest.Exec(t, pool, `CREATE TABLE ll_work (id int)`)
	for _, final := range []bool{false, true} {
		err := idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO ll_work VALUES (1)`); err != nil {
				return err
			}
			if final {
				tx.FinalOnCommit(idem.Response{Status: 404})
			} else {
				tx.CompleteOnCommit(idem.Response{Status: 201, Body: []byte("paid")})
			}
			return nil
		})
		if !errors.Is(err, idem.ErrInvalidArgument) {
			t.Errorf("an answer (final %v) with no claim: RunTx returned %v, want ErrInvalidArgument", final, err)
		}
	}
	// before any statement too
	err := idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		tx.CompleteOnCommit(idem.Response{Status: 201})
		return nil
	})
	if !errors.Is(err, idem.ErrInvalidArgument) {
		t.Errorf("an answer with no claim and no statement: RunTx returned %v, want ErrInvalidArgument", err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM ll_work`); n != 0 {
		t.Errorf("%d rows of work committed without a claim to answer; want the transaction rolled back", n)
	}
	// and an answer given before the claim is still refused after it
	c := llClaim("late-claim", 0)
	err = idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		tx.CompleteOnCommit(idem.Response{Status: 201})
		_, err := tx.Claim(ctx, c)
		return err
	})
	if !errors.Is(err, idem.ErrInvalidArgument) {
		t.Errorf("an answer before the claim: RunTx returned %v, want ErrInvalidArgument", err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'late-claim'`); n != 0 {
		t.Errorf("%d key rows; want none (rolled back)", n)
	}
	// an answer after a Claim that failed names the claim's failure, which is what a retry
	// decides on: here the key held by another transaction past the claim's lock timeout
	held := llClaim("held", 0)
	locker, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = locker.Rollback(ctx) }()
	if _, err := idem.Begin(ctx, locker, held); err != nil {
		t.Fatal(err)
	}
	held.LockTimeout = 100 * time.Millisecond
	err = idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		_, _ = tx.Claim(ctx, held) // its error ignored
		tx.CompleteOnCommit(idem.Response{Status: 201})
		return nil
	})
	if !errors.Is(err, idem.ErrInProgress) || errors.Is(err, idem.ErrInvalidArgument) || !strings.Contains(err.Error(), "Tx.Claim that failed") {
		t.Errorf("an answer after a claim that failed on a held key: RunTx returned %v, want the claim's ErrInProgress, named", err)
	}
}

// A step's saved value that is not JSON is a caller's error, not a reason to retry.
func TestRecordStepNotJSONIsInvalidArgument(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 2)
	ctx := context.Background()
	c := llClaim("bj", time.Minute)
	d := llLease(t, pool, c)
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return idem.RecordStep(ctx, tx, c.Principal, c.Key, d.Attempt, "s", json.RawMessage(`{`))
	})
	if !errors.Is(err, idem.ErrInvalidArgument) {
		t.Errorf("RecordStep with the saved value `{`: %v, want ErrInvalidArgument", err)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return idem.RecordStep(ctx, tx, c.Principal, c.Key, d.Attempt, "s", json.RawMessage(`1e1000000`))
	})
	if !errors.Is(err, idem.ErrInvalidArgument) {
		t.Errorf("RecordStep with the saved value 1e1000000 (JSON, past numeric's range): %v, want ErrInvalidArgument", err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return idem.RecordStep(ctx, tx, c.Principal, c.Key, d.Attempt, "s", json.RawMessage(`{"a":1}`))
	}); err != nil {
		t.Errorf("RecordStep with valid JSON after the refused one: %v", err)
	}
}

// A line feed in a header line is stored as a space, as net/http sends it (documented on
// Response.Header); several lines and bytes that are not UTF-8 come back as they were.
func TestResponseHeaderLineFeedIsASpace(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 2)
	ctx := context.Background()
	c := llClaim("hdr", time.Minute)
	d := llLease(t, pool, c)
	h := http.Header{"X-Lf": {"a\nb", "c\rd"}, "Set-Cookie": {"a=1", "b=2"}, "Etag": {"\"v\xe9\""}}
	if err := idem.Complete(ctx, pool, c.Principal, c.Key, d.Attempt, idem.Response{Status: 200, Header: h, Body: []byte("b")}); err != nil {
		t.Fatal(err)
	}
	r, err := idem.Begin(ctx, pool, c)
	if err != nil || r.Outcome != idem.Replay {
		t.Fatalf("replay: %s %v", r.Outcome, err)
	}
	want := http.Header{"X-Lf": {"a b", "c d"}, "Set-Cookie": {"a=1", "b=2"}, "Etag": {"\"v\xe9\""}}
	for name, lines := range want {
		got := r.Response.Header.Values(name)
		if len(got) != len(lines) || (len(got) > 0 && (got[0] != lines[0] || got[len(got)-1] != lines[len(lines)-1])) {
			t.Errorf("%s: replayed %q, want %q", name, got, lines)
		}
	}
}
