package idemhttp_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/dbidem"
	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLeaseRouteSteps: a lease route's handler writes in two steps (dbidem.Step, which
// idem.Step is). A run that fails between them (502: the lease is given up) leaves the first
// step recorded; the retry is told it (ClaimInfo.RecoveryPoint), skips it (one row) and gets its
// saved id. A run whose claim is taken over before its second step has that step refused, its
// row rolled back, and its answer neither stored nor sent (409). A request without a key runs
// its steps as plain transactions.
func TestLeaseRouteSteps(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	ctx := context.Background()
	pgtest.Exec(t, pool, `CREATE TABLE step_rows (id serial PRIMARY KEY, key text, step text)`)
	m, err := idemhttp.New(idemhttp.Options{DB: pool, LockTimeout: 300 * time.Millisecond,
		Principal: func(r *http.Request) (string, bool) { return "alice", true },
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	plan := map[string]string{"k1": "fail", "k2": "taken over"} // what a key's first run does
	mux := http.NewServeMux()
	mux.Handle("POST /steps", m.Route(idemhttp.Route{Lease: 5 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		claim, _ := idemhttp.ClaimOf(ctx)
		mu.Lock()
		do := plan[claim.Key]
		delete(plan, claim.Key)
		mu.Unlock()
		row := func(step string) func(ctx context.Context, tx pgx.Tx) (int, error) {
			return func(ctx context.Context, tx pgx.Tx) (int, error) {
				var id int
				err := tx.QueryRow(ctx, `INSERT INTO step_rows (key, step) VALUES ($1, $2) RETURNING id`, claim.Key, step).Scan(&id)
				return id, err
			}
		}
		a, err := dbidem.Step(ctx, "a", row("a"))
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		switch do {
		case "fail":
			http.Error(w, "the provider failed", http.StatusBadGateway)
			return
		case "taken over":
			// As a takeover does: the key's row gets a new token.
			pgtest.Exec(t, pool, `UPDATE idem.idempotency_keys SET attempt = attempt + 1000000 WHERE key = $1`, claim.Key)
		}
		b, err := dbidem.Step(ctx, "b", row("b"))
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"a":%d,"b":%d,"resumed_after":%q}`, a, b, claim.RecoveryPoint)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	post := func(key, body string) (int, string) {
		headers := []string{"Content-Type", "application/json"}
		if key != "" {
			headers = append(headers, "Idempotency-Key", key)
		}
		status, _, b := pgtest.Send(t, ctx, "POST", srv.URL+"/steps", body, headers...)
		return status, strings.TrimSpace(b)
	}
	rows := func(key string) string {
		var s string
		if err := pool.QueryRow(ctx, `SELECT coalesce(string_agg(step, ',' ORDER BY id), '') FROM step_rows WHERE key = $1`, key).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}

	// A run that fails between the steps (502: its lease is given up), then the client's retry.
	if status, body := post("k1", `{}`); status != http.StatusBadGateway {
		t.Fatalf("the failing run: %d %s", status, body)
	}
	if got := rows("k1"); got != "a" {
		t.Fatalf("after the failing run: rows %q, want a", got)
	}
	var aID int
	if err := pool.QueryRow(ctx, `SELECT id FROM step_rows WHERE key = 'k1'`).Scan(&aID); err != nil {
		t.Fatal(err)
	}
	status, answer := post("k1", `{}`)
	want := fmt.Sprintf(`{"a":%d,"b":%d,"resumed_after":"a"}`, aID, aID+1)
	if status != http.StatusCreated || answer != want {
		t.Fatalf("the retry: %d %s, want 201 %s (step a skipped, its id saved)", status, answer, want)
	}
	if got := rows("k1"); got != "a,b" {
		t.Fatalf("after the retry: rows %q, want a,b (a once)", got)
	}
	if status, again := post("k1", `{}`); status != http.StatusCreated || again != answer {
		t.Fatalf("the replay: %d %s, want %s", status, again, answer)
	}

	// A run taken over before its second step: the step is refused, its row rolled back, the
	// answer neither stored nor sent.
	if status, body := post("k2", `{}`); status != http.StatusConflict || !strings.Contains(body, "request_in_progress") {
		t.Fatalf("the run taken over: %d %s, want 409 request_in_progress", status, body)
	}
	if got := rows("k2"); got != "a" {
		t.Fatalf("the run taken over wrote %q, want a (b rolled back)", got)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'k2' AND state = 'p'`); n != 1 {
		t.Fatal("the answer of the run taken over was stored")
	}

	// Without a key: the steps are plain transactions.
	if status, body := post("", `{}`); status != http.StatusCreated || !strings.Contains(body, `"resumed_after":""`) {
		t.Fatalf("a request without a key: %d %s", status, body)
	}
	if got := rows(""); got != "a,b" {
		t.Fatalf("a request without a key wrote %q", got)
	}
}
