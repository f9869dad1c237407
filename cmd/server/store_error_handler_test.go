package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestHandlerOnADroppedConnectionIsStoreError: docs/operations.md counts store_error when "the
// database failed and the client got a 5xx". A deposit whose backend was terminated while its
// statement waited (pg_terminate_backend; a server shutting down is the same FATAL) was
// answered 503 by the ledger's handler and counted acquired only: the alert on store_error
// never saw the database failing under requests. It is counted store_error now, on top of
// acquired. A handler whose work timeout ended its statement (pgx closes that connection too)
// is the work's failure, not the store's: not counted.
func TestHandlerOnADroppedConnectionIsStoreError(t *testing.T) {
	t.Parallel()
	const action = `POST /v1/accounts/{id}/deposits`
	for _, c := range []struct {
		name      string
		env       map[string]string
		terminate bool
		status    int
		storeErr  float64
	}{
		{"terminated", nil, true, 503, 1},
		{"work timeout", map[string]string{"IDEMPOTENCY_WORK_TIMEOUT": "500ms"}, false, 500, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			s := startServer(t, c.env)
			_, token := s.principal("dropped")
			account := int(s.call("POST", "/v1/accounts", token, "acc", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
			path := fmt.Sprintf("/v1/accounts/%d/deposits", account)
			if r := s.call("POST", path, token, "first", `{"amount":1}`); r.status != 201 {
				t.Fatalf("deposit: %d %s", r.status, r.body)
			}
			ctx := context.Background()
			direct := pgtest.Connect(t, s.db)
			lock, err := direct.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = lock.Rollback(ctx) }()
			pgtest.Exec(t, lock, `SELECT 1 FROM ledger.accounts WHERE id = $1 FOR UPDATE`, account)
			answered := make(chan resp, 1)
			go func() { answered <- s.call("POST", path, token, "dropped", `{"amount":2}`) }()
			if c.terminate {
				admin := pgtest.Connect(t, s.db)
				pgtest.WaitFor(t, admin, `SELECT count(*) FROM pg_stat_activity
					WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%ledger.accounts%'`)
				pgtest.Exec(t, admin, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
					WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%ledger.accounts%'`)
			}
			var r resp
			select {
			case r = <-answered:
			case <-time.After(30 * time.Second):
				t.Fatal("no answer within 30 s")
			}
			_ = lock.Rollback(ctx)
			if r.status != c.status {
				t.Fatalf("the deposit: %d %s, want %d", r.status, r.body, c.status)
			}
			_, body, _, err := getWithin(s.url+"/metrics", 10*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			storeErr, _ := metricValue(body, `idempotency_requests_total{action="`+action+`",state="store_error"}`)
			acquired, _ := metricValue(body, `idempotency_requests_total{action="`+action+`",state="acquired"}`)
			if storeErr != c.storeErr || acquired != 2 {
				t.Errorf("store_error %v, acquired %v; want %v and 2 (%s)", storeErr, acquired, c.storeErr, linesWith(body, action))
			}
		})
	}
}
