package main

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestPgRepackUnderTraffic runs the command docs/operations.md gives for rebuilding a bloated
// key table online, pg_repack as the table's owner, while 4 clients send keyed deposits:
// pg_repack copies the table beside the live one (a trigger keeps the copy current) and takes
// its ACCESS EXCLUSIVE lock twice, briefly; a keyed request that meets the lock is answered at
// once (503 with Retry-After), never made to wait. Afterwards every answered key replays and
// every key took effect once.
func TestPgRepackUnderTraffic(t *testing.T) {
	t.Parallel()
	repack, err := exec.LookPath("pg_repack")
	if err != nil {
		t.Fatal("pg_repack not found: apt-get install postgresql-15-repack")
	}
	s := startServer(t, nil)
	_, token := s.principal("repack")
	account := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	// A table worth repacking: 100,000 keys of another principal, half of them deleted.
	pgtest.Exec(t, s.pool, `INSERT INTO ledger.principals (id, name) VALUES ('p_fill', 'fill')`)
	pgtest.Exec(t, s.pool, `INSERT INTO idem.idempotency_keys (expires_at, attempt, action_hash, state, principal_id, key,
		request_sha256, response_status, response_headers, response_body)
		SELECT now() + interval '1 day', nextval('idem.token_seq'), 0, 'c', 'p_fill', 'fill-' || g, sha256(g::text::bytea),
		       201, '{}', convert_to(repeat('x', 200), 'UTF8')
		  FROM generate_series(1, 100000) AS g`)
	pgtest.Exec(t, s.pool, `DELETE FROM idem.idempotency_keys WHERE principal_id = 'p_fill' AND key LIKE '%0'`)
	pgtest.Exec(t, s.pool, `CREATE EXTENSION IF NOT EXISTS pg_repack`)

	var (
		wg       sync.WaitGroup
		stop     atomic.Bool
		mu       sync.Mutex
		answers  = map[string]resp{}
		statuses = map[int]int{}
		slowest  time.Duration
	)
	for c := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; !stop.Load(); i++ {
				key := fmt.Sprintf("r-%d-%d", c, i)
				t0 := time.Now()
				r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", account), token, key, `{"amount":1}`)
				mu.Lock()
				answers[key] = r
				statuses[r.status]++
				slowest = max(slowest, time.Since(t0))
				mu.Unlock()
			}
		}()
	}
	time.Sleep(300 * time.Millisecond)
	cfg, err := pgx.ParseConfig(s.db)
	if err != nil {
		t.Fatal(err)
	}
	// As docs/operations.md says: as a superuser, without killing anyone's backend, and with
	// its locks asked for a few seconds at most.
	cmd := exec.Command(repack, "--no-kill-backend", "--wait-timeout=5",
		"--table=idem.idempotency_keys", "--dbname="+cfg.Database)
	cmd.Env = append(os.Environ(), "PGHOST="+cfg.Host, fmt.Sprintf("PGPORT=%d", cfg.Port), "PGUSER="+cfg.User,
		"PGPASSWORD="+cfg.Password)
	began := time.Now()
	out, err := cmd.CombinedOutput()
	took := time.Since(began)
	time.Sleep(300 * time.Millisecond)
	stop.Store(true)
	wg.Wait()
	if err != nil {
		t.Fatalf("pg_repack: %v\n%s", err, out)
	}
	t.Logf("pg_repack took %v; keyed answers meanwhile %v, the slowest %v", took.Round(time.Millisecond), statuses, slowest.Round(time.Millisecond))
	for key, a := range answers {
		switch {
		case a.status == http.StatusCreated:
			if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", account), token, key, `{"amount":1}`); r.status != 201 ||
				r.body != a.body || r.header.Get("Idempotent-Replayed") != "true" {
				t.Fatalf("%s answered %s, after the repack %d %s", key, a.body, r.status, r.body)
			}
		case (a.status == http.StatusServiceUnavailable || a.status == http.StatusConflict) && a.header.Get("Retry-After") != "":
		default:
			t.Fatalf("%s during the repack: %d %s", key, a.status, a.body)
		}
	}
	if slowest > 3*time.Second {
		t.Fatalf("a keyed request during the repack took %v", slowest)
	}
	var balance, deposits int
	if err := s.pool.QueryRow(context.Background(), `SELECT (SELECT balance FROM ledger.accounts WHERE id = $1),
		(SELECT count(*) FROM ledger.deposits WHERE account_id = $1)`, account).Scan(&balance, &deposits); err != nil {
		t.Fatal(err)
	}
	if balance != deposits || deposits != statuses[http.StatusCreated] {
		t.Fatalf("balance %d, %d deposits, %d answered 201: every key must take effect once", balance, deposits, statuses[http.StatusCreated])
	}
}
