package history

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The SQL API called directly, from several connections, as a service in another language
// would: idem_begin (transactional and lease claims), the work, idem_complete, idem_release;
// leases left to run out and taken over, by a lease claim or by a transactional one.

// historySchema is the test's own effects: a row per transactional effect (written in the
// claim's transaction) and a simulated provider that deduplicates by provider key (written on
// its own, as an outside system would), with references unique across restarts.
const historySchema = `
CREATE SCHEMA hist;
CREATE TABLE hist.effects (id bigserial PRIMARY KEY, principal text NOT NULL, key text NOT NULL,
	fingerprint text NOT NULL, attempt bigint NOT NULL);
CREATE SEQUENCE hist.refs;
-- The rows of stepped work (idem.Step), one per step done, with its generation's provider key.
CREATE TABLE hist.steps (id bigserial PRIMARY KEY, principal text NOT NULL, key text NOT NULL, pk text NOT NULL,
	step text NOT NULL);
CREATE TABLE hist.provider (pk text PRIMARY KEY, principal text NOT NULL, key text NOT NULL,
	ref text NOT NULL, calls integer NOT NULL DEFAULT 1);
-- A slow COMMIT, half the time: a deferred trigger on the effects sleeps 100 ms at COMMIT, so
-- that the commit-kill fault can end a backend while its COMMIT runs (before it commits).
CREATE FUNCTION hist.slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF random() < 0.5 THEN
		PERFORM pg_sleep(0.1);
	END IF;
	RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON hist.effects DEFERRABLE INITIALLY DEFERRED
	FOR EACH ROW EXECUTE FUNCTION hist.slow_commit();`

// providerCall pays at the test's provider under a provider key and returns the payout's
// reference: the first call makes the payout, later ones with the key answer it.
const providerCall = `INSERT INTO hist.provider AS p (pk, principal, key, ref) VALUES ($1, $2, $3, 'po_' || nextval('hist.refs'))
	ON CONFLICT (pk) DO UPDATE SET calls = p.calls + 1 RETURNING p.ref`

// beginSQL claims a key; to_jsonb(b)->>'provider_key' is the claim's provider key once
// idem_begin has that column, NULL before.
const beginSQL = `SELECT b.outcome, b.attempt, b.response_status, b.response_headers::text, b.response_body,
	to_jsonb(b) ->> 'provider_key', extract(epoch FROM b.retry_after)::float8
	FROM idem.idem_begin(p_principal => $1, p_key => $2, p_action => $3, p_request_sha256 => $4,
	                     p_ttl => $5::interval, p_lease => $6::interval, p_lock_timeout => '300 milliseconds') AS b`

// sqlProviderKey is the provider key of a claim as the SQL API reports it (idem_begin's
// provider_key: set for claimed, replay and in_progress; NULL for a mismatch, which has none).
func sqlProviderKey(reported *string, principal, key string) string {
	if reported != nil {
		return *reported
	}
	return ""
}

type sqlHarness struct {
	url     string // through the proxy
	observe *pgxpool.Pool

	mu    sync.Mutex
	conns map[int]*pgx.Conn
}

type sqlPayload struct {
	action string
	body   string
	// payOnHold: a lease left held calls the provider first (half the time), so that a
	// generation may have an effect nobody saw named.
	payOnHold bool
}

func (h *sqlHarness) NewKey(rng *rand.Rand, name string, route Route) Key {
	return Key{Principal: []string{"alice", "bob"}[rng.IntN(2)], Name: name, Route: route, TTL: 2 * time.Second, Lease: time.Second}
}

func (h *sqlHarness) Request(k Key, variant int) Request {
	p := sqlPayload{action: "POST /v1/notes", body: fmt.Sprintf(`{"amount":%d}`, 100*(variant+1))}
	return Request{Key: k, Variant: variant, Fingerprint: p.action + " " + p.body,
		Text: fmt.Sprintf("amount=%d", 100*(variant+1)), Payload: p}
}

func (h *sqlHarness) conn(ctx context.Context, c int) (*pgx.Conn, error) {
	h.mu.Lock()
	conn := h.conns[c]
	h.mu.Unlock()
	if conn != nil && !conn.IsClosed() {
		return conn, nil
	}
	cfg, err := pgx.ParseConfig(h.url)
	if err != nil {
		return nil, err
	}
	conn, err = pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	h.mu.Lock()
	h.conns[c] = conn
	h.mu.Unlock()
	return conn, nil
}

// drop closes client c's connection after an error: the next operation connects again.
func (h *sqlHarness) drop(c int) {
	h.mu.Lock()
	conn := h.conns[c]
	delete(h.conns, c)
	h.mu.Unlock()
	if conn != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		_ = conn.Close(ctx)
	}
}

// forget takes conn out of the harness's connections without closing it.
func (h *sqlHarness) forget(conn *pgx.Conn) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for c, held := range h.conns {
		if held == conn {
			delete(h.conns, c)
		}
	}
}

func (h *sqlHarness) closeAll() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for c, conn := range h.conns {
		_ = conn.Close(context.Background())
		delete(h.conns, c)
	}
}

func sqlState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// attemptHeaders are the headers an attempt stores with its answer: its token, so that a
// replay says which attempt stored the answer (as jsonb prints them, which a replay returns).
func attemptHeaders(attempt int64) string { return fmt.Sprintf(`{"x-attempt": "%d"}`, attempt) }

// attemptOf is the attempt named in a stored body ("attempt"), 0 when none.
func attemptOf(body []byte) int64 {
	var b struct {
		Attempt int64 `json:"attempt"`
	}
	_ = json.Unmarshal(body, &b)
	return b.Attempt
}

// work sleeps what the request asks its work to take (Request.Work), else a draw in [min, min+spread).
func work(ctx context.Context, r Request, min, spread time.Duration) error {
	d := r.Work
	if d == 0 {
		if spread <= 0 {
			return nil
		}
		d = min + time.Duration(rand.Int64N(int64(spread)))
	}
	select {
	case <-time.After(d):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func effectOf(body []byte) string {
	var b struct {
		Effect int64  `json:"effect"`
		Ref    string `json:"ref"`
	}
	_ = json.Unmarshal(body, &b)
	switch {
	case b.Effect != 0:
		return fmt.Sprintf("row %d", b.Effect)
	case b.Ref != "":
		return "payout " + b.Ref
	}
	return ""
}

func (h *sqlHarness) Send(ctx context.Context, c int, r Request) Output {
	conn, err := h.conn(ctx, c)
	if err != nil {
		return Output{Outcome: NotSent, Note: "connect: " + err.Error()}
	}
	route := r.Key.Route
	if r.RouteSet {
		route = r.Route
	}
	var out Output
	if route == Transactional {
		out = h.tx(ctx, conn, r)
	} else {
		out = h.lease(ctx, conn, r)
	}
	if out.Outcome == Failed || out.Outcome == Unknown {
		h.drop(c)
	}
	return out
}

type claimRow struct {
	outcome  string
	attempt  int64
	status   *int32
	headers  *string
	body     []byte
	reported *string
	retry    *float64 // retry_after in seconds
}

func (h *sqlHarness) begin(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, r Request, lease time.Duration) (claimRow, error) {
	p := r.Payload.(sqlPayload)
	sum := sha256.Sum256([]byte(p.action + "\n" + p.body))
	var leaseArg *string
	if lease > 0 {
		s := fmt.Sprintf("%d milliseconds", lease.Milliseconds())
		leaseArg = &s
	}
	var row claimRow
	err := q.QueryRow(ctx, beginSQL, r.Key.Principal, r.Key.Name, p.action, sum[:],
		fmt.Sprintf("%d milliseconds", r.Key.TTL.Milliseconds()), leaseArg).
		Scan(&row.outcome, &row.attempt, &row.status, &row.headers, &row.body, &row.reported, &row.retry)
	return row, err
}

// decided is the output of a claim that was not claimed.
func decided(row claimRow, pk string) Output {
	switch row.outcome {
	case "replay":
		out := Output{Outcome: Replayed, Status: int(*row.status), Body: string(row.body), Effect: effectOf(row.body), ProviderKey: pk,
			Attempt: attemptOf(row.body)}
		if row.headers != nil {
			out.Headers = *row.headers
		}
		return out
	case "mismatch":
		return Output{Outcome: Mismatch}
	case "in_progress":
		out := Output{Outcome: Busy, Note: "in_progress"}
		if row.retry != nil && *row.retry > 0 {
			// Only a live lease is in_progress to another session: evidence of it.
			out.Live, out.LiveFor = true, time.Duration(*row.retry*float64(time.Second))
		}
		return out
	}
	return Output{Outcome: Failed, Note: "outcome " + row.outcome}
}

// tx: BEGIN, idem_begin (transactional), the effect row, idem_complete, COMMIT.
func (h *sqlHarness) tx(ctx context.Context, conn *pgx.Conn, r Request) Output {
	failed := func(err error, committing bool) Output {
		if committing || ctx.Err() != nil {
			return Output{Outcome: Unknown, Note: err.Error()}
		}
		return Output{Outcome: Failed, Note: err.Error()}
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		return failed(err, false)
	}
	detached := false // the COMMIT went on without this operation: it owns the connection
	defer func() {
		if !detached {
			_ = tx.Rollback(context.Background())
		}
	}()
	row, err := h.begin(ctx, tx, r, 0)
	if sqlState(err) == "55P03" {
		return Output{Outcome: Busy, Note: "lock timeout"}
	}
	if err != nil {
		return failed(err, false)
	}
	pk := sqlProviderKey(row.reported, r.Key.Principal, r.Key.Name)
	if row.outcome != "claimed" {
		return decided(row, pk)
	}
	var id int64
	if err := tx.QueryRow(ctx, `INSERT INTO hist.effects (principal, key, fingerprint, attempt) VALUES ($1, $2, $3, $4) RETURNING id`,
		r.Key.Principal, r.Key.Name, r.Fingerprint, row.attempt).Scan(&id); err != nil {
		return failed(err, false)
	}
	if err := work(ctx, r, 0, 0); err != nil { // the claim and the answer apart
		return failed(err, false)
	}
	body := fmt.Sprintf(`{"effect":%d,"attempt":%d,"request":%q}`, id, row.attempt, r.Text)
	headers := attemptHeaders(row.attempt)
	sent := time.Now()
	if _, err := tx.Exec(ctx, `SELECT idem.idem_complete(p_principal => $1, p_key => $2, p_attempt => $3, p_status => 201,
		p_headers => $5::jsonb, p_body => $4)`, r.Key.Principal, r.Key.Name, row.attempt, []byte(body), headers); err != nil {
		return failed(err, false)
	}
	// COMMIT as the library sends it (dbidem.RunTx): on a context that never ends, so that no
	// cancel request reaches a COMMIT waiting for the synchronous standby (docs/DECISIONS.md,
	// D108). When the operation's time ends first its outcome is unknown, and the COMMIT goes
	// on with the connection, which is closed once PostgreSQL answers.
	committed := make(chan error, 1)
	go func() { committed <- tx.Commit(context.WithoutCancel(ctx)) }()
	select {
	case err := <-committed:
		if err != nil {
			return failed(err, true)
		}
	case <-ctx.Done():
		detached = true
		h.forget(conn)
		go func() {
			<-committed
			_ = conn.Close(context.Background())
		}()
		return failed(ctx.Err(), true)
	}
	return Output{Outcome: Answered, Status: 201, Body: body, Headers: headers, Effect: fmt.Sprintf("row %d", id), ProviderKey: pk,
		StoreSent: sent, Attempt: row.attempt}
}

// lease: idem_begin with a lease (committed on its own), the provider, the work, then
// idem_complete; or the lease left held, or released, as the request asks.
func (h *sqlHarness) lease(ctx context.Context, conn *pgx.Conn, r Request) Output {
	unknown := func(err error) Output { return Output{Outcome: Unknown, Note: err.Error()} }
	row, err := h.begin(ctx, conn, r, r.Key.Lease)
	if sqlState(err) == "55P03" {
		return Output{Outcome: Busy, Note: "lock timeout"}
	}
	if err != nil {
		return unknown(err) // the claim may have committed
	}
	pk := sqlProviderKey(row.reported, r.Key.Principal, r.Key.Name)
	if row.outcome != "claimed" {
		return decided(row, pk)
	}
	pay := func() (string, error) {
		var ref string
		err := conn.QueryRow(ctx, providerCall, pk, r.Key.Principal, r.Key.Name).Scan(&ref)
		return ref, err
	}
	switch {
	case r.Hold:
		if r.Payload.(sqlPayload).payOnHold && rand.IntN(2) == 0 {
			if _, err := pay(); err != nil {
				return unknown(err)
			}
		}
		return Output{Outcome: Held, ProviderKey: pk, Note: fmt.Sprintf("attempt %d left to run out", row.attempt)}
	case r.Release:
		if rand.IntN(2) == 0 {
			if _, err := pay(); err != nil {
				return unknown(err)
			}
		}
		var ok bool
		if err := conn.QueryRow(ctx, `SELECT idem.idem_release(p_principal => $1, p_key => $2, p_attempt => $3)`,
			r.Key.Principal, r.Key.Name, row.attempt).Scan(&ok); err != nil {
			return unknown(err)
		}
		if !ok {
			return Output{Outcome: Lost, ProviderKey: pk, Note: "release: no claim with this attempt"}
		}
		return Output{Outcome: Released, ProviderKey: pk}
	}
	ref, err := pay()
	if err != nil {
		return unknown(err)
	}
	if err := work(ctx, r, 20*time.Millisecond, 150*time.Millisecond); err != nil {
		return unknown(err)
	}
	body := fmt.Sprintf(`{"ref":%q,"provider_key":%q,"attempt":%d,"request":%q}`, ref, pk, row.attempt, r.Text)
	headers := attemptHeaders(row.attempt)
	sent := time.Now()
	_, err = conn.Exec(ctx, `SELECT idem.idem_complete(p_principal => $1, p_key => $2, p_attempt => $3, p_status => 201,
		p_headers => $5::jsonb, p_body => $4)`, r.Key.Principal, r.Key.Name, row.attempt, []byte(body), headers)
	switch {
	case sqlState(err) == "55000":
		// Refused, and never retried: this attempt's answer is not stored.
		return Output{Outcome: Lost, ProviderKey: pk, Note: "complete: taken over", Attempt: row.attempt, Fenced: true}
	case err != nil:
		return unknown(err)
	}
	return Output{Outcome: Answered, Status: 201, Body: body, Headers: headers, Effect: "payout " + ref, ProviderKey: pk,
		StoreSent: sent, Attempt: row.attempt}
}

func (h *sqlHarness) Observe(ctx context.Context, k Key) ([]string, error) {
	rows, err := h.observe.Query(ctx, `SELECT 'row ' || id FROM hist.effects WHERE principal = $1 AND key = $2
		UNION ALL SELECT 'payout ' || ref FROM hist.provider WHERE principal = $1 AND key = $2`, k.Principal, k.Name)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// TestSQLHistory: clients of the SQL API on several connections, through a fault proxy,
// while connections are cut, slowed and stalled, backends killed, the key table locked and
// PostgreSQL restarted (and crashed); every call is checked against the model.
func TestSQLHistory(t *testing.T) {
	t.Parallel()
	mode := ModeFromEnv(200, 6*time.Second, 8)
	c, observe, proxy := historyDB(t)
	ctx := context.Background()
	const app = "hist-sql"
	harness := &sqlHarness{url: Via(proxy.Addr(), "hist") + " application_name=" + app + " connect_timeout=2",
		observe: observe, conns: map[int]*pgx.Conn{}}
	defer harness.closeAll()

	h := New()
	inj := NewInjector(h)
	inj.ProxyFaults(proxy)
	inj.LockFault(c.URL("hist"))
	inj.TerminateFault(c.URL("hist"), app)
	inj.RestartFault(c)
	if mode.Long { // a failover to a synchronous standby (docs/testing.md)
		c.WithStandby(t)
		inj.PromotionFault(c)
	}
	inj.CommitFault(c.URL("hist"), app)
	runner := &Runner{H: h, Harness: harness, Mode: mode, Also: inj.Covered, OpTimeout: 2 * time.Second, Scenarios: []Scenario{
		deadLeaseTakeover(2), deadLeaseTakeover(2), Storm(Transactional, 3), Storm(Leased, 3), Expiry(Leased, 2), releaseReuse(2),
		Changed(Transactional, 2), Changed(Leased, 2), Hangup(Transactional, 2), Hangup(Leased, 2),
		Expiry(Transactional, 2), leaseExpiry(1), ExpiryEdge(Transactional, edgeWork, edgeTTL, 1),
		ExpiryEdge(Leased, edgeWork, edgeTTL, 1), staleHolder(1), contention(1),
	}}
	t.Logf("seed %d (HISTORY_SEED), at least %d operations and %s", mode.Seed, mode.Ops, mode.Duration)
	cleanCtx, stopCleanup := context.WithCancel(ctx)
	cleanups := CleanupEvery(cleanCtx, observe, cleanupEvery)
	runFaults(t, h, inj, runner, mode, ExpiryEdge(Transactional, edgeWork, edgeTTL, 0), ExpiryEdge(Leased, edgeWork, edgeTTL, 0),
		ExpiryEdge(Transactional, edgeWork, edgeTTL, 0), ExpiryEdge(Leased, edgeWork, edgeTTL, 0), staleHolder(0), staleHolder(0),
		contention(0), contention(0), releaseReuse(0), Changed(Transactional, 0))
	probeEdgesAgain(ctx, runner)
	outcomeAgain(ctx, h, runner, "mismatch", 3, Changed(Transactional, 0))
	outcomeAgain(ctx, h, runner, "lost", 1, staleHolder(0))
	stopCleanup()
	// Settle: the leases left held run out, the connections the faults broke are gone.
	time.Sleep(runner.Keys()[0].Lease + 500*time.Millisecond)
	harness.closeAll()
	waitIdle(t, observe, app)
	h.Close()
	if err := runner.Observe(ctx); err != nil {
		t.Fatal(err)
	}
	Verify(t, h, t.Name())
	t.Logf("scenarios: %v", runner.Ran())
	outcomes, faults := h.Counts()
	Require(t, "the outcome", outcomes, map[string]int{"2xx": 20, "replayed": 5, "mismatch": 3, "held": 2, "released": 1, "busy": 1})
	Require(t, "the fault", faults, map[string]int{"cut": 1, "latency": 1, "stall": 1, "table-lock": 1, "backend-kill": 1, "pg-restart": 1,
		"commit-kill": 1})
	Require(t, "the scenario", runner.Ran(), map[string]int{"dead lease, transactional takeover": 1, "release, then reuse": 1,
		"lease expiry": 1, "expiry lease": 1, "storm tx": 1, "storm lease": 1, "stale holder": 2, "contention on a holder": 2,
		"expiry edge tx": 2, "expiry edge lease": 2})
	requireEdges(t, h, runner, cleanups(), true)
}
