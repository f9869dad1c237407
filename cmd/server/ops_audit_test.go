package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// opsBuf is a log sink safe for the server's goroutines.
type opsBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *opsBuf) Write(p []byte) (int, error) { b.mu.Lock(); defer b.mu.Unlock(); return b.b.Write(p) }
func (b *opsBuf) String() string              { b.mu.Lock(); defer b.mu.Unlock(); return b.b.String() }

// opsSeries parses a Prometheus text exposition: for each metric family name (as it appears in
// the sample lines), the sets of label names of its samples, and every sample line.
func opsSeries(exposition string) (labels map[string]map[string]bool, samples []string) {
	labels = map[string]map[string]bool{}
	sample := regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? `)
	labelName := regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="`)
	for _, line := range strings.Split(exposition, "\n") {
		m := sample.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		samples = append(samples, line)
		var names []string
		for _, l := range labelName.FindAllStringSubmatch(m[3], -1) {
			names = append(names, l[1])
		}
		sort.Strings(names)
		if labels[m[1]] == nil {
			labels[m[1]] = map[string]bool{}
		}
		labels[m[1]][strings.Join(names, ",")] = true
	}
	return labels, samples
}

// TestOpsMetricsTableMatchesExposition: every row of docs/operations.md's "Metrics" table
// names a metric that /metrics exposes with exactly the labels the row gives (a histogram's
// le on its buckets aside); go_* and process_* are there; idem_cleanup_passes_total has the
// four documented results and an action's idempotency_requests_total the six documented
// states.
func TestOpsMetricsTableMatchesExposition(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"CLEANUP_INTERVAL": "1s", "PAYOUTS_LEASE": "1s", "PAYOUT_PROVIDER_DELAY": "700ms"})
	_, token := s.principal("metrics")
	account := int(s.call("POST", "/v1/accounts", token, "acct-1", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	s.call("POST", "/v1/accounts", token, "acct-1", `{"name":"a","currency":"EUR"}`)
	if r := s.call("POST", "/v1/payouts", token, "payout-2", fmt.Sprintf(`{"account":%d,"amount":1}`, account)); r.status != 201 {
		t.Fatalf("payout: %+v", r)
	}
	time.Sleep(1500 * time.Millisecond) // a cleanup pass
	exposition := s.call("GET", "/metrics", "", "", "").body
	labels, samples := opsSeries(exposition)

	ops, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, _ := strings.Cut(string(ops), "\n## Metrics\n")
	section, _, _ = strings.Cut(section, "\n## ")
	row := regexp.MustCompile("(?m)^\\| `([a-z_]+)(\\{([a-z_,]*)\\})?` \\| ([a-z]+) \\|")
	rows := row.FindAllStringSubmatch(section, -1)
	if len(rows) < 15 {
		t.Fatalf("only %d metric rows found in docs/operations.md", len(rows))
	}
	for _, r := range rows {
		name, want, typ := r[1], r[3], r[4]
		if want != "" {
			parts := strings.Split(want, ",")
			sort.Strings(parts)
			want = strings.Join(parts, ",")
		}
		sampleName := name
		if typ == "histogram" {
			sampleName = name + "_count"
		}
		got, ok := labels[sampleName]
		if !ok {
			t.Errorf("docs/operations.md lists %s (%s); /metrics has no sample of it", name, typ)
			continue
		}
		if len(got) != 1 || !got[want] {
			t.Errorf("%s: docs give labels {%s}; /metrics has %v", name, want, got)
		}
	}
	for _, prefix := range []string{"go_", "process_"} {
		found := false
		for n := range labels {
			found = found || strings.HasPrefix(n, prefix)
		}
		if !found {
			t.Errorf("no %s* metric in /metrics (docs: the reference server registers Go's and the process's collectors)", prefix)
		}
	}
	for _, result := range []string{"done", "skipped", "failed", "stopped"} {
		if !strings.Contains(exposition, `idem_cleanup_passes_total{result="`+result+`"}`) {
			t.Errorf("idem_cleanup_passes_total has no result %q", result)
		}
	}
	perAction := map[string]map[string]bool{}
	st := regexp.MustCompile(`^idempotency_requests_total\{action="([^"]*)",state="([^"]*)"\}`)
	for _, line := range samples {
		if m := st.FindStringSubmatch(line); m != nil {
			if perAction[m[1]] == nil {
				perAction[m[1]] = map[string]bool{}
			}
			perAction[m[1]][m[2]] = true
		}
	}
	if len(perAction) == 0 {
		t.Fatal("no idempotency_requests_total series")
	}
	for action, states := range perAction {
		for _, want := range []string{"acquired", "replayed", "busy", "key_reused", "store_error", "oversize"} {
			if !states[want] {
				t.Errorf("action %q has no state %q (docs: an action's six series start together)", action, want)
			}
		}
		if len(states) != 6 {
			t.Errorf("action %q has states %v, want the six documented ones (the set is frozen)", action, states)
		}
	}
}

// TestOpsCleanupPauseWindowAndHolderQuery: "To pause every cleaner for a while, hold the lock
// in a transaction of your own, as the table's owner or any role: the scheduled passes are
// skipped until it ends", and the documented pg_locks query finds the holder (its pid and
// role). idem.CleanupLock is the number the docs give.
func TestOpsCleanupPauseWindowAndHolderQuery(t *testing.T) {
	t.Parallel()
	if idem.CleanupLock != 29665259344325742 {
		t.Fatalf("idem.CleanupLock is %d, docs/operations.md gives 29665259344325742", idem.CleanupLock)
	}
	s := startServer(t, map[string]string{"CLEANUP_INTERVAL": "1s"})
	id, _ := s.principal("pause")
	ctx := context.Background()

	// The window, held by a login role that is only a member of idem_app (any role).
	holder := pgtest.Connect(t, loginRole(t, s.db))
	var holderPID int
	var holderRole string
	if err := holder.QueryRow(ctx, `SELECT pg_backend_pid(), current_user`).Scan(&holderPID, &holderRole); err != nil {
		t.Fatal(err)
	}
	tx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(29665259344325742)`); err != nil {
		t.Fatal(err)
	}
	pgtest.InsertExpired(t, s.pool, id, 40)
	time.Sleep(2500 * time.Millisecond) // two scheduled passes, skipped

	// The documented query finds the holder.
	rows, err := s.pool.Query(ctx, `SELECT pid, usename FROM pg_locks JOIN pg_stat_activity USING (pid) WHERE locktype = 'advisory' AND classid = 6906981 AND objid = 1835232366`)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for rows.Next() {
		var pid int
		var user string
		if err := rows.Scan(&pid, &user); err != nil {
			t.Fatal(err)
		}
		found = found || (pid == holderPID && user == holderRole)
	}
	rows.Close()
	if !found {
		t.Errorf("the documented pg_locks query does not find the holder (pid %d, %s)", holderPID, holderRole)
	}
	if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = $1`, id); n != 40 {
		t.Errorf("%d of 40 expired keys left while the window held the lock: the scheduled passes were not skipped", n)
	}
	metrics := s.call("GET", "/metrics", "", "", "").body
	if regexp.MustCompile(`(?m)^idem_cleanup_passes_total\{result="skipped"\} 0$`).MatchString(metrics) {
		t.Errorf("no skipped pass counted while the window held the lock:\n%s", grepLines(metrics, "idem_cleanup"))
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = $1`, id) != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the scheduled cleanup did not resume after the window ended")
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestOpsServerCleanupSaysWhatItDeleted: "`server cleanup` runs one full pass by hand (and
// says how many keys it deleted and how long the pass took)", as the least-privilege role.
func TestOpsServerCleanupSaysWhatItDeleted(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	id, _ := s.principal("cleanup")
	pgtest.InsertExpired(t, s.pool, id, 37)
	out, err := runCommand(t, loginRole(t, s.db), "cleanup")
	if err != nil {
		t.Fatalf("server cleanup: %v", err)
	}
	if !regexp.MustCompile(`^deleted 37 expired keys in \d+\.\d+ s\n$`).MatchString(out) {
		t.Errorf("server cleanup printed %q, want how many keys it deleted (37) and how long it took", out)
	}
	if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = $1`, id); n != 0 {
		t.Errorf("%d expired keys left after server cleanup", n)
	}
}

// TestOpsKeysSummaryAsOperator: `server keys` and `server keys by-principal`, as a login role
// only in idem_operator, give the backlog and the replication line the docs show, and the
// cleanup backlog agrees with the gauge idempotency_cleanup_backlog.
func TestOpsKeysSummaryAsOperator(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	id, _ := s.principal("summary")
	pgtest.InsertExpired(t, s.pool, id, 7)
	ops := loginRoleIn(t, s.db, "idem_operator")
	for _, args := range [][]string{{"keys"}, {"keys", "by-principal"}} {
		out, err := runCommand(t, ops, args...)
		if err != nil {
			t.Fatalf("server %s as idem_operator: %v", strings.Join(args, " "), err)
		}
		if !strings.Contains(out, "cleanup backlog: 7\n") {
			t.Errorf("server %s: no backlog of 7:\n%s", strings.Join(args, " "), out)
		}
		if !regexp.MustCompile(`(?m)^replication: none, 0 standbys$`).MatchString(out) {
			t.Errorf("server %s: no replication line:\n%s", strings.Join(args, " "), out)
		}
		if len(args) == 2 && !regexp.MustCompile(`(?m)^`+regexp.QuoteMeta(id)+`\s+7\s+0\s+7\s+0\s+7\s`).MatchString(out) {
			t.Errorf("server keys by-principal: no line for %s with 7 keys, 7 completed, 7 expired:\n%s", id, out)
		}
	}
	metrics := s.call("GET", "/metrics", "", "", "").body
	if !regexp.MustCompile(`(?m)^idempotency_cleanup_backlog 7$`).MatchString(metrics) {
		t.Errorf("idempotency_cleanup_backlog is not 7:\n%s", grepLines(metrics, "idempotency_"))
	}
}

// TestOpsLogLines: "Every request logs one line with its correlation id (request_id), method,
// path, status, whether it was replayed and its duration; scrapes of /metrics and /healthz log at
// debug. A keyed request that was neither acquired nor replayed logs a line with its state, the
// action, its request_id and key_hash (12 hex digits)". Keys and tokens are never logged.
func TestOpsLogLines(t *testing.T) {
	t.Parallel()
	var log opsBuf
	db := migratedAsOwner(t)
	s := serveWith(t, db, db, nil, &log)
	_, token := s.principal("log")
	s.call("GET", "/metrics", "", "", "", "X-Request-Id", "scrape-1")
	s.call("GET", "/healthz", "", "", "", "X-Request-Id", "health-1")
	if r := s.call("POST", "/v1/accounts", token, "log-key-1", `{"name":"a","currency":"EUR"}`, "X-Request-Id", "req-1"); r.status != 201 {
		t.Fatalf("account: %+v", r)
	}
	if r := s.call("POST", "/v1/accounts", token, "log-key-1", `{"name":"b","currency":"EUR"}`, "X-Request-Id", "req-2"); r.status != 422 {
		t.Fatalf("reuse: %+v", r)
	}
	time.Sleep(100 * time.Millisecond)
	out := log.String()
	if strings.Contains(out, "scrape-1") || strings.Contains(out, "health-1") {
		t.Errorf("a scrape of /metrics or /healthz logged at info:\n%s", out)
	}
	line := regexp.MustCompile(`(?m)^.*"msg":"request".*"request_id":"req-1".*$`).FindString(out)
	for _, f := range []string{`"method":"POST"`, `"path":"/v1/accounts"`, `"status":201`, `"replayed":false`, `"duration_ms":`} {
		if !strings.Contains(line, f) {
			t.Errorf("the request's line lacks %s: %q", f, line)
		}
	}
	found := false
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, `"request_id":"req-2"`) && strings.Contains(l, "key_reused") &&
			regexp.MustCompile(`"key_hash":"[0-9a-f]{12}"`).MatchString(l) && strings.Contains(l, `"action":`) {
			found = true
		}
	}
	if !found {
		t.Errorf("no line for the reused key with its state, action, request_id and a 12-hex key_hash:\n%s", out)
	}
	if strings.Contains(out, "log-key-1") || strings.Contains(out, token) {
		t.Errorf("a key or a token was logged:\n%s", out)
	}
}

// TestOpsShutdownEndsWaitsAndWork: docs/operations.md "Shutdown": on a stop, "duplicates
// waiting for another request's answer are answered 409 at once"; the keyed work still
// running past SHUTDOWN_TIMEOUT is ended: "a transfer or deposit rolls back and stores
// nothing; ... the requests of work ended so are answered 503 `shutting_down` with
// `Retry-After`", and the stop is clean (Run returns nil).
func TestOpsShutdownEndsWaitsAndWork(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"SHUTDOWN_TIMEOUT": "2s"})
	_, token := s.principal("shutdown")
	id := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	ctx := context.Background()
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	if _, err := holder.Exec(ctx, `SELECT 1 FROM ledger.accounts WHERE id = $1 FOR UPDATE`, id); err != nil {
		t.Fatal(err)
	}
	path := fmt.Sprintf("/v1/accounts/%d/deposits", id)
	type answer struct {
		r  resp
		at time.Time
	}
	first, dup := make(chan answer, 1), make(chan answer, 1)
	go func() { r := s.call("POST", path, token, "dep", `{"amount":5}`); first <- answer{r, time.Now()} }()
	pgtest.WaitFor(t, s.pool, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()`)
	go func() { r := s.call("POST", path, token, "dep", `{"amount":5}`); dup <- answer{r, time.Now()} }()
	// The stop starts once the duplicate waits in Go for the first's answer (not after a fixed
	// pause: on a loaded machine its request may come after the stop began, and get a 503).
	for deadline := time.Now().Add(10 * time.Second); s.main.idem.GateStats().Waiting < 1; time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the duplicate never waited for the first's answer")
		}
	}
	began := time.Now()
	stopped := make(chan error, 1)
	go func() { stopped <- s.shutdown() }()

	d := <-dup
	if d.r.status != 409 || d.at.Sub(began) > time.Second {
		t.Errorf("the waiting duplicate: %d after %s, want 409 at once (%s)", d.r.status, d.at.Sub(began), d.r.body)
	}
	f := <-first
	if f.r.status != 503 || !strings.Contains(f.r.body, "shutting_down") || f.r.header.Get("Retry-After") == "" {
		t.Errorf("the deposit ended by the shutdown timeout: %d %q Retry-After %q, want 503 shutting_down with Retry-After",
			f.r.status, f.r.body, f.r.header.Get("Retry-After"))
	}
	if err := <-stopped; err != nil {
		t.Errorf("a stop that reached the timeout returned %v, want a clean stop", err)
	}
	_ = holder.Rollback(ctx)
	if n := s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, id); n != 0 {
		t.Errorf("balance %d: the deposit ended at shutdown did not roll back", n)
	}
	if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = 'dep'`); n != 0 {
		t.Errorf("the deposit ended at shutdown stored its key (%d rows)", n)
	}
}

// TestOpsKeyTableSettings: the numbers docs/operations.md gives for the key table: created
// with fillfactor = 95, vacuum_truncate off, and an autovacuum threshold of "50 + 2% with the
// table's settings".
func TestOpsKeyTableSettings(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	var opts []string
	if err := s.pool.QueryRow(context.Background(),
		`SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = 'idem.idempotency_keys'::regclass`).Scan(&opts); err != nil {
		t.Fatal(err)
	}
	has := map[string]string{}
	for _, o := range opts {
		k, v, _ := strings.Cut(o, "=")
		has[k] = v
	}
	if has["fillfactor"] != "95" {
		t.Errorf("fillfactor %q, docs: 95 (%v)", has["fillfactor"], opts)
	}
	if has["vacuum_truncate"] != "false" {
		t.Errorf("vacuum_truncate %q, docs: off (%v)", has["vacuum_truncate"], opts)
	}
	if has["autovacuum_vacuum_scale_factor"] != "0.02" {
		t.Errorf("autovacuum_vacuum_scale_factor %q, docs: 2%% (%v)", has["autovacuum_vacuum_scale_factor"], opts)
	}
	threshold := has["autovacuum_vacuum_threshold"]
	if threshold == "" {
		var v string
		_ = s.pool.QueryRow(context.Background(), `SELECT current_setting('autovacuum_vacuum_threshold')`).Scan(&v)
		threshold = v
	}
	if threshold != "50" {
		t.Errorf("autovacuum_vacuum_threshold %q, docs: 50", threshold)
	}
}

// TestOpsServerCleanupByTheOwnerVacuums: docs/operations.md, "PostgreSQL settings for the key
// table": "`server cleanup` run by the owner vacuums as the server does". The page had listed
// it among the cleanups that leave the space to autovacuum.
func TestOpsServerCleanupByTheOwnerVacuums(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	id, _ := s.principal("vacuum")
	pgtest.InsertExpired(t, s.pool, id, 300)
	before := s.count(`SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'idem.idempotency_keys'::regclass`)
	if out, err := runCommand(t, s.db, "cleanup"); err != nil || !strings.HasPrefix(out, "deleted 300 ") {
		t.Fatalf("server cleanup: %v %q", err, out)
	}
	pgtest.WaitFor(t, s.pool, `SELECT count(*) FROM pg_stat_user_tables
		WHERE relid = 'idem.idempotency_keys'::regclass AND vacuum_count > $1`, before)
}

// TestOpsShutdownGivesAPayoutsLeaseUp: "a payout gives its lease up at once ..., so the
// client's retry runs it again under the same provider key instead of waiting for the lease to
// run out; the requests of work ended so are answered 503 `shutting_down` with `Retry-After`".
func TestOpsShutdownGivesAPayoutsLeaseUp(t *testing.T) {
	t.Parallel()
	env := map[string]string{"SHUTDOWN_TIMEOUT": "500ms", "PAYOUTS_LEASE": "30s", "PAYOUT_PROVIDER_DELAY": "3s"}
	s := startServer(t, env)
	_, token := s.principal("payout")
	id := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "dep", `{"amount":100}`); r.status != 201 {
		t.Fatalf("deposit: %+v", r)
	}
	body := fmt.Sprintf(`{"account":%d,"amount":10}`, id)
	first := make(chan resp, 1)
	go func() { first <- s.call("POST", "/v1/payouts", token, "pay", body) }()
	pgtest.WaitFor(t, s.pool, `SELECT count(*) FROM provider.payouts`)
	if err := s.shutdown(); err != nil {
		t.Errorf("shutdown: %v", err)
	}
	r := <-first
	if r.status != 503 || !strings.Contains(r.body, "shutting_down") || r.header.Get("Retry-After") == "" {
		t.Errorf("the payout ended at shutdown: %d %q Retry-After %q, want 503 shutting_down with Retry-After", r.status, r.body, r.header.Get("Retry-After"))
	}
	next := serveOn(t, s.db, map[string]string{"PAYOUTS_LEASE": "30s", "PAYOUT_PROVIDER_DELAY": "3s"})
	began := time.Now()
	r2 := next.call("POST", "/v1/payouts", token, "pay", body)
	if r2.status != 201 || time.Since(began) > 10*time.Second {
		t.Errorf("the retry on the next server: %d after %s (%s), want 201 without waiting out the 30 s lease", r2.status, time.Since(began), r2.body)
	}
	if n := next.count(`SELECT count(*) FROM provider.payouts`); n != 1 {
		t.Errorf("%d payouts at the provider, want one: the retry must run under the same provider key", n)
	}
}
