package dbidem

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestIntervalRoundsAwayFromZero: a duration is sent in whole microseconds, a part of one rounded
// away from zero; 0 is NULL (the default).
func TestIntervalRoundsAwayFromZero(t *testing.T) {
	for d, want := range map[time.Duration]string{
		time.Nanosecond: "1 microseconds", -time.Nanosecond: "-1 microseconds", 1500: "2 microseconds",
		-1500: "-2 microseconds", time.Second: "1000000 microseconds", -time.Second: "-1000000 microseconds",
	} {
		if got := interval(d); got == nil || *got != want {
			t.Errorf("interval(%v) = %v, want %q", d, got, want)
		}
	}
	if interval(0) != nil {
		t.Error("interval(0) is not NULL")
	}
}

// TestNegativeTTLBelowAMicrosecondIsNamed: a TTL of -1ns was sent as 0 microseconds, and the
// SQL API refused it as "got 00:00:00"; it is refused as the negative value it is (a review of
// the go doc found the message).
func TestNegativeTTLBelowAMicrosecondIsNamed(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 2)
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SELECT * FROM idem.idem_begin('p', 'k', 'POST /x', $1, $2::interval)`,
		make([]byte, 32), interval(-time.Nanosecond))
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "22023" || !strings.Contains(pgErr.Message, "-00:00:00.000001") {
		t.Fatalf("a TTL of -1ns: %v, want 22023 naming -00:00:00.000001", err)
	}
}
