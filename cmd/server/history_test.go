package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptrace"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/history"
	"github.com/pgidem/pgidem/internal/pgcluster"
)

// The reference server as a black box: real clients send keyed deposits, transfers and payouts
// over HTTP to the server binary, which reaches its own PostgreSQL cluster through a fault
// proxy; the server is killed and restarted, PostgreSQL restarted and crashed, the key table
// locked. Every request and what it got is checked against the model of the contract
// (internal/history), with the effects found afterwards: ledger rows per key, and the
// simulated provider's payout per provider key.

// httpTTL and httpLease are the server's IDEMPOTENCY_TTL and PAYOUTS_LEASE for the run: short,
// so that keys expire (and are used again) while it runs.
const (
	httpTTL   = 2 * time.Second
	httpLease = time.Second
)

type httpHarness struct {
	t      testing.TB
	base   string
	client *http.Client
	db     *pgxpool.Pool // straight to the cluster, for the effects
	users  []httpUser
	// ttl and lease are the server's IDEMPOTENCY_TTL and PAYOUTS_LEASE.
	ttl, lease time.Duration

	mu sync.Mutex
	// pks are the provider keys the answers under each key reported; refs what the provider
	// said of each provider key (kept from before every restart of the server, whose
	// simulated provider forgets on a restart until it is durable).
	pks  map[string]map[string]bool
	refs map[string]map[string]bool
}

type httpUser struct {
	id, token string
	accounts  []int64
}

// httpKey is what a key's requests do: which route, whose token, which accounts.
type httpKey struct {
	kind string // deposit, transfer, payout
	user httpUser
	a, b int64
}

type httpPayload struct {
	path, body string
}

func (h *httpHarness) NewKey(rng *rand.Rand, name string, route history.Route) history.Key {
	u := h.users[rng.IntN(len(h.users))]
	i := rng.IntN(len(u.accounts))
	j := (i + 1 + rng.IntN(len(u.accounts)-1)) % len(u.accounts)
	kind := "payout"
	if route == history.Transactional {
		kind = []string{"deposit", "transfer"}[rng.IntN(2)]
	}
	return history.Key{Principal: u.id, Name: name, Route: route, TTL: h.ttl, Lease: h.lease,
		Data: httpKey{kind: kind, user: u, a: u.accounts[i], b: u.accounts[j]}}
}

func (h *httpHarness) Request(k history.Key, variant int) history.Request {
	d := k.Data.(httpKey)
	var p httpPayload
	switch d.kind {
	case "deposit":
		p = httpPayload{fmt.Sprintf("/v1/accounts/%d/deposits", d.a), fmt.Sprintf(`{"amount":%d}`, 10*(variant+1))}
	case "transfer":
		// The second variant is more than the account holds at times: a final 422, stored.
		p = httpPayload{"/v1/transfers", fmt.Sprintf(`{"from":%d,"to":%d,"amount":%d}`, d.a, d.b, []int{40, 9000}[variant%2])}
	default:
		p = httpPayload{"/v1/payouts", fmt.Sprintf(`{"account":%d,"amount":%d}`, d.a, []int{100, 250000}[variant%2])}
	}
	return history.Request{Key: k, Variant: variant, Fingerprint: "POST " + p.path + " " + p.body,
		Text: "POST " + strings.TrimPrefix(p.path, "/v1/") + " " + p.body, Payload: p}
}

func (h *httpHarness) Send(ctx context.Context, c int, r history.Request) history.Output {
	p := r.Payload.(httpPayload)
	d := r.Key.Data.(httpKey)
	req, err := http.NewRequestWithContext(ctx, "POST", h.base+p.path, strings.NewReader(p.body))
	if err != nil {
		h.t.Errorf("request: %v", err)
		return history.Output{Outcome: history.Failed, Note: err.Error()}
	}
	req.Header.Set("Authorization", "Bearer "+d.user.token)
	req.Header.Set("Idempotency-Key", r.Key.Name)
	req.Header.Set("Content-Type", "application/json")
	// net/http sends a request with an Idempotency-Key again on a new connection when a reused
	// one fails, so the last error may be a refused dial after an attempt that reached the
	// server: only a request none of whose attempts wrote its headers was not sent.
	var wrote atomic.Bool
	req = req.WithContext(httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{WroteHeaders: func() { wrote.Store(true) }}))
	res, err := h.client.Do(req)
	switch {
	case err != nil && !wrote.Load():
		return history.Output{Outcome: history.NotSent, Note: err.Error()}
	case err != nil:
		return history.Output{Outcome: history.Unknown, Note: err.Error()}
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		return history.Output{Outcome: history.Unknown, Status: res.StatusCode, Note: "reading the body: " + err.Error()}
	}
	body := string(b)
	var problem struct {
		Code        string `json:"code"`
		ID          int64  `json:"id"`
		ProviderRef string `json:"provider_ref"`
		ProviderKey string `json:"provider_key"`
	}
	_ = json.Unmarshal(b, &problem)
	replayed := res.Header.Get("Idempotent-Replayed") == "true"
	out := history.Output{Status: res.StatusCode, Body: body, Note: problem.Code, Headers: storedHeaders(res.Header)}
	if secs, err := strconv.Atoi(res.Header.Get("Retry-After")); err == nil && secs >= 0 {
		out.RetryAfter = time.Duration(secs) * time.Second
	}
	switch {
	case res.StatusCode == http.StatusUnprocessableEntity && problem.Code == "idempotency_key_reuse":
		out.Outcome = history.Mismatch
	case res.StatusCode == http.StatusConflict && problem.Code == "request_in_progress":
		out.Outcome = history.Busy
	case res.StatusCode >= 500:
		out.Outcome = history.Failed
	case replayed:
		out.Outcome = history.Replayed
	default:
		out.Outcome = history.Answered
	}
	if (out.Outcome == history.Answered || out.Outcome == history.Replayed) && res.StatusCode/100 == 2 {
		switch d.kind {
		case "payout":
			out.Effect, out.ProviderKey = "payout "+problem.ProviderRef, problem.ProviderKey
			h.mu.Lock()
			if h.pks[r.Key.String()] == nil {
				h.pks[r.Key.String()] = map[string]bool{}
			}
			h.pks[r.Key.String()][problem.ProviderKey] = true
			h.mu.Unlock()
			h.remember(problem.ProviderKey)
		default:
			out.Effect = fmt.Sprintf("%s %d", d.kind, problem.ID)
		}
	}
	return out
}

// storedHeaders are the headers of an answer that its replays must send again (the stored
// ones the server's handlers set: Location, ETag), canonical.
func storedHeaders(h http.Header) string {
	var parts []string
	for _, name := range []string{"Location", "ETag"} {
		if v := h.Values(name); len(v) > 0 {
			parts = append(parts, name+": "+strings.Join(v, ", "))
		}
	}
	return strings.Join(parts, "; ")
}

// Stored is the answer stored under the key, straight from the key table (a
// history.StoreWatcher: the liveness check learns when an answer no client got fresh was
// stored).
func (h *httpHarness) Stored(ctx context.Context, k history.Key) (int, string, bool, error) {
	var status int32
	var body []byte
	err := h.db.QueryRow(ctx, `SELECT response_status, response_body FROM idem.idempotency_keys
		WHERE principal_id = $1 AND key = $2 AND state = 'c'`, k.Principal, k.Name).Scan(&status, &body)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, "", false, nil
	}
	return int(status), string(body), err == nil, err
}

// provider asks the simulated provider what it knows of a provider key: its payout's
// reference, or "". It reads the provider's own records (provider.payouts), as the provider
// would answer its merchant: GET /v1/provider/calls answers a principal about its own payouts
// only, and the harness asks about every principal's.
func (h *httpHarness) provider(ctx context.Context, pk string) (string, error) {
	var ref string
	err := h.db.QueryRow(ctx, `SELECT ref FROM provider.payouts WHERE idempotency_key = $1`, pk).Scan(&ref)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("provider calls for %s: %w", pk, err)
	}
	return ref, nil
}

// remember records what the provider knows of a provider key now. Until the simulated provider
// is durable (issue 28), a restart of the server forgets every payout; so the provider is
// asked right after every answer that names a provider key, before every kill and at the end,
// and what it said once is kept.
func (h *httpHarness) remember(pk string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if ref, err := h.provider(ctx, pk); err == nil && ref != "" {
		h.note(pk, ref)
	}
}

// note records that the provider named ref for pk (a restart of today's provider may name
// another later: every one is kept).
func (h *httpHarness) note(pk, ref string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.refs[pk] == nil {
		h.refs[pk] = map[string]bool{}
	}
	h.refs[pk][ref] = true
}

// snapshot records what the provider knows of every provider key seen so far.
func (h *httpHarness) snapshot(ctx context.Context) {
	h.mu.Lock()
	var pks []string
	for _, set := range h.pks {
		for pk := range set {
			pks = append(pks, pk)
		}
	}
	h.mu.Unlock()
	for _, pk := range pks {
		if ref, err := h.provider(ctx, pk); err == nil && ref != "" {
			h.note(pk, ref)
		}
	}
}

func (h *httpHarness) Observe(ctx context.Context, k history.Key) ([]string, error) {
	d := k.Data.(httpKey)
	var sql string
	switch d.kind {
	case "deposit":
		sql = `SELECT 'deposit ' || id FROM ledger.deposits WHERE idempotency_key = $1 AND $2 <> ''`
	case "transfer":
		sql = `SELECT 'transfer ' || id FROM ledger.transfers WHERE idempotency_key = $1 AND principal_id = $2`
	default:
		h.snapshot(ctx)
		h.mu.Lock()
		defer h.mu.Unlock()
		var effects []string
		for pk := range h.pks[k.String()] {
			for ref := range h.refs[pk] {
				effects = append(effects, "payout "+ref)
			}
		}
		return effects, nil
	}
	rows, err := h.db.Query(ctx, sql, k.Name, k.Principal)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// ledgerCluster starts a private cluster with the database "ledger" migrated, and a pool that
// reaches it directly (closed when the test ends).
func ledgerCluster(t *testing.T) (*history.Cluster, *pgxpool.Pool) {
	t.Helper()
	c := history.StartCluster(t)
	c.CreateDB(t, "ledger")
	mig := NewMain(io.Discard, io.Discard)
	if err := mig.ParseFlags([]string{"migrate"}, serverEnv(c.URL("ledger"), nil)); err != nil {
		t.Fatal(err)
	}
	if err := mig.Run(context.Background()); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	_ = mig.Close()
	db, err := pgxpool.New(context.Background(), c.URL("ledger"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	return c, db
}

// newHTTPHarness is the harness of the server at base (its TTL and payouts lease), with two
// principals (alice, bob) of four accounts each, funded.
func newHTTPHarness(t *testing.T, base string, db *pgxpool.Pool, ttl, lease time.Duration) *httpHarness {
	t.Helper()
	return newHTTPHarnessOf(t, base, db, ttl, lease, 4)
}

// newHTTPHarnessOf is newHTTPHarness with perUser accounts for each principal.
func newHTTPHarnessOf(t *testing.T, base string, db *pgxpool.Pool, ttl, lease time.Duration, perUser int) *httpHarness {
	t.Helper()
	ctx := context.Background()
	h := &httpHarness{t: t, base: base, db: db, ttl: ttl, lease: lease, pks: map[string]map[string]bool{},
		refs: map[string]map[string]bool{}, client: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}}
	for _, name := range []string{"alice", "bob"} {
		id, token, err := createPrincipal(ctx, db, name)
		if err != nil {
			t.Fatal(err)
		}
		u := httpUser{id: id, token: token}
		for i := range perUser {
			var account int64
			if err := db.QueryRow(ctx, `INSERT INTO ledger.accounts (principal_id, name, currency, balance) VALUES ($1, $2, 'EUR', 5000)
				RETURNING id`, id, fmt.Sprintf("a%d", i)).Scan(&account); err != nil {
				t.Fatal(err)
			}
			if _, err := db.Exec(ctx, `INSERT INTO ledger.deposits (account_id, amount) VALUES ($1, 5000)`, account); err != nil {
				t.Fatal(err)
			}
			u.accounts = append(u.accounts, account)
		}
		h.users = append(h.users, u)
	}
	return h
}

// TestHTTPHistory: the reference server through every fault, checked against the model. See
// docs/testing.md for the long run (make check-history) and how to read a violation.
func TestHTTPHistory(t *testing.T) {
	t.Parallel()
	mode := history.ModeFromEnv(250, 8*time.Second, 10)
	bin := serverBinary(t)
	c, db := ledgerCluster(t)
	ctx := context.Background()

	proxy := history.NewProxy(t, c.Addr())
	port, err := pgcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	p := &process{t: t, bin: bin, addr: fmt.Sprintf("127.0.0.1:%d", port), env: append(os.Environ(),
		"DATABASE_URL="+history.Via(proxy.Addr(), "ledger"), "LISTEN_ADDR="+fmt.Sprintf("127.0.0.1:%d", port),
		"IDEMPOTENCY_TTL="+httpTTL.String(), "IDEMPOTENCY_LOCK_TIMEOUT=300ms", "PAYOUTS_LEASE="+httpLease.String(),
		"PAYOUT_PROVIDER_DELAY=150ms", "CLEANUP_INTERVAL=1s", "LOG_LEVEL=error", "DATABASE_POOL_SIZE=8",
		// Duplicates wait for the answer only briefly (the default is 10 s), so that some are
		// still told 409 while the work runs: the model must see both; TestHTTPLiveness runs
		// the default.
		"IDEMPOTENCY_DUPLICATE_WAIT=50ms")}
	p.start()
	defer p.kill()

	h := newHTTPHarness(t, "http://"+p.addr, db, httpTTL, httpLease)

	hist := history.New()
	inj := history.NewInjector(hist)
	inj.ProxyFaults(proxy)
	inj.LockFault(c.URL("ledger"))
	inj.Add("server-kill", func(ctx context.Context, rng *rand.Rand) (string, error) {
		h.snapshot(ctx)
		p.kill()
		down := time.Duration(rng.IntN(500)) * time.Millisecond
		time.Sleep(down)
		return fmt.Sprintf("SIGKILL, restarted after %s", down), p.startErr()
	})
	inj.RestartFault(c)
	if mode.Long { // a failover to a synchronous standby (docs/testing.md); the server never cancels a commit for its client
		c.WithStandby(t)
		inj.PromotionFault(c)
	}
	runner := &history.Runner{H: hist, Harness: h, Mode: mode, Also: inj.Covered, OpTimeout: 2500 * time.Millisecond,
		Scenarios: []history.Scenario{
			history.Expiry(history.Leased, 3), history.Storm(history.Transactional, 3), history.Storm(history.Leased, 3),
			history.Changed(history.Transactional, 2), history.Changed(history.Leased, 2),
			history.Hangup(history.Transactional, 2), history.Hangup(history.Leased, 2), history.Expiry(history.Transactional, 2),
			history.ExpiryEdge(history.Transactional, 0, 0, 1), history.ExpiryEdge(history.Leased, 0, 0, 1),
		}}
	t.Logf("seed %d (HISTORY_SEED), at least %d operations and %s", mode.Seed, mode.Ops, mode.Duration)
	runCtx, cancel := context.WithTimeout(ctx, mode.Duration*10+5*time.Minute)
	defer cancel()
	// The scheduled cleaner's interval is a second at least: the test cleans up every 100 ms
	// itself, straight to the cluster, so that a key deleted before its expiry shows.
	cleanCtx, stopCleanup := context.WithCancel(runCtx)
	cleanups := history.CleanupEvery(cleanCtx, db, 100*time.Millisecond)
	// First, without faults, the scenarios that probe the bounds (a key's expiry, replays of
	// the stored status and headers, a changed body), so that every run probes them.
	runner.Quiet(runCtx, history.ExpiryEdge(history.Transactional, 0, 0, 0), history.ExpiryEdge(history.Leased, 0, 0, 0),
		history.ExpiryEdge(history.Transactional, 0, 0, 0), history.ExpiryEdge(history.Leased, 0, 0, 0),
		history.Storm(history.Transactional, 0), history.Storm(history.Leased, 0), history.Changed(history.Transactional, 0),
		history.Changed(history.Leased, 0))
	faultCtx, stopFaults := context.WithCancel(runCtx)
	faultErr := make(chan error, 1)
	go func() {
		faultErr <- inj.Run(faultCtx, mode.Seed, func(rng *rand.Rand) time.Duration {
			return time.Duration(200+rng.IntN(500)) * time.Millisecond
		})
	}()
	runner.Run(runCtx)
	stopFaults()
	stopCleanup()
	if err := <-faultErr; err != nil {
		t.Fatalf("%v", err)
	}
	// Settle: leases run out and their answers are recorded (a completion is retried for up to
	// a lease), killed servers' transactions are rolled back.
	time.Sleep(2*httpLease + 500*time.Millisecond)
	for i := 0; ; i++ {
		var n int
		err := db.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND state LIKE 'idle in transaction%'`).Scan(&n)
		if err == nil && n == 0 {
			break
		}
		if i > 300 {
			t.Fatalf("transactions left open: %d (%v)", n, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	hist.Close()
	if err := runner.Observe(ctx); err != nil {
		t.Fatal(err)
	}
	history.Verify(t, hist, t.Name())
	t.Logf("scenarios: %v", runner.Ran())

	var bad int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM ledger.accounts a WHERE a.balance <>
		  (SELECT coalesce(sum(amount), 0) FROM ledger.deposits d WHERE d.account_id = a.id)
		+ (SELECT coalesce(sum(amount), 0) FROM ledger.transfers t WHERE t.to_id = a.id)
		- (SELECT coalesce(sum(amount), 0) FROM ledger.transfers t WHERE t.from_id = a.id)`).Scan(&bad); err != nil || bad != 0 {
		t.Errorf("%d balances disagree with their operations (%v)", bad, err)
	}
	outcomes, faults := hist.Counts()
	// At least: enough of each for the model to have something to check; on a loaded machine
	// (two cores, the other packages' tests beside it) a short run completes fewer operations.
	history.Require(t, "the outcome", outcomes, map[string]int{"2xx": 20, "replayed": 10, "mismatch": 3, "busy": 1})
	history.Require(t, "the fault", faults, map[string]int{"cut": 1, "latency": 1, "stall": 1, "table-lock": 1,
		"server-kill": 1, "pg-restart": 1})
	history.Require(t, "the scenario", runner.Ran(), map[string]int{"expiry lease": 1, "storm tx": 1, "storm lease": 1,
		"hang-up tx": 1, "hang-up lease": 1, "changed body lease": 1, "expiry edge tx": 2, "expiry edge lease": 2})
	events := runner.Events()
	t.Logf("edges: %v; cleanup passes %d", events, cleanups())
	history.Require(t, "the edge", map[string]int{"expiry probed before the edge tx": events["expiry probed before the edge tx"],
		"expiry probed before the edge lease": events["expiry probed before the edge lease"], "cleanup pass": int(cleanups())},
		map[string]int{"expiry probed before the edge tx": 1, "expiry probed before the edge lease": 1, "cleanup pass": 20})
}
