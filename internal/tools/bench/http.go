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
	"strings"
	"sync"
	"time"
)

// httpBench drives POST /v1/transfers of the reference server (built from ./cmd/server and
// run against the benchmark's PostgreSQL) with clients concurrent clients: without a key,
// with a fresh key per request, and replaying completed keys, interleaved round by round.
func httpBench(ctx context.Context, url, tmp string, clients, seconds, rounds int) error {
	if err := setupEmpty(ctx, url, "bench_http"); err != nil {
		return err
	}
	bin := filepath.Join(tmp, "server")
	if out, err := exec.Command("go", "build", "-o", bin, "./cmd/server").CombinedOutput(); err != nil {
		return fmt.Errorf("build the server: %v\n%s", err, out)
	}
	dbURL := withDatabase(url, "bench_http")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	addr := ln.Addr().String()
	ln.Close()
	env := append(os.Environ(), "DATABASE_URL="+dbURL, "LISTEN_ADDR="+addr, "TRANSFERS_REQUIRE_KEY=false",
		"LOG_LEVEL=error", "CLEANUP_INTERVAL=0")
	run := func(args ...string) (string, error) {
		cmd := exec.Command(bin, args...)
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	if out, err := run("migrate"); err != nil {
		return fmt.Errorf("migrate: %v\n%s", err, out)
	}
	out, err := run("principal", "create", "bench")
	if err != nil {
		return fmt.Errorf("principal: %v\n%s", err, out)
	}
	m := regexp.MustCompile(`token (\S+)`).FindStringSubmatch(out)
	if m == nil {
		return fmt.Errorf("no token in %q", out)
	}
	token := m[1]
	srv := exec.Command(bin, "serve")
	srv.Env = env
	srv.Stderr = os.Stderr
	if err := srv.Start(); err != nil {
		return err
	}
	defer func() { _ = srv.Process.Signal(os.Interrupt); _ = srv.Wait() }()

	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: clients * 2}, Timeout: 30 * time.Second}
	base := "http://" + addr
	post := func(path, key, body string) (int, error) {
		req, _ := http.NewRequest("POST", base+path, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+token)
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		res, err := client.Do(req)
		if err != nil {
			return 0, err
		}
		_, _ = io.Copy(io.Discard, res.Body)
		res.Body.Close()
		return res.StatusCode, nil
	}
	for i := 0; i < 100; i++ { // wait for the server
		if _, err := post("/v1/accounts", "", `{"name":"probe","currency":"EUR"}`); err == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	const accounts = 200
	ids := make([]int, accounts)
	idRe := regexp.MustCompile(`"id":(\d+)`)
	for i := range ids {
		req, _ := http.NewRequest("POST", base+"/v1/accounts", strings.NewReader(`{"name":"a","currency":"EUR"}`))
		req.Header.Set("Authorization", "Bearer "+token)
		res, err := client.Do(req)
		if err != nil {
			return err
		}
		b, _ := io.ReadAll(res.Body)
		res.Body.Close()
		mm := idRe.FindSubmatch(b)
		if mm == nil {
			return fmt.Errorf("create account: %d %s", res.StatusCode, b)
		}
		fmt.Sscan(string(mm[1]), &ids[i])
		if st, err := post(fmt.Sprintf("/v1/accounts/%d/deposits", ids[i]), "", `{"amount":1000000000000}`); err != nil || st != 201 {
			return fmt.Errorf("deposit: %d %v", st, err)
		}
	}
	transfer := func(rng *rand.Rand) string {
		a := rng.IntN(accounts)
		b := (a + 1 + rng.IntN(accounts-1)) % accounts
		return fmt.Sprintf(`{"from":%d,"to":%d,"amount":1}`, ids[a], ids[b])
	}
	// Keys to replay: completed once, before the clock starts.
	type done struct{ key, body string }
	replays := make([]done, 2000)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range replays {
		replays[i] = done{fmt.Sprintf("replay-%d", i), transfer(rng)}
		if st, err := post("/v1/transfers", replays[i].key, replays[i].body); err != nil || st != 201 {
			return fmt.Errorf("seed replay: %d %v", st, err)
		}
	}

	type result struct {
		count     int
		latencies []time.Duration
		errors    int
	}
	variants := []string{"no key", "fresh key", "replay"}
	drive := func(variant string, round int) result {
		var mu sync.Mutex
		var res result
		var wg sync.WaitGroup
		deadline := time.Now().Add(time.Duration(seconds) * time.Second)
		for c := range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(uint64(round), uint64(c)))
				var lat []time.Duration
				errs := 0
				for n := 0; time.Now().Before(deadline); n++ {
					key, body := "", transfer(rng)
					switch variant {
					case "fresh key":
						key = fmt.Sprintf("r%d-c%d-n%d-%d", round, c, n, rng.Uint64())
					case "replay":
						d := replays[rng.IntN(len(replays))]
						key, body = d.key, d.body
					}
					start := time.Now()
					st, err := post("/v1/transfers", key, body)
					lat = append(lat, time.Since(start))
					if err != nil || st != 201 {
						errs++
					}
				}
				mu.Lock()
				res.latencies = append(res.latencies, lat...)
				res.count += len(lat)
				res.errors += errs
				mu.Unlock()
			}()
		}
		wg.Wait()
		return res
	}
	fmt.Printf("\nHTTP: POST /v1/transfers, %d clients, %d rounds of %ds per variant\n", clients, rounds, seconds)
	all := map[string][]result{}
	for r := 1; r <= rounds; r++ {
		for _, v := range variants {
			res := drive(v, r)
			all[v] = append(all[v], res)
			fmt.Printf("  round %d  %-10s %7.0f req/s  (%d errors)\n", r, v, float64(res.count)/float64(seconds), res.errors)
		}
	}
	rate := map[string]float64{}
	fmt.Printf("\n%-10s %10s %9s %9s\n", "variant", "req/s", "p50 ms", "p99 ms")
	for _, v := range variants {
		var lat []time.Duration
		var rates []float64
		for _, res := range all[v] {
			lat = append(lat, res.latencies...)
			rates = append(rates, float64(res.count)/float64(seconds))
		}
		slices.Sort(lat)
		rate[v] = median(rates)
		pct := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))]) / float64(time.Millisecond) }
		fmt.Printf("%-10s %10.0f %9.2f %9.2f\n", v, rate[v], pct(0.50), pct(0.99))
	}
	fmt.Println()
	fmt.Printf("%-44s %5.2f   target >= 0.80  %s\n", "fresh key / no key (HTTP)", rate["fresh key"]/rate["no key"],
		map[bool]string{true: "ok", false: "MISSED"}[rate["fresh key"]/rate["no key"] >= 0.8])
	fmt.Printf("%-44s %5.2f\n", "replay / fresh key (HTTP)", rate["replay"]/rate["fresh key"])
	return nil
}

func withDatabase(url, db string) string {
	if strings.HasPrefix(url, "postgres://") || strings.HasPrefix(url, "postgresql://") {
		i := strings.LastIndex(url, "/")
		q := ""
		if j := strings.Index(url[i:], "?"); j >= 0 {
			q = url[i+j:]
		}
		return url[:i+1] + db + q
	}
	return url + " dbname=" + db
}
