package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// runCommand runs `server ARGS...` against db and returns what it printed.
func runCommand(t *testing.T, db string, args ...string) (string, error) {
	t.Helper()
	var out bytes.Buffer
	m := NewMain(&out, io.Discard)
	if err := m.ParseFlags(args, serverEnv(db, nil)); err != nil {
		t.Fatal(err)
	}
	err := m.Run(context.Background())
	_ = m.Close()
	return out.String(), err
}

// TestStuckLeaseIsSeenAndReleased: a payout's server process is killed mid-work, so its lease
// claim stays in progress with nobody to finish it; the client's retries get 409 until the
// lease runs out. It shows in `server keys stuck` (with its token), in `server keys`, in one
// key's story and in the gauges of another server; the operator releases it with the token the
// list gave, and the client's retry runs the payout again under the same provider key, so the
// provider pays once. A completed key cannot be released.
func TestStuckLeaseIsSeenAndReleased(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"PAYOUT_PROVIDER_DELAY": "0"})
	principal, token := s.principal("ops")
	account := int(s.call("POST", "/v1/accounts", token, "", `{"name":"main","currency":"EUR"}`).json(t)["id"].(float64))
	body := fmt.Sprintf(`{"account":%d,"amount":900}`, account)

	port, err := pgcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	dying := &process{t: t, bin: serverBinary(t), addr: fmt.Sprintf("127.0.0.1:%d", port), env: append(os.Environ(),
		"DATABASE_URL="+s.db, "LISTEN_ADDR="+fmt.Sprintf("127.0.0.1:%d", port), "CLEANUP_INTERVAL=0",
		// The provider keeps the payout it accepted (it answers its calls 3 s after the first):
		// the client's retry after the release gets that payout, under the same provider key.
		"PAYOUTS_LEASE=1m", "PAYOUT_PROVIDER_DELAY=3s")}
	dying.start()
	go pgtest.Send(t, context.Background(), "POST", "http://"+dying.addr+"/v1/payouts", body,
		"Authorization", "Bearer "+token, "Idempotency-Key", "stuck-1", "Content-Type", "application/json")
	pgtest.WaitFor(t, s.pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'stuck-1'`)
	dying.kill()

	if r := s.call("POST", "/v1/payouts", token, "stuck-1", body); r.status != 409 {
		t.Fatalf("a retry while the dead process's lease runs: %+v, want 409", r)
	}
	// Every `server keys` form runs as a login role that is only a member of idem_operator.
	// The release flow starts from the list of the claims in progress: principal, key, token.
	ops := loginRoleIn(t, s.db, "idem_operator")
	list, err := runCommand(t, ops, "keys", "stuck")
	listed := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(principal) + `\s+stuck-1\s+(\d+)\s+\S+\s+\S+\s+false\s+[0-9a-f]{64}$`).FindStringSubmatch(list)
	if err != nil || listed == nil || !strings.Contains(list, "1 lease claims in progress") {
		t.Fatalf("server keys stuck: %v\n%s", err, list)
	}
	if none, err := runCommand(t, ops, "keys", "stuck", "1h"); err != nil || !strings.Contains(none, "0 lease claims in progress claimed at least 1h0m0s ago") {
		t.Fatalf("server keys stuck 1h: %v\n%s", err, none)
	}
	if _, err := runCommand(t, loginRole(t, s.db), "keys", "stuck"); err == nil || !strings.Contains(err.Error(), "permission denied") {
		t.Fatalf("server keys stuck as the application role: %v, want permission denied", err)
	}
	summary, err := runCommand(t, ops, "keys")
	if err != nil || !regexp.MustCompile(`\(all\)\s+\d+\s+1\s`).MatchString(summary) {
		t.Fatalf("server keys: %v\n%s", err, summary)
	}
	story, err := runCommand(t, ops, "keys", principal, "stuck-1")
	if err != nil || !strings.Contains(story, "state              in_progress") || strings.Contains(story, "claimed_at         -") {
		t.Fatalf("server keys %s stuck-1: %v\n%s", principal, err, story)
	}
	for _, f := range []string{"response_status", "response_headers", "body_bytes"} { // no answer yet: NULL, not 0
		if !regexp.MustCompile(`(?m)^` + f + `\s+-$`).MatchString(story) {
			t.Fatalf("%s of a claim in progress is not shown as -:\n%s", f, story)
		}
	}
	m := regexp.MustCompile(`(?m)^attempt\s+(\d+)$`).FindStringSubmatch(story)
	if m == nil {
		t.Fatalf("no token in the story:\n%s", story)
	}
	attempt, _ := strconv.ParseInt(m[1], 10, 64)
	if listed[1] != m[1] {
		t.Fatalf("the list gives the token %s, the story %s", listed[1], m[1])
	}

	// The gauges of a running server (s) see it: one claim in progress, of some age.
	time.Sleep(1100 * time.Millisecond)
	metrics := s.call("GET", "/metrics", "", "", "").body
	if !strings.Contains(metrics, "idempotency_keys_in_progress 1") || strings.Contains(metrics, "idempotency_oldest_in_progress_seconds 0\n") {
		t.Fatalf("the gauges do not show the stuck claim:\n%s", grepLines(metrics, "idempotency_"))
	}

	if out, err := runCommand(t, ops, "keys", "release", principal, "stuck-1", strconv.FormatInt(attempt+1000000, 10), "wrong token"); err == nil ||
		!strings.Contains(err.Error(), "token is "+m[1]) || strings.Contains(err.Error(), "claim lost") {
		t.Fatalf("a release with another token: %v %s, want a refusal that gives the key's token", err, out)
	}
	if out, err := runCommand(t, ops, "keys", "release", principal, "stuck-1", m[1], "process", "killed"); err != nil ||
		!strings.Contains(out, `reason "process killed"`) {
		t.Fatalf("the release: %v %s, want it done, with its reason", err, out)
	}
	r := s.call("POST", "/v1/payouts", token, "stuck-1", body)
	if r.status != 201 || r.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("the client's retry after the release: %+v, want the payout made", r)
	}
	if n := s.count(`SELECT count(*) FROM provider.payouts`); n != 1 {
		t.Fatalf("%d payouts at the provider, want the dead attempt's one, answered to the retry", n)
	}
	story, _ = runCommand(t, ops, "keys", principal, "stuck-1")
	if !regexp.MustCompile(`(?m)^response_status\s+201$`).MatchString(story) ||
		!regexp.MustCompile(`(?m)^response_headers\s+\{"Content-Type":"application/json"`).MatchString(story) {
		t.Fatalf("the completed payout's story:\n%s", story)
	}
	m2 := regexp.MustCompile(`(?m)^attempt\s+(\d+)$`).FindStringSubmatch(story)
	if _, err := runCommand(t, ops, "keys", "release", principal, "stuck-1", m2[1]); err == nil || !strings.Contains(err.Error(), "completed") {
		t.Fatalf("releasing a completed key: %v, want a refusal that says it is completed", err)
	}
}

func grepLines(s, prefix string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.HasPrefix(l, prefix) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestKeysOnACoordinator: on a Citus coordinator (a stand-in with two workers,
// pgtest.CitusStandIn) the key gauges appear in /metrics with the whole cluster's figures,
// and `server keys` answers, as the operator role, with the workers' size and backlog. Both
// failed on a coordinator: idem_health could not be planned there.
func TestKeysOnACoordinator(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	pgtest.CitusStandIn(t, s.pool)
	pgtest.InsertKeys(t, s.pool, "idem.keys_w1", "a", "old", 120, true)
	pgtest.InsertKeys(t, s.pool, "idem.keys_w2", "b", "old", 80, true)
	pgtest.InsertKeys(t, s.pool, "idem.keys_w2", "b", "live", 30, false)
	bytes := s.count(`SELECT pg_total_relation_size('idem.keys_w1') + pg_total_relation_size('idem.keys_w2')`)

	metrics := s.call("GET", "/metrics", "", "", "").body
	for _, want := range []string{"idempotency_cleanup_backlog 200\n", fmt.Sprintf("idempotency_key_table_bytes %d\n", bytes),
		"idempotency_keys_in_progress 0\n", "idempotency_leases_run_out 0\n"} {
		if !strings.Contains(metrics, want) {
			t.Fatalf("/metrics on a coordinator lacks %q:\n%s", want, grepLines(metrics, "idempotency_"))
		}
	}
	out, err := runCommand(t, loginRoleIn(t, s.db, "idem_operator"), "keys")
	if err != nil || !strings.Contains(out, fmt.Sprintf("key table: %d bytes, cleanup backlog: 200", bytes)) {
		t.Fatalf("server keys on a coordinator: %v\n%s", err, out)
	}
	if out, err := runCommand(t, loginRoleIn(t, s.db, "idem_operator"), "keys", "by-principal"); err != nil {
		t.Fatalf("server keys by-principal on a coordinator: %v\n%s", err, out)
	}
}
