package idemriver_test

// A review of idemriver and of work in steps under it: each test asserts a documented
// promise. The first four (the kind River takes, fn's own error, a step's value with U+0000, a
// step's name) failed before D157; the others record what was checked.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemriver"
)

// TestReviewRiverKindRiverAcceptsIsAnInvalidKey: River accepts a job kind that matches
// `\A[\w][\w\-\[\]<>\/.·:+]+\z`, the middle dot U+00B7 included (river.NewClient validates
// kinds against it). Work's default key is "kind/id", which idem refuses for any byte outside
// visible ASCII: every run of such a job fails with ErrInvalidArgument before fn runs, River
// retries it to MaxAttempts and discards it. Promised: Options.Key "Default nil: the job's kind
// and id ... the same for every run and retry of the job and different for every other job";
// Work runs fn "at most once in effect", and its error list has no such case.
func TestReviewRiverKindRiverAcceptsIsAnInvalidKey(t *testing.T) {
	pool := newPool(t)
	client := newClient(t, pool, nil)
	job := jobRow(t, client, ReceiptArgs{Order: 1})
	job.Kind = "mail·receipt" // a kind River's own regex accepts
	ran := 0
	err := idemriver.Work(context.Background(), job, idemriver.Options{DB: pool, Lease: time.Second},
		func(context.Context, idem.LeaseClaim) error { ran++; return nil })
	if err != nil || ran != 1 {
		t.Fatalf("a job of River-valid kind %q: Work returned %v, fn ran %d times; want it run once (err nil)", job.Kind, err, ran)
	}
}

// dotArgs is a job whose kind has a middle dot: River's client accepts it.
type dotArgs struct{}

func (dotArgs) Kind() string { return "mail·receipt" }

type dotWorker struct {
	river.WorkerDefaults[dotArgs]
}

func (dotWorker) Work(context.Context, *river.Job[dotArgs]) error { return nil }

// TestReviewRiverRiverAcceptsTheKind shows that the kind of the finding above is one that
// River's client accepts (no SkipJobKindValidation).
func TestReviewRiverRiverAcceptsTheKind(t *testing.T) {
	pool := newPool(t)
	workers := river.NewWorkers()
	river.AddWorker(workers, dotWorker{})
	if _, err := river.NewClient(riverpgxv5.New(pool), &river.Config{Logger: quietLog, Workers: workers,
		Queues: map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 1}}}); err != nil {
		t.Fatalf("River refused the kind: %v", err)
	}
}

// TestReviewRiverFnErrorIsRetriedNotSnoozedOrCancelled: Work's doc: "fn's error when fn
// failed: the lease is given up at once and River retries the job by its retry policy". Work
// matches idem's sentinels anywhere in the chain, so an fn whose own failure wraps one (an
// inner idem.Do of fn's recording, keyed by claim.ProviderKey as the doc advises, that met a
// mismatch or a held key) is snoozed forever (never spending an attempt, never discarded) or
// cancelled (the work abandoned) instead of retried.
func TestReviewRiverFnErrorIsRetriedNotSnoozedOrCancelled(t *testing.T) {
	pool := newPool(t)
	client := newClient(t, pool, nil)
	opts := idemriver.Options{DB: pool, Lease: time.Second}
	var failures []string
	for _, inner := range []error{idem.ErrInProgress, idem.ErrMismatch} {
		job := jobRow(t, client, ReceiptArgs{Order: 3})
		fnErr := fmt.Errorf("record the charge (inner idem.Do): %w", inner)
		err := idemriver.Work(context.Background(), job, opts, func(context.Context, idem.LeaseClaim) error { return fnErr })
		var snooze *river.JobSnoozeError
		var cancel *river.JobCancelError
		if errors.As(err, &snooze) || errors.As(err, &cancel) || !errors.Is(err, fnErr) {
			failures = append(failures, fmt.Sprintf("fn failed with %q: Work returned %T %v (snooze %v, cancel %v); want fn's error for River's retry policy",
				fnErr, err, err, snooze != nil, cancel != nil))
		}
	}
	if len(failures) > 0 {
		t.Fatal(strings.Join(failures, "\n"))
	}
}

// TestReviewRiverStepSavedValueJSONCannotStore: Step's doc: "fn's value is saved as
// JSON". A Go string holding a NUL byte encodes as the valid JSON "\u0000", which jsonb refuses:
// the step can never be recorded, its writes roll back each time, and every retry runs fn (and
// any outside call in it) again. It was PostgreSQL's 22P05 from the recording; it is now
// ErrInvalidArgument naming the cause (documented with Step), before anything is sent.
func TestReviewRiverStepSavedValueJSONCannotStore(t *testing.T) {
	pool := newPool(t)
	client := newClient(t, pool, nil)
	job := jobRow(t, client, ReceiptArgs{Order: 4})
	var runs atomic.Int32
	err := idemriver.Work(context.Background(), job, idemriver.Options{DB: pool, Lease: time.Second},
		func(ctx context.Context, _ idem.LeaseClaim) error {
			_, err := idem.Step(ctx, "ref", func(ctx context.Context, tx pgx.Tx) (string, error) {
				runs.Add(1)
				return "ref\x00from-provider", nil // a provider's reference, as it came
			})
			return err
		})
	if !errors.Is(err, idem.ErrInvalidArgument) || !strings.Contains(err.Error(), "U+0000") || runs.Load() != 1 {
		t.Fatalf("a step whose saved value is the JSON string \"ref\\u0000from-provider\": %v (fn ran %d times); want ErrInvalidArgument naming U+0000, fn once", err, runs.Load())
	}
}

// TestReviewRiverStepNameCheckedAfterFn: idem_step refuses a name over 255 characters
// (22023), but Step checks the name only after fn ran: fn's outside call is made, its writes
// roll back, and every retry makes the call again without ever recording the step (a step
// "runs once per generation" only if it can be recorded). Promised: Step "runs fn once per
// generation"; the name rule (1 to 255 characters) is docs/sql-api.md's.
func TestReviewRiverStepNameCheckedAfterFn(t *testing.T) {
	pool := newPool(t)
	client := newClient(t, pool, nil)
	job := jobRow(t, client, ReceiptArgs{Order: 5})
	var calls atomic.Int32
	name := strings.Repeat("s", 256)
	for range 2 { // the run and River's retry
		_ = idemriver.Work(context.Background(), job, idemriver.Options{DB: pool, Lease: time.Second},
			func(ctx context.Context, _ idem.LeaseClaim) error {
				_, err := idem.Step(ctx, name, func(ctx context.Context, tx pgx.Tx) (int, error) {
					calls.Add(1) // the outside call of the step
					return 1, nil
				})
				return err
			})
	}
	if n := calls.Load(); n != 0 {
		t.Fatalf("a step with a 256-character name: its fn ran %d times and was never recorded; want the name refused before fn runs", n)
	}
}

// TestReviewRiverKilledBetweenStepsResumes: a run does step a, then hangs (its worker is
// as good as dead: its context ends, River's timeout, and its heartbeat with it). After its
// lease runs out, River's next run takes the key over: it is told the recovery point, skips
// step a (its saved value comes back), does b, under the same provider key; the hung run that
// wakes up records nothing, its step b is refused.
func TestReviewRiverKilledBetweenStepsResumes(t *testing.T) {
	pool := newPool(t)
	pgExec(t, pool, `CREATE TABLE effects (step text)`)
	client := newClient(t, pool, nil)
	job := jobRow(t, client, ReceiptArgs{Order: 6})
	opts := idemriver.Options{DB: pool, Lease: time.Second}
	step := func(ctx context.Context, name string) (string, error) {
		return idem.Step(ctx, name, func(ctx context.Context, tx pgx.Tx) (string, error) {
			_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, name)
			return name + "-saved", err
		})
	}
	hung, die := context.WithCancel(context.Background())
	afterA, wake := make(chan string, 1), make(chan struct{})
	first := make(chan error, 1)
	go func() {
		first <- idemriver.Work(hung, job, opts, func(ctx context.Context, c idem.LeaseClaim) error {
			if _, err := step(ctx, "a"); err != nil {
				return err
			}
			afterA <- c.ProviderKey
			<-wake
			_, err := step(context.WithoutCancel(ctx), "b") // hung work, ignoring its context
			return err
		})
	}()
	pk1 := <-afterA
	die()
	second := *job
	second.Attempt, second.AttemptedBy = 2, []string{"w1", "w2"}
	var got struct{ rp, pk, a string }
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		err := idemriver.Work(context.Background(), &second, opts, func(ctx context.Context, c idem.LeaseClaim) error {
			got.rp, got.pk = c.RecoveryPoint, c.ProviderKey
			a, err := step(ctx, "a")
			if err != nil {
				return err
			}
			got.a = a
			_, err = step(ctx, "b")
			return err
		})
		if err == nil {
			break
		}
		var snooze *river.JobSnoozeError
		if !errors.As(err, &snooze) || time.Now().After(deadline) {
			t.Fatalf("the takeover: %v", err)
		}
	}
	if got.rp != "a" || got.pk != pk1 || got.a != "a-saved" {
		t.Fatalf("the takeover saw recovery point %q, provider key same %v, a's value %q", got.rp, got.pk == pk1, got.a)
	}
	close(wake)
	if err := <-first; err == nil {
		t.Fatal("the hung run's late work was accepted")
	}
	if n := count(t, pool, `SELECT count(*) FROM effects`); n != 2 {
		t.Fatalf("%d effects, want a and b once each", n)
	}
}

// TestReviewRiverDuplicateInTheAnswerGap: a second connection holds the key's row lock
// (FOR UPDATE) from before the work ends until after a duplicate run came: the first run's
// answer waits on the lock (its lease still runs in the database), the duplicate run sees the
// key in progress and snoozes without running. Once the lock goes, the answer lands, and the
// duplicate's next run completes without running fn.
func TestReviewRiverDuplicateInTheAnswerGap(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	client := newClient(t, pool, nil)
	job := jobRow(t, client, ReceiptArgs{Order: 7})
	key := idemriver.KeyOf(job)
	opts := idemriver.Options{DB: pool, Lease: 4 * time.Second}
	var runs atomic.Int32
	locker, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Release()
	ltx, err := locker.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	var firstErr error
	go func() {
		defer wg.Done()
		firstErr = idemriver.Work(ctx, job, opts, func(ctx context.Context, _ idem.LeaseClaim) error {
			runs.Add(1)
			if _, err := ltx.Exec(ctx, `SELECT 1 FROM idem.idempotency_keys WHERE principal_id = 'river' AND key = $1 FOR UPDATE`, key); err != nil {
				return err
			}
			return nil
		})
	}()
	// Wait until the first run's answer waits on the row lock.
	waitFor(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%idem_complete%'`)
	dup := *job
	dup.Attempt, dup.AttemptedBy = 2, []string{"w1", "w2"}
	err = idemriver.Work(ctx, &dup, opts, func(context.Context, idem.LeaseClaim) error { runs.Add(1); return nil })
	var snooze *river.JobSnoozeError
	if !errors.As(err, &snooze) || runs.Load() != 1 {
		t.Fatalf("a duplicate while the answer waits on the row: %v, runs %d; want a snooze", err, runs.Load())
	}
	if err := ltx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if firstErr != nil {
		t.Fatalf("the first run: %v", firstErr)
	}
	if err := idemriver.Work(ctx, &dup, opts, func(context.Context, idem.LeaseClaim) error { runs.Add(1); return nil }); err != nil || runs.Load() != 1 {
		t.Fatalf("the duplicate after the answer: %v, runs %d", err, runs.Load())
	}
}

// TestReviewRiverRetriedAfterTheKeyExpired: a job whose first run failed (lease yielded)
// is retried by River after its key expired: Work cancels it with ErrKeyExpired, fn does not
// run under a new provider key.
func TestReviewRiverRetriedAfterTheKeyExpired(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	client := newClient(t, pool, nil)
	job := jobRow(t, client, ReceiptArgs{Order: 8})
	opts := idemriver.Options{DB: pool, Lease: time.Second, TTL: 2 * time.Second}
	var keys []string
	boom := errors.New("boom")
	if err := idemriver.Work(ctx, job, opts, func(_ context.Context, c idem.LeaseClaim) error {
		keys = append(keys, c.ProviderKey)
		return boom
	}); !errors.Is(err, boom) {
		t.Fatal(err)
	}
	waitFor(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = $1 AND expires_at < clock_timestamp()`, idemriver.KeyOf(job))
	retry := *job
	retry.Attempt = 2
	err := idemriver.Work(ctx, &retry, opts, func(_ context.Context, c idem.LeaseClaim) error {
		keys = append(keys, c.ProviderKey)
		return nil
	})
	var cancel *river.JobCancelError
	if !errors.As(err, &cancel) || !errors.Is(err, idemriver.ErrKeyExpired) || len(keys) != 1 {
		t.Fatalf("a retry after the key expired: %v, provider keys %q; want ErrKeyExpired and no run", err, keys)
	}
}

// TestReviewRiverArgsChangedBetweenRetries: a job's arguments changed between its runs
// (an UPDATE of river_job by hand): the retry is cancelled with ErrMismatch, fn does not run
// with other arguments under the first run's provider key.
func TestReviewRiverArgsChangedBetweenRetries(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	client := newClient(t, pool, nil)
	job := jobRow(t, client, ReceiptArgs{Order: 9})
	opts := idemriver.Options{DB: pool, Lease: time.Second}
	boom := errors.New("boom")
	runs := 0
	if err := idemriver.Work(ctx, job, opts, func(context.Context, idem.LeaseClaim) error { runs++; return boom }); !errors.Is(err, boom) {
		t.Fatal(err)
	}
	retry := *job
	retry.Attempt = 2
	retry.EncodedArgs = []byte(`{"order": 10}`)
	err := idemriver.Work(ctx, &retry, opts, func(context.Context, idem.LeaseClaim) error { runs++; return nil })
	var cancel *river.JobCancelError
	if !errors.As(err, &cancel) || !errors.Is(err, idem.ErrMismatch) || runs != 1 {
		t.Fatalf("changed args: %v, runs %d", err, runs)
	}
	// The same arguments, written otherwise (spaces, order of members): the same input.
	retry.EncodedArgs = []byte(` { "order" : 9 } `)
	if err := idemriver.Work(ctx, &retry, opts, func(context.Context, idem.LeaseClaim) error { runs++; return nil }); err != nil || runs != 2 {
		t.Fatalf("the same args re-encoded: %v, runs %d", err, runs)
	}
}

// countWorker counts its runs under the middleware.
type countWorker struct {
	river.WorkerDefaults[ReceiptArgs]
	runs atomic.Int32
}

func (w *countWorker) Work(ctx context.Context, job *river.Job[ReceiptArgs]) error {
	if _, ok := idemriver.ClaimOf(ctx); !ok {
		return errors.New("no claim")
	}
	w.runs.Add(1)
	return nil
}

// TestReviewRiverRealRiverSnoozesWhileHeld: with a real River client, a job whose key
// another run holds (a run of the same job still at work elsewhere, its heartbeat extending the
// lease) is snoozed without running and without spending an attempt; once the other run
// stored its result, River's next run completes the job without running the worker.
func TestReviewRiverRealRiverSnoozesWhileHeld(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	inserter := newClient(t, pool, nil)
	job := jobRow(t, inserter, ReceiptArgs{Order: 11})
	opts := idemriver.Options{DB: pool, Lease: time.Second}
	held, release := make(chan struct{}), make(chan struct{})
	other := make(chan error, 1)
	go func() {
		other <- idemriver.Work(ctx, job, opts, func(context.Context, idem.LeaseClaim) error {
			close(held)
			<-release
			return nil
		})
	}()
	<-held
	w := &countWorker{}
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	newClient(t, pool, workers, idemriver.Middleware(opts))
	waitFor(t, pool, `SELECT count(*) FROM river_job WHERE id = $1 AND (metadata->>'snoozes')::int >= 1`, job.ID)
	if n := w.runs.Load(); n != 0 {
		t.Fatalf("the worker ran %d times while another run held the key", n)
	}
	close(release)
	if err := <-other; err != nil {
		t.Fatal(err)
	}
	waitFor(t, pool, `SELECT count(*) FROM river_job WHERE id = $1 AND state = 'completed'`, job.ID)
	if n := w.runs.Load(); n != 0 {
		t.Fatalf("the worker ran %d times after the other run's result was stored", n)
	}
	if n := count(t, pool, `SELECT attempt FROM river_job WHERE id = $1`, job.ID); n != 1 {
		t.Fatalf("attempt %d, want 1 (snoozes spend none)", n)
	}
}

// TestKeyOfIsAKeyForEveryKind: the default key of a kind of visible ASCII is as it was; any
// other byte is %XX; a kind too long for a key is cut and ends with a hash of the whole, so two
// long kinds still get two keys.
func TestKeyOfIsAKeyForEveryKind(t *testing.T) {
	for kind, want := range map[string]string{
		"receipt":      "receipt/42",
		"mail·receipt": "mail%C2%B7receipt/42",
		"a b%c":        "a%20b%25c/42",
	} {
		if got := idemriver.KeyOf(&rivertype.JobRow{Kind: kind, ID: 42}); got != want {
			t.Errorf("KeyOf(%q) = %q, want %q", kind, got, want)
		}
	}
	long1 := idemriver.KeyOf(&rivertype.JobRow{Kind: strings.Repeat("k", 300), ID: 9223372036854775807})
	long2 := idemriver.KeyOf(&rivertype.JobRow{Kind: strings.Repeat("k", 301), ID: 9223372036854775807})
	if len(long1) > 255 || len(long2) > 255 || long1 == long2 || !strings.HasSuffix(long1, "/9223372036854775807") {
		t.Errorf("long kinds: %q (%d) and %q (%d)", long1, len(long1), long2, len(long2))
	}
}

// TestJobOfAnUnknownPrincipalIsCancelled: a key table with the application's foreign key to its
// principals refuses the claim of a job whose principal was deleted after the job was
// enqueued; every retry would be refused alike, so Work cancels the job without running fn
// (it was retried by River's policy until River gave up).
func TestJobOfAnUnknownPrincipalIsCancelled(t *testing.T) {
	pool := newPool(t)
	pgExec(t, pool, `CREATE TABLE customers (id text PRIMARY KEY)`)
	pgExec(t, pool, `ALTER TABLE idem.idempotency_keys ADD FOREIGN KEY (principal_id) REFERENCES customers (id)`)
	client := newClient(t, pool, nil)
	job := jobRow(t, client, ReceiptArgs{Order: 11})
	var runs atomic.Int32
	err := idemriver.Work(context.Background(), job, idemriver.Options{DB: pool, Lease: time.Second,
		PrincipalOf: func(*rivertype.JobRow) string { return "gone" }},
		func(context.Context, idem.LeaseClaim) error { runs.Add(1); return nil })
	var cancel *rivertype.JobCancelError
	if !errors.As(err, &cancel) || !errors.Is(err, idem.ErrUnknownPrincipal) || runs.Load() != 0 {
		t.Fatalf("a job of a principal the key table's foreign key does not know: %T %v (fn ran %d times); want river.JobCancel of ErrUnknownPrincipal", err, err, runs.Load())
	}
}
