package dbidem_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestPace: the pause is took × (1-duty)/duty; a duty of 1 or more, or NaN, means none; a
// duty too small to mean anything (zero, negative, 1e-12, the smallest float) counts as
// MinCleanupDuty rather than overflowing into no pause; an ended context ends the pause.
// The bounds are coarse on purpose: each case tells "no pause" from "a pause of tens of
// milliseconds" or "a pause of an hour" apart.
func TestPace(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pace := func(duty float64, took time.Duration) time.Duration {
		t.Helper()
		start := time.Now()
		if err := dbidem.Pace(ctx, duty, took); err != nil {
			t.Fatalf("Pace(%v, %v): %v", duty, took, err)
		}
		return time.Since(start)
	}
	for _, duty := range []float64{1, 2, math.Inf(1), math.NaN()} {
		if d := pace(duty, time.Second); d > 200*time.Millisecond {
			t.Errorf("duty %v: paused %v, want no pause", duty, d)
		}
	}
	if d := pace(0.5, 0); d > 200*time.Millisecond {
		t.Errorf("a batch that took no time: paused %v, want no pause", d)
	}
	if d := pace(0.5, 60*time.Millisecond); d < 60*time.Millisecond || d > 2*time.Second {
		t.Errorf("duty 0.5 after 60ms: paused %v, want 60ms", d)
	}
	for _, duty := range []float64{0, -1, 1e-12, 5e-324, math.Inf(-1)} {
		// 99 × 3 ms: the pause of MinCleanupDuty (0.01).
		if d := pace(duty, 3*time.Millisecond); d < 290*time.Millisecond || d > 5*time.Second {
			t.Errorf("duty %v after 3ms: paused %v, want about 297ms (MinCleanupDuty)", duty, d)
		}
	}

	// A pause of an hour (the bound, whatever the batch took) ends with its context.
	cctx, cancel := context.WithCancel(ctx)
	time.AfterFunc(50*time.Millisecond, cancel)
	start := time.Now()
	if err := dbidem.Pace(cctx, 0.01, 1000*time.Hour); !errors.Is(err, context.Canceled) {
		t.Fatalf("Pace with a cancelled context: %v, want context.Canceled", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the pause outlived its context by %v", d)
	}
}

// cancelAfterBatch cancels its context once the first cleanup batch (idem_cleanup) has
// answered, so that the cancellation lands in the pause after it.
type cancelAfterBatch struct {
	*pgxpool.Pool
	cancel context.CancelFunc
}

func (c cancelAfterBatch) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	row := c.Pool.QueryRow(ctx, sql, args...)
	if !strings.Contains(sql, "idem.idem_cleanup(") {
		return row // the question whether there are workers to ask
	}
	return cancelRow{row, c.cancel}
}

type cancelRow struct {
	pgx.Row
	cancel context.CancelFunc
}

func (r cancelRow) Scan(dest ...any) error {
	err := r.Row.Scan(dest...)
	r.cancel()
	return err
}

// TestCleanupPaced: paced cleanup deletes what unpaced cleanup deletes, and a context that
// ends during a pause returns the count deleted so far with ctx.Err().
func TestCleanupPaced(t *testing.T) {
	t.Parallel()
	modes(t, func(t *testing.T, pool *pgxpool.Pool) {
		ctx := context.Background()
		pgtest.InsertExpired(t, pool, "p", 2500)
		if n, err := dbidem.CleanupPaced(ctx, pool, 1000, 0.5); err != nil || n != 2500 {
			t.Fatalf("paced cleanup: %d %v, want 2500", n, err)
		}
		if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys`); n != 0 {
			t.Fatalf("%d rows left after a paced cleanup, want 0", n)
		}

		pgtest.InsertExpired(t, pool, "p", 2500)
		cctx, cancel := context.WithCancel(ctx)
		defer cancel()
		n, err := dbidem.CleanupPaced(cctx, cancelAfterBatch{pool, cancel}, 1000, dbidem.MinCleanupDuty)
		if !errors.Is(err, context.Canceled) || n != 1000 {
			t.Fatalf("paced cleanup cancelled in its first pause: %d %v, want 1000 and context.Canceled", n, err)
		}
		if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys`); n != 1500 {
			t.Fatalf("%d rows left, want the 1500 the cancelled cleanup did not reach", n)
		}
	})
}

// TestIsUnavailable: connection and shutdown errors are unavailability; an ended context,
// though the network errors it causes look alike, and any other database error are not.
func TestIsUnavailable(t *testing.T) {
	t.Parallel()
	opErr := &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}
	for _, c := range []struct {
		err  error
		want bool
	}{
		{&pgconn.PgError{Code: "57P01"}, true},
		{&pgconn.PgError{Code: "08006"}, true},
		{&pgconn.PgError{Code: "53300"}, true},
		{fmt.Errorf("query: %w", opErr), true},
		// pgx's "conn closed": a pool's connection whose socket went away (a failover) before
		// the statement was sent; answered 500 by the reference server before (a review)
		{fmt.Errorf("failed to deallocate cached statement(s): %w", pgconn.ErrConnClosed), true},
		{&pgconn.PgError{Code: "23505"}, false},
		{&pgconn.PgError{Code: "57014"}, false}, // statement_timeout: the database answered
		{context.DeadlineExceeded, false},
		{fmt.Errorf("pay: %w", context.Canceled), false},
		{errors.New("something else"), false},
		{nil, false},
	} {
		if got := dbidem.IsUnavailable(c.err); got != c.want {
			t.Errorf("IsUnavailable(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
