package idem_test

// Review of the result types of Do and DoLease: how a result is stored and replayed.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// effectCounter makes a table of effects and returns a function that counts its rows for a key.
func effectCounter(t *testing.T, pool *pgxpool.Pool) func(key string) int {
	t.Helper()
	pgtest.Exec(t, pool, `CREATE TABLE IF NOT EXISTS rv_effects (id bigserial PRIMARY KEY, k text NOT NULL)`)
	return func(key string) int {
		return pgtest.Count(t, pool, `SELECT count(*) FROM rv_effects WHERE k = $1`, key)
	}
}

func insertEffect(ctx context.Context, tx pgx.Tx, key string) error {
	_, err := tx.Exec(ctx, `INSERT INTO rv_effects (k) VALUES ($1)`, key)
	return err
}

// A result whose JSON encodes but does not decode into its own type.
type oneWay struct{ V int }

func (z oneWay) MarshalJSON() ([]byte, error) { return []byte(fmt.Sprintf(`"v=%d"`, z.V)), nil }
func (z *oneWay) UnmarshalJSON([]byte) error  { return errors.New("oneWay cannot be decoded") }

// A realistic result that encodes but cannot decode: an error held in an interface field.
type outcomeWithError struct {
	ID      int   `json:"id"`
	Warning error `json:"warning"`
}

// TestDoResultThatDoesNotDecodeIsRefused: a result that encoded but could not be decoded into
// T (a type whose UnmarshalJSON refuses its JSON; an error in an interface field) was
// committed with the effect, and every repeat failed with a bare json error until the key's
// TTL: the work was done, its answer never given again. Such a result is ErrInvalidArgument
// before anything commits; the key stays free, and a Do with a result that round-trips does the
// work once.
func TestDoResultThatDoesNotDecodeIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	count := effectCounter(t, pool)
	refused := func(t *testing.T, key string, err error) {
		t.Helper()
		if !errors.Is(err, idem.ErrInvalidArgument) || count(key) != 0 {
			t.Fatalf("%s: %v, %d effects; want ErrInvalidArgument and nothing committed", key, err, count(key))
		}
		v, replayed, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: key, Action: "a"}, idem.TxOptions{},
			func(ctx context.Context, tx pgx.Tx) (int, error) { return 7, insertEffect(ctx, tx, key) })
		if err != nil || replayed || v != 7 || count(key) != 1 {
			t.Fatalf("%s: the Do after the refusal: %d %v %v, %d effects; want the work done once", key, v, replayed, err, count(key))
		}
	}
	t.Run("UnmarshalJSON fails", func(t *testing.T) {
		_, _, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: "oneway", Action: "a"}, idem.TxOptions{},
			func(ctx context.Context, tx pgx.Tx) (oneWay, error) {
				return oneWay{7}, insertEffect(ctx, tx, "oneway")
			})
		refused(t, "oneway", err)
	})
	t.Run("error in an interface field", func(t *testing.T) {
		_, _, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: "warn", Action: "a"}, idem.TxOptions{},
			func(ctx context.Context, tx pgx.Tx) (outcomeWithError, error) {
				return outcomeWithError{ID: 1, Warning: errors.New("stock low")}, insertEffect(ctx, tx, "warn")
			})
		refused(t, "warn", err)
	})
	t.Run("unexported fields", func(t *testing.T) {
		type receipt struct{ id, amount int64 } // JSON writes {}
		_, _, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: "lossy", Action: "a"}, idem.TxOptions{},
			func(ctx context.Context, tx pgx.Tx) (receipt, error) {
				return receipt{41, 700}, insertEffect(ctx, tx, "lossy")
			})
		refused(t, "lossy", err)
	})
	t.Run("a 64-bit integer in an interface", func(t *testing.T) {
		// The repeat decoded it as a float64: another id (a snowflake id loses its last digits).
		_, _, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: "lossy-any", Action: "a"}, idem.TxOptions{},
			func(ctx context.Context, tx pgx.Tx) (map[string]any, error) {
				return map[string]any{"order_id": int64(1234567890123456789)}, insertEffect(ctx, tx, "lossy-any")
			})
		refused(t, "lossy-any", err)
	})
}

// TestDoResultThatRoundTripsIsKept: what the round-trip check must let through: a map in an
// interface (its members come back in another order), small integers in an interface (they
// come back as float64 of the same value), a time (its zone as an offset), a RawMessage.
func TestDoResultThatRoundTripsIsKept(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	type order struct {
		B, A int
		At   time.Time
	}
	at := time.Date(2026, 12, 5, 10, 0, 0, 123456789, time.FixedZone("CET", 3600))
	for i, v := range []any{
		map[string]any{"z": 1, "a": []any{int64(2), "x"}, "m": map[string]int{"y": 1, "b": 2}},
		order{B: 1, A: 2, At: at},
		json.RawMessage(`{"b": 1, "a": 2}`),
		struct{}{},
	} {
		job := idem.Job{Principal: "alice", Key: fmt.Sprintf("keep-%d", i), Action: "a"}
		if _, _, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (any, error) { return v, nil }); err != nil {
			t.Errorf("%T: %v; want it stored", v, err)
			continue
		}
		if _, replayed, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (any, error) { return nil, nil }); err != nil || !replayed {
			t.Errorf("%T: the repeat: %v %v", v, replayed, err)
		}
	}
}

type badMarshal struct{}

func (badMarshal) MarshalJSON() ([]byte, error) { return nil, errors.New("boom") }

type panicMarshal struct{}

func (panicMarshal) MarshalJSON() ([]byte, error) { panic("marshal panics") }

type cycleOf struct{ Next *cycleOf }

// TestDoResultThatCannotEncode: a result JSON cannot encode must roll the work back and leave
// the key claimable, with an error; and, like a non-UTF-8 string ("not a reason to retry"),
// be ErrInvalidArgument.
func TestDoResultThatCannotEncode(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	count := effectCounter(t, pool)
	cyc := &cycleOf{}
	cyc.Next = cyc
	cases := []struct {
		name string
		v    any
	}{
		{"chan", make(chan int)},
		{"func", func() {}},
		{"NaN", math.NaN()},
		{"+Inf", math.Inf(1)},
		{"map with struct keys", map[struct{ A int }]int{{1}: 1}},
		{"MarshalJSON error", badMarshal{}},
		{"cyclic pointer", cyc},
		{"invalid RawMessage", json.RawMessage(`{"a":`)},
	}
	for i, c := range cases {
		key := fmt.Sprintf("enc-%d", i)
		job := idem.Job{Principal: "alice", Key: key, Action: "a"}
		_, _, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (any, error) {
			return c.v, insertEffect(ctx, tx, key)
		})
		if err == nil || count(key) != 0 {
			t.Errorf("%s: err %v, effects %d: want an error and no effect", c.name, err, count(key))
			continue
		}
		if !errors.Is(err, idem.ErrInvalidArgument) {
			t.Errorf("%s: %v: not ErrInvalidArgument (a non-UTF-8 result is; a retry cannot help either)", c.name, err)
		}
		// The key is claimable: a good run now runs fn and commits.
		v, replayed, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (any, error) {
			return "ok", insertEffect(ctx, tx, key)
		})
		if err != nil || replayed || v != "ok" || count(key) != 1 {
			t.Errorf("%s: the run after: %v %v %v, effects %d", c.name, v, replayed, err, count(key))
		}
	}
	// A panic in MarshalJSON: rolled back, the key claimable, the Gate's flight released.
	func() {
		defer func() { _ = recover() }()
		_, _, _ = idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: "enc-panic", Action: "a"}, idem.TxOptions{},
			func(ctx context.Context, tx pgx.Tx) (panicMarshal, error) {
				return panicMarshal{}, insertEffect(ctx, tx, "enc-panic")
			})
	}()
	start := time.Now()
	v, _, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: "enc-panic", Action: "a"}, idem.TxOptions{},
		func(ctx context.Context, tx pgx.Tx) (string, error) { return "ok", insertEffect(ctx, tx, "enc-panic") })
	if err != nil || v != "ok" || count("enc-panic") != 1 || time.Since(start) > time.Second {
		t.Errorf("after a MarshalJSON panic: %q %v, effects %d, took %s", v, err, count("enc-panic"), time.Since(start))
	}
}

// TestDoLeaseResultMarshalPanicGivesTheKeyUp: "When fn panics, the heartbeat stops and the
// claim is given up before the panic goes on to the caller." A panic of the result's
// MarshalJSON (after fn returned) stopped the heartbeat but did not give the claim up: the key
// stayed in progress for the whole lease, every retry got ErrInProgress. It is given up as
// fn's own panic is.
func TestDoLeaseResultMarshalPanicGivesTheKeyUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	job := idem.Job{Principal: "alice", Key: "lease-panic", Action: "a", Lease: 30 * time.Second}
	var runs atomic.Int32
	func() {
		defer func() { t.Logf("recovered: %v", recover()) }()
		_, _, _ = idem.DoLease(ctx, pool, job, func(context.Context, idem.LeaseClaim) (panicMarshal, error) {
			runs.Add(1)
			return panicMarshal{}, nil
		})
	}()
	v, _, err := idem.DoLease(ctx, pool, job, func(context.Context, idem.LeaseClaim) (panicMarshal, error) {
		runs.Add(1)
		return panicMarshal{}, errors.New("the retry ran")
	})
	if runs.Load() != 2 {
		t.Errorf("the retry after a panic: %v %v, fn ran %d times: the claim was not given up (want the retry to run fn at once)", v, err, runs.Load())
	}
	// And a result that cannot be encoded (no panic): given up, the retry runs at once.
	job2 := idem.Job{Principal: "alice", Key: "lease-nan", Action: "a", Lease: 30 * time.Second}
	_, _, err = idem.DoLease(ctx, pool, job2, func(context.Context, idem.LeaseClaim) (float64, error) { return math.NaN(), nil })
	if err == nil {
		t.Fatal("NaN result: no error")
	}
	if !errors.Is(err, idem.ErrInvalidArgument) {
		t.Errorf("DoLease NaN result: %v: not ErrInvalidArgument", err)
	}
	var ran bool
	_, _, err = idem.DoLease(ctx, pool, job2, func(context.Context, idem.LeaseClaim) (float64, error) { ran = true; return 1, nil })
	if err != nil || !ran {
		t.Errorf("the retry after an unencodable result: %v ran=%v", err, ran)
	}
}

// TestDoResultRoundTrips: types that should replay as they were.
func TestDoResultRoundTrips(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	do := func(key string, v any) (any, any, bool, error) {
		job := idem.Job{Principal: "alice", Key: key, Action: "a"}
		switch x := v.(type) {
		case time.Time:
			fn := func(context.Context, pgx.Tx) (time.Time, error) { return x, nil }
			a, _, _ := idem.Do(ctx, pool, job, idem.TxOptions{}, fn)
			b, r, err := idem.Do(ctx, pool, job, idem.TxOptions{}, fn)
			return a, b, r, err
		case []byte:
			fn := func(context.Context, pgx.Tx) ([]byte, error) { return x, nil }
			a, _, _ := idem.Do(ctx, pool, job, idem.TxOptions{}, fn)
			b, r, err := idem.Do(ctx, pool, job, idem.TxOptions{}, fn)
			return string(a), string(b), r, err
		case json.RawMessage:
			fn := func(context.Context, pgx.Tx) (json.RawMessage, error) { return x, nil }
			a, _, _ := idem.Do(ctx, pool, job, idem.TxOptions{}, fn)
			b, r, err := idem.Do(ctx, pool, job, idem.TxOptions{}, fn)
			return string(a), string(b), r, err
		case string:
			fn := func(context.Context, pgx.Tx) (string, error) { return x, nil }
			a, _, _ := idem.Do(ctx, pool, job, idem.TxOptions{}, fn)
			b, r, err := idem.Do(ctx, pool, job, idem.TxOptions{}, fn)
			return a, b, r, err
		}
		fn := func(context.Context, pgx.Tx) (any, error) { return v, nil }
		a, _, _ := idem.Do(ctx, pool, job, idem.TxOptions{}, fn)
		b, r, err := idem.Do(ctx, pool, job, idem.TxOptions{}, fn)
		return a, b, r, err
	}
	paris, err := time.LoadLocation("Europe/Paris")
	if err != nil {
		paris = time.FixedZone("CET", 3600)
	}
	tm := time.Date(2024, 3, 1, 12, 0, 0, 123456789, paris)
	a, b, r, err := do("time", tm)
	if err != nil || !r || !a.(time.Time).Equal(b.(time.Time)) {
		t.Errorf("time: %v vs %v (%v %v)", a, b, r, err)
	}
	t.Logf("time: first %v (%s), replay %v (%s)", a, a.(time.Time).Location(), b, b.(time.Time).Location())
	a, b, r, err = do("bytes", []byte{0, 1, 2, 0xff, 0xfe})
	if err != nil || !r || a != b {
		t.Errorf("bytes: %q vs %q (%v %v)", a, b, r, err)
	}
	a, b, r, err = do("nul", "a\x00b")
	if err != nil || !r || a != b {
		t.Errorf("NUL string: %q vs %q (%v %v)", a, b, r, err)
	}
	a, b, r, err = do("raw", json.RawMessage(`{"b": 1, "a": [1, 2]}`))
	t.Logf("RawMessage: first %s, replay %s (%v %v)", a, b, r, err)
	a, b, r, err = do("any-int", int64(1)<<53+1)
	t.Logf("any int64 2^53+1: first %v (%T), replay %v (%T) (%v %v)", a, a, b, b, r, err)
}

// TestDoHugeResult: a 20 MB result is stored and replayed. The server prepares a replay before
// its first byte leaves, and the claim's reply bound waits for that byte at most its lock
// timeout and 5 s (D228): 50 MB took 0.8 s of idem_begin idle, and passed 5 s in a CI run
// with the race detector and other packages' tests beside it.
func TestDoHugeResult(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	big := strings.Repeat("x", 20<<20)
	job := idem.Job{Principal: "alice", Key: "huge", Action: "a"}
	start := time.Now()
	_, _, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return big, nil })
	if err != nil {
		t.Fatalf("huge: %v", err)
	}
	t.Logf("stored in %s", time.Since(start))
	start = time.Now()
	v, replayed, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return "", errors.New("ran") })
	if err != nil || !replayed || len(v) != len(big) {
		t.Errorf("huge replay: len %d %v %v", len(v), replayed, err)
	}
	t.Logf("replayed in %s", time.Since(start))
}

// TestStepValueThatDoesNotDecodeIsRefused: the same for a step's value: Step recorded a value
// that could not be decoded into T, and every later attempt of the generation failed at that
// step ("decode its saved value"): the work could never finish. The step is refused
// (ErrInvalidArgument) and its writes roll back; nothing is recorded, so a fixed worker runs it.
func TestStepValueThatDoesNotDecodeIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	count := effectCounter(t, pool)
	job := idem.Job{Principal: "alice", Key: "step-oneway", Action: "a", Lease: 10 * time.Second}
	_, _, err := idem.DoLease(ctx, pool, job, func(ctx context.Context, _ idem.LeaseClaim) (int, error) {
		v, err := idem.Step(ctx, "order", func(ctx context.Context, tx pgx.Tx) (oneWay, error) {
			return oneWay{41}, insertEffect(ctx, tx, "step-oneway")
		})
		return v.V, err
	})
	if !errors.Is(err, idem.ErrInvalidArgument) || count("step-oneway") != 0 {
		t.Fatalf("a step whose value does not decode: %v, %d effects; want ErrInvalidArgument and its writes rolled back", err, count("step-oneway"))
	}
	v, _, err := idem.DoLease(ctx, pool, job, func(ctx context.Context, _ idem.LeaseClaim) (int, error) {
		return idem.Step(ctx, "order", func(ctx context.Context, tx pgx.Tx) (int, error) {
			return 41, insertEffect(ctx, tx, "step-oneway")
		})
	})
	if err != nil || v != 41 || count("step-oneway") != 1 {
		t.Fatalf("the retry with a value that round-trips: %d %v, %d effects; want 41 and one effect", v, err, count("step-oneway"))
	}
}
