package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestHealthWhileEveryRequestConnectionWaits: with every connection of the request pool held by
// requests waiting on a row lock (a busy service, not a broken one), /healthz still answers 200
// at once and /metrics still carries the key gauges. Both used to borrow a request connection:
// /healthz said "the database does not answer" after its 2 s, and the gauges went absent, so a
// load balancer took a busy instance out and IdemKeyGaugesAbsent fired under load.
func TestHealthWhileEveryRequestConnectionWaits(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"DATABASE_POOL_SIZE": "2", "IDEMPOTENCY_LOCK_TIMEOUT": "20s"})
	_, token := s.principal("busy")
	id := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))

	ctx := context.Background()
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	pgtest.Exec(t, holder, `SELECT 1 FROM ledger.accounts WHERE id = $1 FOR UPDATE`, id)
	done := make(chan resp, 2)
	for i := range 2 {
		go func() {
			done <- s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, fmt.Sprintf("busy-%d", i), `{"amount":1}`)
		}()
	}
	// Both of the server's request connections wait on the account's row.
	pgtest.WaitFor(t, s.pool, `SELECT count(*) - 1 FROM pg_stat_activity
		WHERE datname = current_database() AND wait_event_type = 'Lock'`)

	st, body, took, err := getWithin(s.url+"/healthz", 10*time.Second)
	if err != nil || st != 200 || took > time.Second {
		t.Errorf("/healthz with the request pool taken: %d %s in %v (%v), want 200 at once", st, body, took, err)
	}
	st, body, took, err = getWithin(s.url+"/metrics", 10*time.Second)
	if err != nil || st != 200 || took > time.Second || !strings.Contains(body, "\nidempotency_keys_in_progress ") {
		t.Errorf("/metrics with the request pool taken: %d in %v (%v), key gauges present: %v",
			st, took, err, strings.Contains(body, "\nidempotency_keys_in_progress "))
	}

	_ = holder.Rollback(ctx)
	for range 2 {
		if r := <-done; r.status != 201 {
			t.Errorf("a deposit that waited: %+v", r)
		}
	}
}

// TestConnectTimeoutDefault: a DATABASE_URL that chooses no connect timeout gets 5 s (a
// database silent at connect held the request that asked for a connection for minutes); one
// that may have chosen one keeps what pgx made of it: connect_timeout in the string (0, no
// limit, included; in doubt, within a quoted value), a service (whose file may set it),
// PGCONNECT_TIMEOUT or PGSERVICE.
func TestConnectTimeoutDefault(t *testing.T) {
	none := func(string) string { return "" }
	env := func(name string) func(string) string {
		return func(k string) string {
			if k == name {
				return "x"
			}
			return ""
		}
	}
	for _, tc := range []struct {
		url    string
		getenv func(string) string
		given  bool
	}{
		{"postgres://u@db.example:5432/d", none, false},
		{"postgres://u@db.service.consul:5432/d?sslmode=disable", none, false},
		{"host=db.example user=u dbname=d", none, false},
		{"postgres://u@db.example:5432/d?connect_timeout=2", none, true},
		{"postgresql://u@db.example:5432/d?connect_timeout=0", none, true},
		{"host=db.example user=u dbname=d connect_timeout=9", none, true},
		{"connect_timeout = 0 host=db.example", none, true},
		{"host=db.example application_name='x connect_timeout=1'", none, true},
		{"service=ledger", none, true},
		{"postgres:///d?service=ledger", none, true},
		{"postgres://u@db.example:5432/d", env("PGCONNECT_TIMEOUT"), true},
		{"postgres://u@db.example:5432/d", env("PGSERVICE"), true},
	} {
		cfg, err := pgx.ParseConfig(tc.url)
		if err != nil && !strings.Contains(tc.url, "service") {
			t.Fatalf("%s: %v", tc.url, err)
		}
		var parsed time.Duration
		if cfg != nil {
			parsed = cfg.ConnectTimeout
		}
		if got := connectTimeoutGiven(tc.url, parsed, tc.getenv); got != tc.given {
			t.Errorf("%s: connect timeout given %v, want %v", tc.url, got, tc.given)
		}
	}
}
