package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/pgidem/pgidem/internal/client"
	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/internal/pgtest"
)

var (
	binOnce sync.Once
	binPath string
	binErr  error
)

// removeServerBinary removes the server that serverBinary built, and its directory: every run
// of the package's tests left one (28 MB) in the temporary directory.
func removeServerBinary() {
	if binPath != "" {
		_ = os.RemoveAll(filepath.Dir(binPath))
	}
}

// serverBinary builds the server once per test binary.
func serverBinary(t *testing.T) string {
	t.Helper()
	binOnce.Do(func() {
		dir, err := os.MkdirTemp("", "idem-server-bin-")
		if err != nil {
			binErr = err
			return
		}
		binPath = filepath.Join(dir, "server")
		if out, err := exec.Command("go", "build", "-o", binPath, ".").CombinedOutput(); err != nil {
			binErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return binPath
}

// process is the server running as a child process, so that it can be killed for real.
type process struct {
	t    *testing.T
	bin  string
	env  []string
	addr string
	// log, when set, receives the server's output and log (else they are discarded).
	log io.Writer
	mu  sync.Mutex
	cmd *exec.Cmd
}

func (p *process) start() {
	p.t.Helper()
	if err := p.startErr(); err != nil {
		p.t.Fatal(err)
	}
}

// startErr starts the server and waits until it answers /healthz (any answer); for
// goroutines that cannot end the test.
func (p *process) startErr() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	cmd := exec.Command(p.bin, "serve")
	cmd.Env = p.env
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	if p.log != nil {
		cmd.Stdout, cmd.Stderr = p.log, p.log
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	p.cmd = cmd
	for i := 0; i < 500; i++ {
		if res, err := http.Get("http://" + p.addr + "/healthz"); err == nil {
			res.Body.Close()
			return nil
		}
		time.Sleep(10 * time.Millisecond)
	}
	return errors.New("the server did not come up")
}

// kill sends SIGKILL: no shutdown, no rollback from the server's side.
func (p *process) kill() {
	p.mu.Lock()
	defer p.mu.Unlock()
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	_ = p.cmd.Wait()
}

// TestFaults: retrying clients drive transfers and deposits through the real server while a
// fault proxy (toxiproxy) between the server and PostgreSQL resets and stalls connections
// at random moments, and the server is killed with SIGKILL and restarted. Afterwards the
// money is right, no key has two effects, every 2xx a client saw is what is stored, and no
// key is left in progress.
func TestFaults(t *testing.T) {
	t.Parallel()
	bin := serverBinary(t)
	s := startServer(t, nil) // migrates a database; its in-process server only seeds data
	_, token := s.principal("faults")
	const accounts = 5
	ids := make([]int, accounts)
	for i := range ids {
		ids[i] = int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
		if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", ids[i]), token, "", `{"amount":10000}`); r.status != 201 {
			t.Fatalf("seed: %+v", r)
		}
	}

	proxy := dbProxy(t)
	port, err := pgcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	p := &process{t: t, bin: bin, addr: fmt.Sprintf("127.0.0.1:%d", port), env: append(os.Environ(),
		"DATABASE_URL="+pgtest.Via(t, s.db, proxy.Listen), "LISTEN_ADDR="+fmt.Sprintf("127.0.0.1:%d", port),
		"IDEMPOTENCY_LOCK_TIMEOUT=300ms", "CLEANUP_INTERVAL=1s", "LOG_LEVEL=error", "DATABASE_POOL_SIZE=8")}
	p.start()
	defer p.kill()

	const chaos = 10 * time.Second
	var cuts, stalls, kills atomic.Int64
	chaosOver := make(chan struct{})
	go func() {
		defer close(chaosOver)
		rng := rand.New(rand.NewPCG(7, 8))
		end := time.Now().Add(chaos)
		nextKill := time.Now().Add(2 * time.Second)
		for time.Now().Before(end) {
			time.Sleep(time.Duration(100+rng.IntN(400)) * time.Millisecond)
			stream := []string{"downstream", "upstream"}[rng.IntN(2)]
			kind, attrs := "reset_peer", fmt.Sprintf(`{"timeout":%d}`, rng.IntN(20))
			if rng.IntN(3) == 0 {
				kind, attrs = "timeout", `{"timeout":0}`
				stalls.Add(1)
			} else {
				cuts.Add(1)
			}
			_, err := proxy.Toxics.AddToxicJson(strings.NewReader(fmt.Sprintf(
				`{"name":"fault","type":%q,"stream":%q,"toxicity":1,"attributes":%s}`, kind, stream, attrs)))
			if err != nil {
				t.Errorf("toxic: %v", err)
				return
			}
			time.Sleep(time.Duration(30+rng.IntN(200)) * time.Millisecond)
			_ = proxy.Toxics.RemoveToxic(context.Background(), "fault")
			if time.Now().After(nextKill) {
				p.kill()
				kills.Add(1)
				p.start()
				nextKill = time.Now().Add(time.Duration(1500+rng.IntN(2000)) * time.Millisecond)
			}
		}
	}()

	type seen struct {
		key, body string
		status    int
	}
	var mu sync.Mutex
	var answers []seen
	var ops, replays, retries atomic.Int64
	ctx, cancel := context.WithTimeout(context.Background(), chaos+40*time.Second)
	defer cancel()
	c := client.NewLedger("http://"+p.addr, token)
	c.AttemptTimeout, c.Backoff, c.MaxBackoff = 3*time.Second, 20*time.Millisecond, 300*time.Millisecond
	c.MaxAttempts = -1 // through kills and restarts, until the context ends: every operation must get its answer
	var wg sync.WaitGroup
	for w := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 99))
			for {
				select {
				case <-chaosOver:
					return
				default:
				}
				var path string
				var body any
				if rng.IntN(10) < 7 {
					from, to := rng.IntN(accounts), rng.IntN(accounts-1)
					if to >= from {
						to++
					}
					path, body = "/v1/transfers", map[string]int{"from": ids[from], "to": ids[to], "amount": 1 + rng.IntN(300)}
				} else {
					path, body = fmt.Sprintf("/v1/accounts/%d/deposits", ids[rng.IntN(accounts)]), map[string]int{"amount": 1 + rng.IntN(100)}
				}
				res, err := c.Post(ctx, path, body)
				ops.Add(1)
				if err != nil {
					t.Errorf("an operation never got a final answer: %v", err)
					return
				}
				retries.Add(int64(res.Attempts - 1))
				if res.Replayed {
					replays.Add(1)
				}
				if res.Status != 201 && res.Status != 422 {
					t.Errorf("key %s: final answer %d %s", res.Key, res.Status, res.Body)
				}
				mu.Lock()
				answers = append(answers, seen{res.Key, strings.TrimSpace(string(res.Body)), res.Status})
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	<-chaosOver
	// Connections the killed servers left behind end their transactions (rolled back).
	pgtest.WaitFor(t, s.pool, `SELECT 1 - count(*) FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in transaction%'`)

	if n := s.count(`SELECT count(*) FROM ledger.accounts a WHERE a.balance <>
		  (SELECT coalesce(sum(amount), 0) FROM ledger.deposits d WHERE d.account_id = a.id)
		+ (SELECT coalesce(sum(amount), 0) FROM ledger.transfers t WHERE t.to_id = a.id)
		- (SELECT coalesce(sum(amount), 0) FROM ledger.transfers t WHERE t.from_id = a.id)`); n != 0 {
		t.Errorf("%d balances disagree with their operations", n)
	}
	if n := s.count(`SELECT (SELECT sum(balance) FROM ledger.accounts) - (SELECT sum(amount) FROM ledger.deposits)`); n != 0 {
		t.Errorf("money was created or destroyed: %d", n)
	}
	if n := s.count(`SELECT count(*) FROM (SELECT idempotency_key FROM (SELECT idempotency_key FROM ledger.deposits
		WHERE idempotency_key IS NOT NULL UNION ALL SELECT idempotency_key FROM ledger.transfers) e
		GROUP BY idempotency_key HAVING count(*) > 1) dup`); n != 0 {
		t.Errorf("%d keys took effect more than once", n)
	}
	if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE state = 'p'`); n != 0 {
		t.Errorf("%d keys left in progress", n)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, a := range answers {
		var stored string
		var status int
		if err := s.pool.QueryRow(context.Background(), `SELECT btrim(convert_from(response_body, 'UTF8'), E'\n'), response_status
			FROM idem.idempotency_keys WHERE key = $1 AND state = 'c'`, a.key).Scan(&stored, &status); err != nil {
			t.Errorf("key %s: the client got %d, nothing is stored (%v)", a.key, a.status, err)
			continue
		}
		if a.status != status || (a.status == 201 && stored != a.body) {
			t.Errorf("key %s: the client saw %d %s, stored %d %s", a.key, a.status, a.body, status, stored)
		}
	}
	t.Logf("%d operations (%d answered 2xx), %d retries, %d replays; %d connection cuts, %d stalls, %d kills",
		ops.Load(), s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE state = 'c' AND response_status = 201`),
		retries.Load(), replays.Load(), cuts.Load(), stalls.Load(), kills.Load())
}

// TestDatabaseDownIs503: while the server cannot reach PostgreSQL (every connection to it is
// reset), a request gets 503 with Retry-After (from the token lookup, the first statement of
// every /v1 request), never 500; nothing is stored, and the client's retry with the same key,
// once the database is back, makes the deposit once.
func TestDatabaseDownIs503(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("down")
	account := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))

	proxy := dbProxy(t)
	port, err := pgcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	p := &process{t: t, bin: serverBinary(t), addr: fmt.Sprintf("127.0.0.1:%d", port), env: append(os.Environ(),
		"DATABASE_URL="+pgtest.Via(t, s.db, proxy.Listen), "LISTEN_ADDR="+fmt.Sprintf("127.0.0.1:%d", port),
		"CLEANUP_INTERVAL=0", "LOG_LEVEL=error")}
	p.start()
	defer p.kill()
	deposit := func(key string) (int, http.Header, string) {
		return pgtest.Send(t, context.Background(), "POST", fmt.Sprintf("http://%s/v1/accounts/%d/deposits", p.addr, account),
			`{"amount":5}`, "Authorization", "Bearer "+token, "Idempotency-Key", key, "Content-Type", "application/json")
	}
	if status, _, body := deposit("before"); status != 201 {
		t.Fatalf("a deposit while the database is up: %d %s", status, body)
	}

	for _, stream := range []string{"upstream", "downstream"} {
		if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(fmt.Sprintf(
			`{"name":"down-%s","type":"reset_peer","stream":%q,"toxicity":1,"attributes":{"timeout":0}}`, stream, stream))); err != nil {
			t.Fatal(err)
		}
	}
	for _, call := range []struct {
		name string
		send func() (int, http.Header, string)
	}{
		{"a keyed deposit", func() (int, http.Header, string) { return deposit("during") }},
		{"a read", func() (int, http.Header, string) {
			return pgtest.Send(t, context.Background(), "GET", fmt.Sprintf("http://%s/v1/accounts/%d", p.addr, account), "",
				"Authorization", "Bearer "+token)
		}},
	} {
		for range 3 { // the pool's idle connections first, then new ones
			status, header, body := call.send()
			if status != 503 || header.Get("Retry-After") != "1" || header.Get("Content-Type") != "application/problem+json" ||
				!strings.Contains(body, "unavailable") {
				t.Fatalf("%s while the database is unreachable: %d %v %s, want 503 with Retry-After", call.name, status, header, body)
			}
			// The detail tells a keyed request to retry with its key, and a read, which
			// carries none, to send it again (an operator's review saw a GET told the key).
			if keyed := strings.Contains(body, "Idempotency-Key"); keyed != (call.name == "a keyed deposit") {
				t.Errorf("%s while the database is unreachable: %s; the detail names the key %v, want only for a keyed request", call.name, body, keyed)
			}
		}
	}

	for _, stream := range []string{"upstream", "downstream"} {
		_ = proxy.Toxics.RemoveToxic(context.Background(), "down-"+stream)
	}
	var status int
	for range 50 { // the pool reconnects on its next acquire
		if status, _, _ = deposit("during"); status != 503 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if status != 201 {
		t.Fatalf("the retry once the database is back: %d, want 201", status)
	}
	if b := s.count(fmt.Sprintf(`SELECT balance FROM ledger.accounts WHERE id = %d`, account)); b != 10 {
		t.Fatalf("balance %d, want 10: the deposit before and the retried one, once each", b)
	}
}

// dbProxy is a toxiproxy proxy, in process, in front of the test cluster's PostgreSQL, started
// and stopped with the test.
func dbProxy(t *testing.T) *toxiproxy.Proxy {
	t.Helper()
	proxy := toxiproxy.NewProxy(toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop()),
		"postgres", "127.0.0.1:0", pgtest.TCPAddr(t))
	if err := proxy.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxy.Stop)
	return proxy
}
