package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/client"
	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// The failover tests (issue 38): a primary and a streaming standby (two local clusters,
// pg_basebackup -R), the real server on a multi-host DATABASE_URL with
// target_session_attrs=read-write, retrying clients doing keyed deposits, transfers and slow
// payouts, and in the middle a failover: the primary's WAL sender is paused (SIGSTOP) for
// FAILOVER_PAUSE, then every process of the primary is killed (SIGKILL, a dead machine) and
// the standby promoted (pg_ctl promote). The server is never restarted.
//
// `make failover` runs them longer; the knobs (environment):
//
//	FAILOVER_SECONDS  traffic before the failover (default 3) and after the server serves again
//	FAILOVER_CLIENTS  retrying clients (default 6)
//	FAILOVER_PAUSE    how long the WAL sender is paused before the primary dies (default 1s)

// failoverKnobs are the run's sizes, from the environment.
type failoverKnobs struct {
	traffic time.Duration
	clients int
	pause   time.Duration
}

func readFailoverKnobs(t *testing.T) failoverKnobs {
	t.Helper()
	k := failoverKnobs{traffic: 3 * time.Second, clients: 6, pause: time.Second}
	if v := os.Getenv("FAILOVER_SECONDS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 3600 {
			t.Fatalf("FAILOVER_SECONDS=%q: want whole seconds from 1 to 3600", v)
		}
		k.traffic = time.Duration(n) * time.Second
	}
	if v := os.Getenv("FAILOVER_CLIENTS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 256 {
			t.Fatalf("FAILOVER_CLIENTS=%q: want a number of clients from 1 to 256", v)
		}
		k.clients = n
	}
	if v := os.Getenv("FAILOVER_PAUSE"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 || d > time.Minute {
			t.Fatalf("FAILOVER_PAUSE=%q: want a duration from 0 to 1m, such as 1500ms", v)
		}
		k.pause = d
	}
	return k
}

// pair is a primary and its streaming standby, each listening on 127.0.0.1.
type pair struct {
	dir              string
	synchronous      bool
	primary, standby *pgcluster.Cluster
}

// startPair starts a primary; follow makes its standby. synchronous: once the standby follows,
// the primary's commits wait for it (synchronous_standby_names = '*', synchronous_commit =
// on). The standby never has synchronous_standby_names: once promoted it has no standby of its
// own to wait for. Both are removed when the test ends.
func startPair(t *testing.T, synchronous bool) *pair {
	t.Helper()
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "idem-failover-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil { // the clusters run as postgres
		t.Fatal(err)
	}
	base := map[string]string{"fsync": "off", "max_connections": "100", "shared_buffers": "32MB",
		"synchronous_commit": "on", "wal_sender_timeout": "5s", "wal_receiver_timeout": "5s",
		"wal_retrieve_retry_interval": "500ms"}
	settings := func(extra map[string]string) map[string]string {
		out := map[string]string{}
		for k, v := range base {
			out[k] = v
		}
		for k, v := range extra {
			out[k] = v
		}
		return out
	}
	p := &pair{dir: dir, synchronous: synchronous,
		primary: &pgcluster.Cluster{Dir: filepath.Join(dir, "a"), SocketDir: filepath.Join(dir, "a"), TCPAddr: "127.0.0.1",
			AnyPort: true, Settings: settings(nil)},
		standby: &pgcluster.Cluster{Dir: filepath.Join(dir, "b"), SocketDir: filepath.Join(dir, "b"), TCPAddr: "127.0.0.1",
			AnyPort: true, Settings: settings(nil)},
	}
	t.Cleanup(func() {
		_ = p.primary.Kill()
		_ = p.standby.Stop(context.Background())
		_ = p.primary.Stop(context.Background())
		_ = os.RemoveAll(dir)
	})
	if err := p.primary.Init(ctx); err != nil {
		t.Fatal(err)
	}
	if err := p.primary.Start(ctx); err != nil {
		t.Fatal(err)
	}
	return p
}

// follow makes the standby from the primary as it is now, and starts it.
func (p *pair) follow(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	if err := p.standby.InitStandby(ctx, p.primary); err != nil {
		t.Fatal(err)
	}
	if err := p.standby.Start(ctx); err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, p.primary.ConnString("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	// The standby streams before anything reads the primary's replication: a server started at
	// once read "none" once, its standby not connected yet.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var streaming bool
		err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_replication WHERE state = 'streaming')`).Scan(&streaming)
		if err == nil && streaming {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the standby did not stream in 30 s (%v)", err)
		}
	}
	if !p.synchronous {
		return
	}
	// Set in postgresql.auto.conf after the base backup, so that the standby never has it.
	if _, err := conn.Exec(ctx, `ALTER SYSTEM SET synchronous_standby_names = '*'`); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `SELECT pg_reload_conf()`); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var sync string
		err := conn.QueryRow(ctx, `SELECT coalesce((SELECT sync_state FROM pg_stat_replication LIMIT 1), '')`).Scan(&sync)
		if err == nil && sync == "sync" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the standby did not become synchronous in 10 s (%q, %v)", sync, err)
		}
	}
}

// failoverOp is one logical operation of a client and its final answer.
type failoverOp struct {
	key, path   string
	body        any
	payout      int64 // the payout's amount (unique per payout), 0 for other operations
	start, done time.Time
	status      int
	answer      []byte
	providerKey string
}

// attemptLog records every attempt's outcome (time, status, or 0 for a transport error).
type attemptLog struct {
	mu      sync.Mutex
	entries []attemptEntry
	next    http.RoundTripper
}

type attemptEntry struct {
	sent, at time.Time
	status   int
	path     string
	err      error
}

func (l *attemptLog) RoundTrip(r *http.Request) (*http.Response, error) {
	sent := time.Now()
	res, err := l.next.RoundTrip(r)
	e := attemptEntry{sent: sent, at: time.Now(), path: r.URL.Path, err: err}
	if err == nil {
		e.status = res.StatusCode
	}
	l.mu.Lock()
	l.entries = append(l.entries, e)
	l.mu.Unlock()
	return res, err
}

// failoverRun is what one failover run measured.
type failoverRun struct {
	before, during, after int // keys answered 2xx: before the primary died, in flight across, started after
	lost, changed         int // answered keys not replayed after the failover; replayed with another answer
	reran                 int // lost keys that ran again on their retry (a new effect for an answered key)
	payoutsTwice          int // payouts the provider made under two provider keys (an outside effect twice)
	inflight, keptKey     int // payouts working at the provider when the primary died; answered with that provider key
	tokensAgain           int // tokens the old primary committed that the new one handed out again
	tokensAgainAnswered   int // of them, tokens of keys the old primary had answered
	duringPause           int // attempts answered 2xx while the WAL sender was paused
	serveAgain            time.Duration
	fiveXXOutside         int // 5xx or transport errors outside the failover's window
}

// runFailover drives the traffic, the failover, and the checks common to both modes, and
// returns what it measured; each test asserts its own promise on it.
func runFailover(t *testing.T, synchronous bool) failoverRun {
	knobs := readFailoverKnobs(t)
	ctx := context.Background()
	p := startPair(t, synchronous)
	db := func(c *pgcluster.Cluster) string { return c.ConnString("postgres") }

	// Migrate and seed on the primary alone, then make the standby from it.
	mig := NewMain(io.Discard, io.Discard)
	if err := mig.ParseFlags([]string{"migrate"}, serverEnv(db(p.primary), nil)); err != nil {
		t.Fatal(err)
	}
	if err := mig.Run(ctx); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	_ = mig.Close()
	primaryPool, err := pgxpool.New(ctx, db(p.primary))
	if err != nil {
		t.Fatal(err)
	}
	defer primaryPool.Close()
	_, token, err := createPrincipal(ctx, primaryPool, "failover")
	if err != nil {
		t.Fatal(err)
	}
	p.follow(t)

	port, err := pgcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	logFile, err := os.Create(filepath.Join(p.dir, "server.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	t.Cleanup(func() { // before the pair's directory, which holds the log, is removed
		if b, err := os.ReadFile(logFile.Name()); err == nil && t.Failed() {
			t.Logf("the server's log, its last 4 KB:\n%s", b[max(len(b)-4096, 0):])
		}
	})
	multiHost := fmt.Sprintf("host=127.0.0.1,127.0.0.1 port=%d,%d user=postgres dbname=postgres sslmode=disable "+
		"target_session_attrs=read-write connect_timeout=2", p.primary.Port, p.standby.Port)
	srv := &process{t: t, bin: serverBinary(t), addr: fmt.Sprintf("127.0.0.1:%d", port), env: append(os.Environ(),
		"DATABASE_URL="+multiHost, "LISTEN_ADDR="+fmt.Sprintf("127.0.0.1:%d", port),
		"CLEANUP_INTERVAL=1s", "LOG_LEVEL=info", "DATABASE_POOL_SIZE=8", "IDEMPOTENCY_LOCK_TIMEOUT=2s",
		"PAYOUTS_LEASE=1s", "PAYOUT_PROVIDER_DELAY=2s", "IDEMPOTENCY_DUPLICATE_WAIT=200ms"), log: logFile}
	srv.start()
	defer srv.kill()
	checkReplicationReported(t, p, logFile.Name())

	log := &attemptLog{next: http.DefaultTransport}
	c := client.NewLedger("http://"+srv.addr, token)
	c.HTTP = &http.Client{Transport: log}
	c.AttemptTimeout, c.Backoff, c.MaxBackoff = 8*time.Second, 20*time.Millisecond, 300*time.Millisecond
	c.MaxAttempts = -1 // through the failover, until the context ends
	const accounts = 6
	ids := make([]int, accounts)
	for i := range ids {
		r, err := c.Post(ctx, "/v1/accounts", map[string]string{"name": "a", "currency": "EUR"})
		if err != nil || r.Status != 201 {
			t.Fatalf("account: %+v %v", r, err)
		}
		var v struct{ ID int }
		if err := r.JSON(&v); err != nil {
			t.Fatal(err)
		}
		ids[i] = v.ID
		if r, err := c.Post(ctx, fmt.Sprintf("/v1/accounts/%d/deposits", ids[i]), map[string]int{"amount": 100000}); err != nil || r.Status != 201 {
			t.Fatalf("seed: %+v %v", r, err)
		}
	}

	var (
		mu       sync.Mutex
		ops      []*failoverOp
		payoutN  atomic.Int64
		stopping = make(chan struct{})
		wg       sync.WaitGroup
	)
	runCtx, cancel := context.WithTimeout(ctx, 2*knobs.traffic+3*time.Minute)
	defer cancel()
	// send sends one operation until its final answer and records it.
	send := func(op *failoverOp) bool {
		res, err := c.Send(runCtx, http.MethodPost, op.path, op.key, op.body)
		op.done = time.Now()
		if err != nil {
			t.Errorf("key %s (%s): no final answer: %v", op.key, op.path, err)
			return false
		}
		op.status, op.answer = res.Status, res.Body
		if op.payout != 0 && res.Status == 201 {
			var v struct {
				ProviderKey string `json:"provider_key"`
			}
			_ = json.Unmarshal(res.Body, &v)
			op.providerKey = v.ProviderKey
		}
		mu.Lock()
		ops = append(ops, op)
		mu.Unlock()
		return true
	}
	for w := range knobs.clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 38))
			for {
				select {
				case <-stopping:
					return
				default:
				}
				op := &failoverOp{key: client.NewKey(), start: time.Now()}
				// A third of the clients (at least one) make payouts one after the other (each
				// works 2 s at the provider: one is always in flight); the others deposits and
				// transfers.
				switch n := rng.IntN(10); {
				case w < max(knobs.clients/3, 1):
					op.payout = 1 + payoutN.Add(1)
					op.path, op.body = "/v1/payouts", map[string]int64{"account": int64(ids[rng.IntN(accounts)]), "amount": op.payout}
				case n < 5:
					from, to := rng.IntN(accounts), rng.IntN(accounts-1)
					if to >= from {
						to++
					}
					op.path, op.body = "/v1/transfers", map[string]int{"from": ids[from], "to": ids[to], "amount": 1 + rng.IntN(50)}
				default:
					op.path, op.body = fmt.Sprintf("/v1/accounts/%d/deposits", ids[rng.IntN(accounts)]), map[string]int{"amount": 1 + rng.IntN(100)}
				}
				if !send(op) {
					return
				}
			}
		}()
	}

	time.Sleep(knobs.traffic) // traffic before the failover
	// A payout at work at the provider that outlasts the pause: a lease in flight across the
	// failover. Its claim and the provider's record committed before the pause.
	type working struct {
		key    string
		amount int64
	}
	var inflight []working
	deadline := time.Now().Add(10 * time.Second)
	for len(inflight) == 0 && time.Now().Before(deadline) {
		rows, err := primaryPool.Query(ctx, `SELECT idempotency_key, amount FROM provider.payouts
			WHERE ready_at > clock_timestamp() + $1::interval`, fmt.Sprintf("%d milliseconds", knobs.pause.Milliseconds()+300))
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var w working
			if err := rows.Scan(&w.key, &w.amount); err != nil {
				t.Fatal(err)
			}
			inflight = append(inflight, w)
		}
		if rows.Err() != nil {
			t.Fatal(rows.Err())
		}
		if len(inflight) == 0 {
			time.Sleep(20 * time.Millisecond)
		}
	}
	var sender int
	if err := primaryPool.QueryRow(ctx, `SELECT pid FROM pg_stat_replication`).Scan(&sender); err != nil {
		t.Fatalf("the primary's WAL sender: %v", err)
	}
	pauseAt := time.Now()
	if err := syscall.Kill(sender, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	// A payout claimed while the standby is behind. Asynchronous: its claim and the provider's
	// record commit on the primary alone (the test waits for the record); synchronous: its
	// claim's commit waits for the standby, and the primary dies first.
	late := &failoverOp{key: client.NewKey(), start: time.Now(), payout: 1 + payoutN.Add(1), path: "/v1/payouts"}
	late.body = map[string]int64{"account": int64(ids[0]), "amount": late.payout}
	wg.Add(1)
	go func() { defer wg.Done(); send(late) }()
	if !synchronous {
		waitForCondition(t, primaryPool, fmt.Sprintf(`SELECT EXISTS (SELECT FROM provider.payouts WHERE amount = %d)`, late.payout))
	}
	primaryPool.Close()
	time.Sleep(time.Until(pauseAt.Add(knobs.pause))) // the standby falls behind (commits wait for it in synchronous mode)
	if err := p.primary.Kill(); err != nil {
		t.Fatal(err)
	}
	stopAt := time.Now() // every process of the primary is gone
	_ = syscall.Kill(sender, syscall.SIGKILL)

	// The standby replays all it received, then reports its token sequence and its tokens.
	standbyPool, err := pgxpool.New(ctx, db(p.standby))
	if err != nil {
		t.Fatal(err)
	}
	defer standbyPool.Close()
	waitForCondition(t, standbyPool, `SELECT pg_last_wal_receive_lsn() IS NULL OR pg_last_wal_receive_lsn() <= pg_last_wal_replay_lsn()`)
	var seqAtPromotion, maxReplicated int64
	if err := standbyPool.QueryRow(ctx, `SELECT (SELECT last_value FROM idem.token_seq),
		(SELECT coalesce(max(attempt), 0) FROM idem.idempotency_keys)`).Scan(&seqAtPromotion, &maxReplicated); err != nil {
		t.Fatal(err)
	}
	if maxReplicated > seqAtPromotion {
		t.Errorf("the standby's token sequence (%d) is behind a token it holds (%d): the new primary would hand it out again",
			seqAtPromotion, maxReplicated)
	}
	promoteStart := time.Now()
	if err := p.standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	promoted := time.Since(promoteStart)

	time.Sleep(knobs.traffic + 3*time.Second) // traffic after the failover (the first seconds reconnect)
	close(stopping)
	wg.Wait()
	if t.Failed() {
		t.Fatalf("the clients failed; server log: %s", logFile.Name())
	}

	var run failoverRun
	// When the server served again: the first 2xx to an attempt sent after the primary died.
	log.mu.Lock()
	back := time.Time{}
	for _, e := range log.entries {
		if e.sent.After(stopAt) && e.status >= 200 && e.status < 300 && (back.IsZero() || e.at.Before(back)) {
			back = e.at
		}
	}
	if back.IsZero() {
		t.Fatalf("the server never served again after the failover (server log: %s)", logFile.Name())
	}
	run.serveAgain = back.Sub(stopAt)
	for _, e := range log.entries {
		if !e.at.Before(pauseAt) && e.at.Before(stopAt) && e.status/100 == 2 {
			run.duringPause++
		}
	}
	// The window of the failover: from the pause to three seconds after the first 2xx (the
	// pool drops its dead connections on use); outside it no attempt may fail.
	window := map[int]int{} // what the attempts got in the window: status (0: no answer) -> attempts
	for _, e := range log.entries {
		outside := e.at.Before(pauseAt) || e.at.After(back.Add(3*time.Second))
		if (e.status == 0 || e.status >= 500) && outside {
			run.fiveXXOutside++
			// Which attempt, and when, against the pause and the return of service: a
			// failure here once in CI could not be told from the count alone.
			t.Logf("failed outside the window: %s %d (%v), sent %s and answered %s after the pause; service back %s after it",
				e.path, e.status, e.err, e.sent.Sub(pauseAt).Round(time.Millisecond), e.at.Sub(pauseAt).Round(time.Millisecond),
				back.Sub(pauseAt).Round(time.Millisecond))
		}
		if !outside && (e.status == 0 || e.status >= 300) {
			window[e.status]++
		}
	}
	t.Logf("attempts in the failover's window that did not end in 2xx, by status (0: no answer): %v", window)
	log.mu.Unlock()

	newPool := standbyPool
	// The new primary has no standby: idem_health says so, to the application's role.
	if h, err := idem.ReadHealth(ctx, newPool); err != nil || h.Replication != "none" || h.Standbys != 0 || h.ReplicationWarning != "" {
		t.Errorf("idem_health on the promoted standby: %+v %v, want replication none", h, err)
	}
	count := func(sql string, args ...any) int {
		var n int
		if err := newPool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		return n
	}
	// The ledger on the new primary: money neither made nor lost, each effect once.
	if n := count(`SELECT count(*)::int FROM ledger.accounts a WHERE a.balance <>
		  (SELECT coalesce(sum(amount), 0) FROM ledger.deposits d WHERE d.account_id = a.id)
		+ (SELECT coalesce(sum(amount), 0) FROM ledger.transfers t WHERE t.to_id = a.id)
		- (SELECT coalesce(sum(amount), 0) FROM ledger.transfers t WHERE t.from_id = a.id)`); n != 0 {
		t.Errorf("%d balances disagree with their operations", n)
	}
	if n := count(`SELECT ((SELECT sum(balance) FROM ledger.accounts) - (SELECT sum(amount) FROM ledger.deposits))::int`); n != 0 {
		t.Errorf("money was created or destroyed: %d", n)
	}
	if n := count(`SELECT count(*)::int FROM (SELECT idempotency_key FROM (SELECT idempotency_key FROM ledger.deposits
		WHERE idempotency_key IS NOT NULL UNION ALL SELECT idempotency_key FROM ledger.transfers
		UNION ALL SELECT idempotency_key FROM ledger.payouts) e GROUP BY idempotency_key HAVING count(*) > 1) dup`); n != 0 {
		t.Errorf("%d keys took effect more than once", n)
	}

	// The old primary's data, as it was when it died (started alone on a port of its own, so
	// that the server never reaches it): what it had committed.
	p.primary.Port = 0 // AnyPort: a new one
	p.primary.Settings["synchronous_standby_names"] = ""
	if err := p.primary.Start(ctx); err != nil {
		t.Fatal(err)
	}
	oldPool, err := pgxpool.New(ctx, db(p.primary))
	if err != nil {
		t.Fatal(err)
	}
	defer oldPool.Close()

	// Payouts: the provider's records are on both sides (a real provider keeps its own): a
	// payout made under two provider keys is an outside effect twice.
	providerKeys := map[int64]map[string]bool{}
	for _, pool := range []*pgxpool.Pool{oldPool, newPool} {
		rows, err := pool.Query(ctx, `SELECT amount, idempotency_key FROM provider.payouts`)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var amount int64
			var key string
			if err := rows.Scan(&amount, &key); err != nil {
				t.Fatal(err)
			}
			if providerKeys[amount] == nil {
				providerKeys[amount] = map[string]bool{}
			}
			providerKeys[amount][key] = true
		}
		rows.Close()
	}
	for _, keys := range providerKeys {
		if len(keys) > 1 { // amounts are unique: one payout request each
			run.payoutsTwice++
		}
	}

	// Tokens: those the old primary committed that the new one handed out again (drawn
	// after the promotion: above the standby's sequence).
	oldTokens := map[int64]string{}
	rows, err := oldPool.Query(ctx, `SELECT attempt, key FROM idem.idempotency_keys WHERE attempt > $1`, seqAtPromotion)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var tok int64
		var key string
		if err := rows.Scan(&tok, &key); err != nil {
			t.Fatal(err)
		}
		oldTokens[tok] = key
	}
	rows.Close()
	answeredBefore := map[string]bool{}
	mu.Lock()
	for _, op := range ops {
		if op.done.Before(stopAt) && op.status/100 == 2 {
			answeredBefore[op.key] = true
		}
	}
	mu.Unlock()
	rows, err = newPool.Query(ctx, `SELECT attempt FROM idem.idempotency_keys WHERE attempt > $1`, seqAtPromotion)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var tok int64
		if err := rows.Scan(&tok); err != nil {
			t.Fatal(err)
		}
		if key, ok := oldTokens[tok]; ok {
			run.tokensAgain++
			if answeredBefore[key] {
				run.tokensAgainAnswered++
			}
		}
	}
	rows.Close()

	// Every key answered 2xx, sent again with its request: the same answer, byte for byte, as
	// a replay. (A lost key runs again: in asynchronous mode that is the doubled effect.)
	mu.Lock()
	defer mu.Unlock()
	sort.Slice(ops, func(i, j int) bool { return ops[i].start.Before(ops[j].start) })
	var answered []*failoverOp
	for _, op := range ops {
		if op.status/100 != 2 {
			continue
		}
		answered = append(answered, op)
		switch {
		case op.done.Before(stopAt):
			run.before++
		case op.start.Before(stopAt):
			run.during++
		default:
			run.after++
		}
	}
	byAmount := map[int64]*failoverOp{}
	for _, op := range answered {
		if op.payout != 0 {
			byAmount[op.payout] = op
		}
	}
	for _, w := range inflight {
		run.inflight++
		if op := byAmount[w.amount]; op != nil && op.providerKey == w.key {
			run.keptKey++
		}
	}
	check := client.NewLedger("http://"+srv.addr, token)
	check.AttemptTimeout, check.MaxAttempts, check.Backoff = 10*time.Second, 50, 50*time.Millisecond
	var lost, changed, reran atomic.Int64
	var next atomic.Int64
	var cw sync.WaitGroup
	for range 8 {
		cw.Add(1)
		go func() {
			defer cw.Done()
			for i := int(next.Add(1) - 1); i < len(answered); i = int(next.Add(1) - 1) {
				op := answered[i]
				res, err := check.Send(ctx, http.MethodPost, op.path, op.key, op.body)
				switch {
				case err != nil:
					t.Errorf("key %s: the replay got no answer: %v", op.key, err)
				case !res.Replayed:
					lost.Add(1)
					if res.Status/100 == 2 {
						reran.Add(1)
					}
				case res.Status != op.status || !bytes.Equal(res.Body, op.answer):
					changed.Add(1)
					t.Logf("key %s: answered %d %s, replayed %d %s", op.key, op.status, op.answer, res.Status, res.Body)
				}
			}
		}()
	}
	cw.Wait()
	run.lost, run.changed, run.reran = int(lost.Load()), int(changed.Load()), int(reran.Load())

	mode := "asynchronous"
	if synchronous {
		mode = "synchronous"
	}
	t.Logf("%s standby, %d clients, %s of traffic, WAL sender paused %s: keys answered 2xx: %d before the primary died, "+
		"%d in flight across the failover, %d after; lost %d of %d (%.1f%%), %d of them ran again; %d answers changed; "+
		"%d payouts made under two provider keys; %d leases working at the provider at the failover, %d answered with their provider key; "+
		"%d tokens of the old primary handed out again (%d of answered keys); promotion took %s; serving again %s after the primary died; "+
		"%d failed attempts outside the window; %d attempts answered 2xx during the pause",
		mode, knobs.clients, knobs.traffic, knobs.pause, run.before, run.during, run.after, run.lost, len(answered),
		100*float64(run.lost)/float64(max(len(answered), 1)), run.reran, run.changed, run.payoutsTwice, run.inflight, run.keptKey,
		run.tokensAgain, run.tokensAgainAnswered, promoted.Round(time.Millisecond), run.serveAgain.Round(time.Millisecond),
		run.fiveXXOutside, run.duringPause)
	if run.before == 0 || run.after == 0 {
		t.Errorf("the run answered %d keys before the failover and %d after: it proves nothing", run.before, run.after)
	}
	if run.serveAgain > 30*time.Second {
		t.Errorf("the server served again %s after the primary died, want within 30 s", run.serveAgain)
	}
	if run.changed != 0 {
		t.Errorf("%d answered keys replayed another answer", run.changed)
	}
	if run.fiveXXOutside != 0 {
		t.Errorf("%d attempts failed (5xx or no answer) outside the failover's window", run.fiveXXOutside)
	}
	return run
}

// checkReplicationReported: idem_health, `server keys` and the server's start log report the
// pair's replication, to the least-privileged roles (members of idem_app and idem_operator
// only): the primary's mode and its one standby (with the warning when asynchronous), and
// "standby" on the standby. And when the schema's owner is no superuser (pg_stat_replication
// hides its details from it), the mode comes from the settings: the same answer.
func checkReplicationReported(t *testing.T, p *pair, serverLog string) {
	t.Helper()
	ctx := context.Background()
	want, warns := "asynchronous", true
	if p.synchronous {
		want, warns = "synchronous", false
	}
	primary := p.primary.ConnString("postgres")
	// A database owned and migrated by a role that is no superuser, beside the superuser's.
	admin, err := pgx.Connect(ctx, primary)
	if err != nil {
		t.Fatal(err)
	}
	for _, sql := range []string{`CREATE ROLE idem_plain_owner LOGIN NOSUPERUSER`, `CREATE DATABASE owned OWNER idem_plain_owner`} {
		if _, err := admin.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	admin.Close(ctx)
	owned := strings.Replace(p.primary.ConnString("owned"), "user=postgres", "user=idem_plain_owner", 1)
	mig := NewMain(io.Discard, io.Discard)
	if err := mig.ParseFlags([]string{"migrate"}, serverEnv(owned, nil)); err != nil {
		t.Fatal(err)
	}
	if err := mig.Run(ctx); err != nil {
		t.Fatalf("migrate as a plain owner: %v", err)
	}
	_ = mig.Close()

	for _, db := range []string{primary, p.primary.ConnString("owned")} {
		for _, role := range []string{"idem_app", "idem_operator"} {
			conn := pgtest.Connect(t, pgtest.LoginRole(t, db, role))
			h, err := idem.ReadHealth(ctx, conn)
			if err != nil || h.Replication != want || h.Standbys != 1 || (h.ReplicationWarning != "") != warns ||
				(warns && !strings.Contains(h.ReplicationWarning, "can be missing after a failover")) {
				t.Errorf("idem_health as %s on the primary (%s): %+v %v; want %s with one standby", role, db, h, err, want)
			}
		}
	}
	standbyApp := strings.Replace(pgtest.LoginRole(t, primary, "idem_app"), fmt.Sprintf("port=%d", p.primary.Port),
		fmt.Sprintf("port=%d", p.standby.Port), 1)
	standbyApp = strings.Replace(standbyApp, "host="+p.primary.SocketDir, "host="+p.standby.SocketDir, 1)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		conn, err := pgx.Connect(ctx, standbyApp) // once the role has reached the standby
		if err == nil {
			h, err := idem.ReadHealth(ctx, conn)
			conn.Close(ctx)
			if err != nil || h.Replication != "standby" || h.ReplicationWarning != "" {
				t.Errorf("idem_health on the standby: %+v %v, want standby", h, err)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("connect to the standby as idem_app: %v", err)
		}
	}

	out, err := runCommand(t, pgtest.LoginRole(t, primary, "idem_operator"), "keys")
	if err != nil || !strings.Contains(out, "replication: "+want+", 1 standbys\n") || strings.Contains(out, "warning: ") != warns {
		t.Errorf("server keys: %v\n%s", err, out)
	}
	log, err := os.ReadFile(serverLog)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(log), `"replication":"`+want+`"`) || strings.Contains(string(log), "can be missing after a failover") != warns {
		t.Errorf("the server's start log does not report the replication %s (warning %v):\n%s", want, warns, log)
	}
}

// waitForCondition polls a boolean query until it is true (10 s at most).
func waitForCondition(t *testing.T, pool *pgxpool.Pool, sql string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; {
		var ok bool
		err := pool.QueryRow(context.Background(), sql).Scan(&ok)
		if err == nil && ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not true after 10 s: %s (%v)", sql, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestFailoverSynchronous: with a synchronous standby a failover loses no answer. Every key
// answered 2xx before or during the failover replays byte for byte afterwards, each effect
// once, the money adds up, every payout reached the provider under one provider key (a lease
// working at the provider when the primary died kept its key), no token the old primary
// handed to an answered key is handed out again, and the server serves again within 30 s
// without a restart.
func TestFailoverSynchronous(t *testing.T) {
	t.Parallel()
	run := runFailover(t, true)
	if run.lost != 0 {
		t.Errorf("%d keys answered 2xx were lost", run.lost)
	}
	if run.payoutsTwice != 0 {
		t.Errorf("%d payouts were made under two provider keys", run.payoutsTwice)
	}
	if run.inflight == 0 || run.keptKey != run.inflight {
		t.Errorf("%d payouts were working at the provider at the failover, %d answered with their provider key; want all, at least one",
			run.inflight, run.keptKey)
	}
	if run.tokensAgainAnswered != 0 {
		t.Errorf("%d tokens of answered keys were handed out again", run.tokensAgainAnswered)
	}
}

// TestFailoverAsynchronous: with an asynchronous standby a failover loses answers; the test
// measures and prints how many (docs/operations.md, "Replication and failover"). What still
// holds and is asserted: the server serves again within 30 s without a restart, no failed
// attempt outside the failover's window, no answer replayed differently (a key is either
// kept whole or gone), the new primary's ledger adds up, and every key the replay found
// missing ran again on its retry with a 2xx (none is left stuck in between).
func TestFailoverAsynchronous(t *testing.T) {
	t.Parallel()
	run := runFailover(t, false)
	if run.reran != run.lost {
		t.Errorf("%d answered keys were lost but %d ran again with a 2xx: the others are stuck", run.lost, run.reran)
	}
}
