package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestInterruptedCommandsSaySo (operator review, held when written): docs/operations.md,
// "Shutdown": "`server migrate`, `server cleanup` and the other commands that do a job and exit
// exit 1 when a signal stops them before they finish (with "interrupted by a signal" on
// stderr)". Each command is held on a real lock (another session's transaction), then sent
// SIGTERM.
func TestInterruptedCommandsSaySo(t *testing.T) {
	t.Parallel()
	bin := serverBinary(t)
	s := startServer(t, nil)
	ctx := context.Background()
	id, _ := s.principal("expired")
	pgtest.InsertExpired(t, s.pool, id, 20)

	check := func(name string, code int, out string) {
		t.Helper()
		t.Logf("%s after SIGTERM: exit %d, output %q", name, code, out)
		if code != 1 {
			t.Errorf("%s interrupted by SIGTERM exited %d, want 1", name, code)
		}
		if !strings.Contains(out, "interrupted by a signal") {
			t.Errorf("%s interrupted by SIGTERM: stderr %q does not say \"interrupted by a signal\"", name, out)
		}
	}

	// cleanup: the documented maintenance window holds the cleanup lock.
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, holder, `SELECT pg_advisory_xact_lock(29665259344325742)`)
	code, out := interruptedExit(t, bin, s.db, "cleanup")
	_ = holder.Rollback(ctx)
	check("cleanup", code, out)

	// migrate: a report holds idem's version table.
	holder, err = s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, holder, `LOCK TABLE idem.schema_version IN ACCESS EXCLUSIVE MODE`)
	code, out = interruptedExit(t, bin, s.db, "migrate")
	_ = holder.Rollback(ctx)
	check("migrate", code, out)

	// principal create: a maintenance holds the principals' table.
	holder, err = s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, holder, `LOCK TABLE ledger.principals IN EXCLUSIVE MODE`)
	code, out = interruptedExit(t, bin, s.db, "principal", "create", "bob")
	_ = holder.Rollback(ctx)
	check("principal create", code, out)
}

// TestServeSignaledWhileStartingExitsZero (operator review, held when written):
// docs/operations.md, "Shutdown": on SIGINT or SIGTERM the server stops; "`serve` exits 0"
// (main's exitCode: "stopped while starting" is 0 too). A serve whose start check waits on a
// lock (a migrate's, a report's) is sent SIGTERM.
func TestServeSignaledWhileStartingExitsZero(t *testing.T) {
	t.Parallel()
	bin := serverBinary(t)
	s := startServer(t, nil)
	ctx := context.Background()
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, holder, `LOCK TABLE ledger.schema_version IN ACCESS EXCLUSIVE MODE`)
	code, out := interruptedExit(t, bin, s.db, "serve")
	_ = holder.Rollback(ctx)
	t.Logf("serve after SIGTERM while starting: exit %d, output %q", code, out)
	if code != 0 {
		t.Errorf("serve stopped by SIGTERM while starting exited %d, want 0 (output %q)", code, out)
	}
}

// TestShutdownEndsASteppedPayout (operator review, held when written): docs/operations.md,
// "Shutdown": the keyed work still running past SHUTDOWN_TIMEOUT is ended; "a payout gives its
// lease up at once ... so the client's retry runs it again under the same provider key instead
// of waiting for the lease to run out; the requests of work ended so are answered 503
// `shutting_down` with `Retry-After`", and the stop is clean. Here the lease route in steps
// (POST /v1/stepped-payouts), ended between its reserve and pay steps.
func TestShutdownEndsASteppedPayout(t *testing.T) {
	t.Parallel()
	env := map[string]string{"SHUTDOWN_TIMEOUT": "500ms", "PAYOUTS_LEASE": "30s", "PAYOUT_STEP_PAUSE": "30s", "PAYOUT_PROVIDER_DELAY": "0"}
	s := startServer(t, env)
	_, token := s.principal("stepped")
	id := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "dep", `{"amount":100}`); r.status != 201 {
		t.Fatalf("deposit: %+v", r)
	}
	body := fmt.Sprintf(`{"account":%d,"amount":10}`, id)
	first := make(chan resp, 1)
	go func() { first <- s.call("POST", "/v1/stepped-payouts", token, "sp", body) }()
	pgtest.WaitFor(t, s.pool, `SELECT count(*) FROM ledger.payout_reservations`)
	began := time.Now()
	if err := s.shutdown(); err != nil {
		t.Errorf("shutdown: %v, want a clean stop", err)
	}
	took := time.Since(began)
	r := <-first
	t.Logf("stop took %v; the stepped payout was answered %d %s", took, r.status, r.body)
	if r.status != 503 || !strings.Contains(r.body, "shutting_down") || r.header.Get("Retry-After") == "" {
		t.Errorf("the stepped payout ended at shutdown: %d %q Retry-After %q, want 503 shutting_down with Retry-After",
			r.status, r.body, r.header.Get("Retry-After"))
	}
	if took > 10*time.Second {
		t.Errorf("the stop took %v with SHUTDOWN_TIMEOUT=500ms", took)
	}
	next := serveOn(t, s.db, map[string]string{"PAYOUTS_LEASE": "30s", "PAYOUT_PROVIDER_DELAY": "0"})
	began = time.Now()
	r2 := next.call("POST", "/v1/stepped-payouts", token, "sp", body)
	t.Logf("retry: %d after %v: %s", r2.status, time.Since(began), r2.body)
	if r2.status != 201 || time.Since(began) > 10*time.Second {
		t.Errorf("the retry on the next server: %d after %s (%s), want 201 without waiting out the 30 s lease", r2.status, time.Since(began), r2.body)
	}
	if n := next.count(`SELECT count(*) FROM ledger.payout_reservations`); n != 1 {
		t.Errorf("%d reservations, want 1", n)
	}
	if n := next.count(`SELECT count(*) FROM provider.payouts`); n != 1 {
		t.Errorf("%d payouts at the provider, want 1", n)
	}
	if n := next.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, id); n != 90 {
		t.Errorf("balance %d, want 90", n)
	}
}

// TestConnectionsWithinPoolPlusTwo (operator review, held when written): docs/operations.md,
// "Sizing the pool": "Count `DATABASE_POOL_SIZE` + 2 (+ 4) connections per process against
// `max_connections`" (without RECEIPT_URL: the pool, and at most 2 for /healthz and the key
// gauges). The server's backends (application_name in its DATABASE_URL) are counted while every
// request connection waits on a row lock held by another session, payouts extend their leases,
// a cleanup pass runs and /healthz and /metrics are asked again and again.
func TestConnectionsWithinPoolPlusTwo(t *testing.T) {
	t.Parallel()
	base := startServer(t, nil)
	db := base.db
	switch {
	case !strings.Contains(db, "://"):
		db += " application_name=opsrv"
	case strings.Contains(db, "?"):
		db += "&application_name=opsrv"
	default:
		db += "?application_name=opsrv"
	}
	s := serveWith(t, db, base.db, map[string]string{"DATABASE_POOL_SIZE": "2", "CLEANUP_INTERVAL": "1s",
		"PAYOUTS_LEASE": "1s", "PAYOUT_PROVIDER_DELAY": "2s"}, io.Discard)
	_, token := s.principal("conns")
	id := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "d0", `{"amount":100}`); r.status != 201 {
		t.Fatalf("deposit: %+v", r)
	}
	ctx := context.Background()
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	pgtest.Exec(t, holder, `SELECT 1 FROM ledger.accounts WHERE id = $1 FOR UPDATE`, id)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, fmt.Sprintf("dz-%d", i), `{"amount":1}`)
		}()
	}
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.call("POST", "/v1/payouts", token, fmt.Sprintf("pz-%d", i), fmt.Sprintf(`{"account":%d,"amount":1}`, id))
		}()
	}
	for _, path := range []string{"/healthz", "/metrics", "/healthz"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				_, _, _, _ = getWithin(s.url+path, 5*time.Second)
				time.Sleep(20 * time.Millisecond)
			}
		}()
	}
	most := 0
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		_, _ = s.pool.Exec(ctx, `SELECT pg_stat_clear_snapshot()`)
		n := s.count(`SELECT count(*) FROM pg_stat_activity WHERE application_name = 'opsrv'`)
		most = max(most, n)
		time.Sleep(10 * time.Millisecond)
	}
	_ = holder.Rollback(ctx)
	close(stop)
	wg.Wait()
	t.Logf("at most %d backends of the server (DATABASE_POOL_SIZE=2)", most)
	if most > 2+2 {
		t.Errorf("the server held %d backends at once with DATABASE_POOL_SIZE=2; docs: at most the pool + 2", most)
	}
}

// TestBadValuesNameTheirVariable (operator review, held when written): docs/operations.md,
// "Configuration": "A bad value stops the start with a message that names the variable; all of
// them are checked, not only the first." Values an operator gets wrong: ports out of range,
// units missing, garbage.
func TestBadValuesNameTheirVariable(t *testing.T) {
	bad := map[string]string{
		"LISTEN_ADDR": "127.0.0.1:99999", "DATABASE_POOL_SIZE": "4.0", "IDEM_DATA_PORT": "0x10",
		"IDEMPOTENCY_TTL": "24", "IDEMPOTENCY_LOCK_TIMEOUT": "2", "IDEMPOTENCY_WORK_TIMEOUT": "30",
		"IDEMPOTENCY_DUPLICATE_WAIT": "10", "SHUTDOWN_TIMEOUT": "10", "PAYOUTS_LEASE": "5",
		"RECEIPT_LEASE": "10", "RECEIPT_TIMEOUT": "30", "CLEANUP_INTERVAL": "60", "MAX_BODY_BYTES": "1MiB",
		"MAX_STORED_RESPONSE_BYTES": "1073741825", "CLEANUP_BATCH_SIZE": "-5", "CLEANUP_DUTY": "40%",
		"LOG_LEVEL": "warning", "IDEMPOTENCY_MAX_WAITING_CLAIMS": "-1", "PAYOUT_PROVIDER_DELAY": "200",
		"PAYOUT_STEP_PAUSE": "1", "RECEIPT_RESCUE_AFTER": "1", "IDEMPOTENCY_MAX_WAITING_BYTES": "16MiB",
	}
	err := NewMain(io.Discard, io.Discard).ParseFlags(nil, func(k string) string { return bad[k] })
	if err == nil {
		t.Fatal("accepted")
	}
	for name, v := range bad {
		if !strings.Contains(err.Error(), name+"=") && !strings.Contains(err.Error(), name+" ") {
			t.Errorf("%s=%q: not named in %q", name, v, err)
		}
	}
}
