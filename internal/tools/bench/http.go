package main

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// server is the reference server (./cmd/server) running against a database of the bench
// server, with a principal of its own.
type server struct {
	base, token, principal string
	http                   *http.Client
}

// startServer builds the reference server (once), creates database db empty, migrates it,
// creates a principal, and serves with env added to the environment. stop stops the server
// and waits for it.
func (b *bench) startServer(ctx context.Context, db string, clients int, env ...string) (s *server, stop func(), err error) {
	if b.serverBin == "" {
		root, err := moduleRoot()
		if err != nil {
			return nil, nil, err
		}
		bin := filepath.Join(b.tmp, "server")
		cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/server")
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			return nil, nil, fmt.Errorf("build the server: %v\n%s", err, out)
		}
		b.serverBin = bin
	}
	if err := recreate(ctx, b.url, db); err != nil {
		return nil, nil, err
	}
	command := func(args ...string) (string, error) {
		cmd := exec.CommandContext(ctx, b.serverBin, args...)
		cmd.Env = append(append(os.Environ(), "DATABASE_URL="+withDatabase(b.url, db), "LOG_LEVEL=error"), env...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			return "", fmt.Errorf("server %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out), nil
	}
	if _, err := command("migrate"); err != nil {
		return nil, nil, err
	}
	out, err := command("principal", "create", "bench")
	if err != nil {
		return nil, nil, err
	}
	m := regexp.MustCompile(`(?m)^principal (\S+)\s+token (\S+)`).FindStringSubmatch(out)
	if m == nil {
		return nil, nil, fmt.Errorf("no principal and token in %q", out)
	}
	return b.serve(ctx, db, m[1], m[2], clients, env...)
}

// serve starts the reference server on database db, set up by startServer, with env added to
// the environment; a principal and its token authenticate the requests.
func (b *bench) serve(ctx context.Context, db, principal, token string, clients int, env ...string) (s *server, stop func(), err error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, nil, err
	}
	addr := ln.Addr().String()
	ln.Close()
	env = append(append(os.Environ(), "DATABASE_URL="+withDatabase(b.url, db), "LISTEN_ADDR="+addr, "LOG_LEVEL=error"), env...)
	cmd := exec.Command(b.serverBin, "serve")
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	// The server dies with this process, even if it is killed.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		return nil, nil, err
	}
	stop = func() {
		_ = cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	}
	s = &server{base: "http://" + addr, principal: principal, token: token,
		http: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: clients * 2}, Timeout: 30 * time.Second}}
	for i := 0; ; i++ {
		res, err := s.http.Get(s.base + "/healthz")
		if err == nil {
			_, _ = io.Copy(io.Discard, res.Body)
			res.Body.Close()
			if res.StatusCode == http.StatusOK {
				break
			}
		}
		if i == 100 || ctx.Err() != nil {
			stop()
			return nil, nil, fmt.Errorf("the server did not become healthy: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return s, stop, nil
}

func moduleRoot() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", fmt.Errorf("run the benchmark inside the module (make bench)")
	}
	return filepath.Dir(gomod), nil
}

// do POSTs a JSON body with the bearer token, and the key unless it is "".
func (s *server) do(ctx context.Context, path, key, body string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.base+path, strings.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+s.token)
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	return s.http.Do(req)
}

// post sends a JSON body (with the bearer token, and the key unless it is "") and returns
// the status and the body.
func (s *server) post(ctx context.Context, path, key, body string) (int, []byte, error) {
	res, err := s.do(ctx, path, key, body)
	if err != nil {
		return 0, nil, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	return res.StatusCode, b, err
}

// send is post for the load: the body is discarded, except for a status other than want,
// which is returned as an error with the start of the body.
func (s *server) send(ctx context.Context, path, key, body string, want int) error {
	res, err := s.do(ctx, path, key, body)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	if res.StatusCode != want {
		b, _ := io.ReadAll(io.LimitReader(res.Body, 300))
		return fmt.Errorf("status %d: %s", res.StatusCode, b)
	}
	_, _ = io.Copy(io.Discard, res.Body)
	return nil
}

var idField = regexp.MustCompile(`"id":(\d+)`)

// createAccounts creates n accounts, each funded with deposit (none when 0).
func (s *server) createAccounts(ctx context.Context, n int, deposit int64) ([]int, error) {
	ids := make([]int, n)
	for i := range ids {
		st, body, err := s.post(ctx, "/v1/accounts", "", `{"name":"a","currency":"EUR"}`)
		if err != nil {
			return nil, err
		}
		m := idField.FindSubmatch(body)
		if st != http.StatusCreated || m == nil {
			return nil, fmt.Errorf("create account: %d %s", st, body)
		}
		ids[i], _ = strconv.Atoi(string(m[1]))
		if deposit > 0 {
			st, body, err := s.post(ctx, fmt.Sprintf("/v1/accounts/%d/deposits", ids[i]), "", fmt.Sprintf(`{"amount":%d}`, deposit))
			if err != nil || st != http.StatusCreated {
				return nil, fmt.Errorf("deposit: %d %s %v", st, body, err)
			}
		}
	}
	return ids, nil
}

// httpPart drives POST /v1/transfers of the reference server with b.clients clients:
// without a key, with a fresh key per request, and replaying completed keys, interleaved
// round by round.
func httpPart(ctx context.Context, b *bench) error {
	srv, stop, err := b.startServer(ctx, "bench_http", b.clients, "TRANSFERS_REQUIRE_KEY=false", "CLEANUP_INTERVAL=0")
	if err != nil {
		return err
	}
	defer stop()
	const nAccounts = 200
	ids, err := srv.createAccounts(ctx, nAccounts, 1_000_000_000_000)
	if err != nil {
		return err
	}
	transfer := func(rng *rand.Rand) string {
		a := rng.IntN(nAccounts)
		c := (a + 1 + rng.IntN(nAccounts-1)) % nAccounts
		return fmt.Sprintf(`{"from":%d,"to":%d,"amount":1}`, ids[a], ids[c])
	}
	// Keys to replay: completed once, before the clock starts.
	type done struct{ key, body string }
	replays := make([]done, 2000)
	rng := newRand()
	w := &worker{rng: rng}
	for i := range replays {
		replays[i] = done{w.key(), transfer(rng)}
		if err := srv.send(ctx, "/v1/transfers", replays[i].key, replays[i].body, http.StatusCreated); err != nil {
			return fmt.Errorf("complete a key to replay: %w", err)
		}
	}

	variants := []string{"no key", "fresh key", "replay"}
	fmt.Printf("HTTP: the reference server's POST /v1/transfers (its default pool, %d connections here), %d clients (net/http, keep-alive), %d rounds of %ds per variant\n",
		defaultPoolSize(), b.clients, b.rounds, b.seconds)
	rates := map[string][]float64{}
	lats := map[string][]time.Duration{}
	fails := map[string]*failures{}
	for r := 1; r <= b.rounds; r++ {
		for _, v := range variants {
			res := drive(ctx, b.clients, after(time.Duration(b.seconds)*time.Second),
				func(ctx context.Context, w *worker) error {
					key, body := "", transfer(w.rng)
					switch v {
					case "fresh key":
						key = w.key()
					case "replay":
						d := replays[w.rng.IntN(len(replays))]
						key, body = d.key, d.body
					}
					return srv.send(ctx, "/v1/transfers", key, body, http.StatusCreated)
				})
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if fails[v] == nil {
				fails[v] = &failures{}
			}
			fails[v].add(v, res)
			rates[v] = append(rates[v], res.rate())
			for _, s := range res.samples {
				lats[v] = append(lats[v], s.lat)
			}
			fmt.Printf("  round %d  %-10s %7.0f req/s%s\n", r, v, res.rate(), res.errNote())
		}
	}
	med := map[string]float64{}
	fmt.Printf("\n%-10s %10s %9s %9s   %s\n", "variant", "req/s", "p50 ms", "p99 ms", "runs")
	for _, v := range variants {
		med[v] = median(rates[v])
		slices.Sort(lats[v])
		p50, p99 := percentile(lats[v], 0.50), percentile(lats[v], 0.99)
		fmt.Printf("%-10s %10.0f %9.2f %9.2f   %v\n", v, med[v], p50, p99, rounded(rates[v]))
		b.info(fmt.Sprintf("HTTP %s: req/s, p50 ms, p99 ms", v), fmt.Sprintf("%.0f %.1f %.1f", med[v], p50, p99))
		if f := fails[v]; f.n > 0 {
			b.info(fmt.Sprintf("HTTP %s: failed requests (the first is shown above)", v), fmt.Sprint(f.n))
		}
	}
	b.ratio("HTTP: keyed transfer / no key", med["fresh key"]/med["no key"], ">=", 0.80)
	b.ratio("HTTP: replay / first execution", med["replay"]/med["fresh key"], ">=", 2.00)
	return nil
}
