package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// A review of work in steps (D176) found what the tests below assert mended.

// TestTransactionalTakeoverIsToldTheSteps: a lease claim records a step and its holder dies; the
// same request claimed again with Begin and no lease takes the lease over in the same
// generation. Its Decision named no step (Begin sent idem_begin, not idem_begin_steps, for a
// claim without a lease), so a caller that trusts Decision.Steps did the step again. Begin
// reads the steps of every claim now.
func TestTransactionalTakeoverIsToldTheSteps(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 4)
	admin := pgtest.Connect(t, url)
	fp := idem.ComputeFingerprint("POST", "/payouts", []byte(`{"amount":5}`))
	c := idem.Claim{Principal: "alice", Key: "k1", Action: "POST /payouts", Fingerprint: fp.Sum, Lease: time.Minute}
	d, err := idem.Begin(ctx, pool, c)
	if err != nil || d.Outcome != idem.Claimed {
		t.Fatalf("lease claim: %+v %v", d, err)
	}
	if err := idem.RecordStep(ctx, pool, "alice", "k1", d.Attempt, "charge", json.RawMessage(`"ch_1"`)); err != nil {
		t.Fatal(err)
	}
	// The holder dies: its lease runs out (moved into the past rather than waited for).
	pgtest.Exec(t, admin, `UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second'`)

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	c.Lease = 0
	d2, err := idem.Begin(ctx, tx, c)
	if err != nil || d2.Outcome != idem.Claimed || d2.Attempt == d.Attempt || d2.ProviderKey != d.ProviderKey {
		t.Fatalf("the transactional takeover: %+v %v, want a claim of the same generation", d2, err)
	}
	if string(d2.Steps["charge"]) != `"ch_1"` || d2.RecoveryPoint != "charge" {
		t.Fatalf("a transactional takeover of the generation was told Steps %v and RecoveryPoint %q, want the recorded charge", d2.Steps, d2.RecoveryPoint)
	}
}

// TestDoDoesNotRedoTheStepsOfDoLease: Do of a job whose work DoLease began, recorded a step
// of and gave up, took the lease over and ran fn, all of it again: the step's writes twice.
// It is ErrMismatch now, fn does not run, and the claim rolls back: DoLease goes on after the
// step, and Do then replays DoLease's result.
func TestDoDoesNotRedoTheStepsOfDoLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	pgtest.Exec(t, pool, `CREATE TABLE rs_writes (step text)`)
	job := idem.Job{Principal: "alice", Key: "mixed", Action: "settle", Input: map[string]int{"amount": 5}, Lease: 5 * time.Second}
	fail := true
	work := func(ctx context.Context, c idem.LeaseClaim) (string, error) {
		ref, err := idem.Step(ctx, "reserve", func(ctx context.Context, tx pgx.Tx) (string, error) {
			_, err := tx.Exec(ctx, `INSERT INTO rs_writes VALUES ('reserve')`)
			return "r1", err
		})
		if err != nil || fail {
			return "", errors.Join(err, errors.New("the settle failed")) // DoLease yields the lease
		}
		return ref + "-settled", nil
	}
	if _, _, err := idem.DoLease(ctx, pool, job, work); err == nil {
		t.Fatal("the first DoLease succeeded; the test needs it to fail after its step")
	}
	ran := false
	_, _, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (string, error) {
		ran = true
		_, err := tx.Exec(ctx, `INSERT INTO rs_writes VALUES ('reserve')`)
		return "r1-settled", err
	})
	if !errors.Is(err, idem.ErrMismatch) || ran || !strings.Contains(err.Error(), "DoLease") {
		t.Fatalf("Do of a job whose DoLease recorded steps: %v (fn ran: %v), want ErrMismatch naming DoLease, fn not run", err, ran)
	}
	fail = false
	got, replayed, err := idem.DoLease(ctx, pool, job, work)
	if err != nil || replayed || got != "r1-settled" {
		t.Fatalf("DoLease after the refused Do: %q %v %v", got, replayed, err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM rs_writes`); n != 1 {
		t.Fatalf("the step's writes happened %d times, want 1", n)
	}
	if got, replayed, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) {
		t.Error("Do ran fn for a completed job")
		return "", nil
	}); err != nil || !replayed || got != "r1-settled" {
		t.Fatalf("Do after DoLease completed: %q %v %v, want its result replayed", got, replayed, err)
	}
}

// TestStepValueNotUTF8IsRefused: a step that returned a string with bytes that are not UTF-8
// (a provider's binary reference) was recorded as encoding/json writes it, with U+FFFD, so the
// attempt after a yield got another value than the first. It is ErrInvalidArgument now, as
// U+0000 is, and Do's Input of the same kind.
func TestStepValueNotUTF8IsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	job := idem.Job{Principal: "alice", Key: "bin-ref", Action: "pay", Lease: 5 * time.Second}
	_, _, err := idem.DoLease(ctx, pool, job, func(ctx context.Context, c idem.LeaseClaim) (string, error) {
		return idem.Step(ctx, "pay", func(context.Context, pgx.Tx) (string, error) { return "po_\xff\xfe\x01", nil })
	})
	if !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("a step's value with bytes that are not UTF-8: %v, want ErrInvalidArgument", err)
	}
	// U+FFFD in valid text is itself, and is saved.
	job.Key = "fffd"
	got, _, err := idem.DoLease(ctx, pool, job, func(ctx context.Context, c idem.LeaseClaim) (string, error) {
		return idem.Step(ctx, "pay", func(context.Context, pgx.Tx) (string, error) { return "po_\uFFFD", nil })
	})
	if err != nil || got != "po_\uFFFD" {
		t.Fatalf("a step's value with U+FFFD in valid text: %q %v", got, err)
	}
}

// TestEveryStepAfterTakeoverFails: once a Step found the claim taken over, a later Step of a
// name this attempt recorded before returned its saved value and nil, against Step's doc ("as
// does every Step after it").
func TestEveryStepAfterTakeoverFails(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 4)
	admin := pgtest.Connect(t, url)
	job := idem.Job{Principal: "alice", Key: "after-lost", Action: "pay", Lease: time.Minute}
	var second, again error
	_, _, _ = idem.DoLease(ctx, pool, job, func(ctx context.Context, c idem.LeaseClaim) (int, error) {
		if _, err := idem.Step(ctx, "a", func(context.Context, pgx.Tx) (int, error) { return 1, nil }); err != nil {
			return 0, err
		}
		// The lease runs out in the database and the same request, from another process,
		// takes the key over.
		pgtest.Exec(t, admin, `UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second'`)
		if d, err := idem.Begin(ctx, admin, reviewClaim(job)); err != nil || d.Outcome != idem.Claimed {
			t.Errorf("takeover: %+v %v", d, err)
		}
		_, second = idem.Step(ctx, "b", func(context.Context, pgx.Tx) (int, error) { return 2, nil })
		_, again = idem.Step(ctx, "a", func(context.Context, pgx.Tx) (int, error) { return 1, nil })
		return 0, second
	})
	if !errors.Is(second, idem.ErrClaimLost) || !errors.Is(second, idem.ErrLeaseLost) {
		t.Fatalf("the step that found the claim taken over: %v", second)
	}
	if !errors.Is(again, idem.ErrClaimLost) || !errors.Is(again, idem.ErrLeaseLost) {
		t.Fatalf("a Step after the claim was found taken over: %v, want ErrLeaseLost and ErrClaimLost", again)
	}
}

// TestStepValueLimitCountsJSONBText: the 8192 bytes of a generation's saved values are counted
// on jsonb's text of them all (a space after each comma and colon), as the docs now say; they
// said "as JSON text", and a value of 5,601 bytes of JSON was refused.
func TestStepValueLimitCountsJSONBText(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	step := func(key string, zeros int) error {
		job := idem.Job{Principal: "alice", Key: key, Action: "pay", Lease: time.Minute}
		_, _, err := idem.DoLease(ctx, pool, job, func(ctx context.Context, c idem.LeaseClaim) (int, error) {
			v, err := idem.Step(ctx, "batch", func(context.Context, pgx.Tx) ([]int, error) { return make([]int, zeros), nil })
			return len(v), err
		})
		return err
	}
	// {"batch": [0, 0, ...]}: 11 + zeros + 2 × (zeros - 1) + 2 bytes.
	if err := step("fits", 2700); err != nil { // 8,111 bytes
		t.Fatalf("2,700 zeros (8,111 bytes as jsonb writes them): %v", err)
	}
	if err := step("over", 2800); !errors.Is(err, idem.ErrInvalidArgument) || !strings.Contains(err.Error(), "8411") {
		t.Fatalf("2,800 zeros (5,601 bytes of JSON, 8,411 as jsonb writes them): %v, want ErrInvalidArgument naming 8411", err)
	}
}

// TestDoResultNotUTF8IsRefused: a Do or DoLease result holding a string that is not UTF-8 was
// stored as encoding/json writes it (each bad byte as \ufffd): the first call returned the
// bytes fn returned, every replay U+FFFD in their place. It is ErrInvalidArgument now (D178),
// as Input and a step's value are; Do's transaction rolls back and nothing is stored.
func TestDoResultNotUTF8IsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	pgtest.Exec(t, pool, `CREATE TABLE rs_do (n int)`)
	const ref = "po_\xff\xfe" // a provider's binary reference
	job := idem.Job{Principal: "alice", Key: "do-bin", Action: "pay"}
	_, _, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (string, error) {
		_, err := tx.Exec(ctx, `INSERT INTO rs_do VALUES (1)`)
		return ref, err
	})
	if !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("Do of a result that is not UTF-8: %v, want ErrInvalidArgument", err)
	}
	if n := pgtest.Count(t, pool, `SELECT (SELECT count(*) FROM rs_do) + (SELECT count(*) FROM idem.idempotency_keys)`); n != 0 {
		t.Fatalf("%d rows after the refused Do; want its work rolled back and no key", n)
	}
	lj := idem.Job{Principal: "alice", Key: "lease-bin", Action: "pay", Lease: 5 * time.Second}
	if _, _, err := idem.DoLease(ctx, pool, lj, func(context.Context, idem.LeaseClaim) (string, error) { return ref, nil }); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("DoLease of a result that is not UTF-8: %v, want ErrInvalidArgument", err)
	}
	// U+FFFD in valid text is itself, and replays as it was.
	job.Key = "do-fffd"
	first, _, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return "po_\uFFFD", nil })
	again, replayed, err2 := idem.Do(ctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return "", nil })
	if err != nil || err2 != nil || !replayed || again != first || first != "po_\uFFFD" {
		t.Fatalf("Do of U+FFFD in valid text: %q %v, replay %q %v %v", first, err, again, replayed, err2)
	}
}

// TestKeylessStepValueIsNotChecked: docs/http.md: "A request without a key on a lease route
// whose key is optional has no claim: its steps are plain transactions, with nothing to
// resume." Nothing of such a step is saved, so nothing can come back changed; D176's first
// build refused its value all the same (a binary reference: ErrInvalidArgument after fn ran,
// the writes rolled back, 500). The checks of a saved value apply to saved values only (D178).
func TestKeylessStepValueIsNotChecked(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	pgtest.Exec(t, pool, `CREATE TABLE rs_keyless (ref bytea)`)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true }})
	if err != nil {
		t.Fatal(err)
	}
	h := m.Route(idem.Route{Lease: 10 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ref, err := idem.Step(r.Context(), "pay", func(ctx context.Context, tx pgx.Tx) (string, error) {
			const ref = "po_\xff\xfe" // the provider's reference, binary
			_, err := tx.Exec(ctx, `INSERT INTO rs_keyless VALUES ($1)`, []byte(ref))
			return ref, err
		})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(ref))
	}))
	srv := httptest.NewServer(h)
	defer srv.Close()
	resp, err := http.Post(srv.URL+"/pay", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated || pgtest.Count(t, pool, `SELECT count(*) FROM rs_keyless`) != 1 {
		t.Fatalf("a keyless request's step (a plain transaction, nothing saved): %d %s", resp.StatusCode, body)
	}
}
