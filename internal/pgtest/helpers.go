package pgtest

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Querier is what the helpers need: a pool, a connection or a transaction.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Count runs a query that returns one integer and fails the test on an error.
func Count(t testing.TB, q Querier, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := q.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// Exec runs a statement and fails the test on an error.
func Exec(t testing.TB, q Querier, sql string, args ...any) {
	t.Helper()
	if _, err := q.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// InsertExpired writes n completed keys of principal, named old-1 to old-n, whose TTL ran
// out a day ago (expires_at one millisecond apart, oldest first), straight into the key
// table (the test's role owns it).
func InsertExpired(t testing.TB, q Querier, principal string, n int) {
	t.Helper()
	Exec(t, q, `INSERT INTO idem.idempotency_keys (expires_at, attempt, action_hash, state, principal_id, key,
		request_sha256, response_status, response_headers)
		SELECT now() - interval '1 day' + i * interval '1 ms', nextval('idem.attempt_seq'), 0, 'c', $1, 'old-' || i,
		       sha256(i::text::bytea), 200, '{}'
		  FROM generate_series(1, $2) AS i`, principal, n)
}

// WaitUntilBlocked returns once the backend pid waits on a lock (pg_stat_activity says so),
// and fails the test after 10 seconds.
func WaitUntilBlocked(t testing.TB, q Querier, pid uint32) {
	t.Helper()
	WaitFor(t, q, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'`, pid)
}

// WaitFor polls a query that returns an integer until it is above zero, and fails the test
// after 10 seconds.
func WaitFor(t testing.TB, q Querier, sql string, args ...any) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if Count(t, q, sql, args...) > 0 {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("never true: %s %v", sql, args)
}
