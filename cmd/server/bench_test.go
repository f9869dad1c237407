package main

import (
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
)

// BenchmarkHTTPTransfer drives POST /v1/transfers through the real program in this process
// (router, authentication, the idempotency middleware, the ledger, PostgreSQL over pgx):
// without a key, with a fresh key per request, and replaying completed keys. It exists to
// profile the Go path (make bench measures the rates, with the load outside the server):
//
//	go test -run XXX -bench HTTPTransfer -benchtime 5s -cpuprofile cpu.out -memprofile mem.out ./cmd/server
//	go tool pprof -top -focus 'net/http.\(\*conn\).serve' cmd/server/server.test cpu.out
//
// The focus keeps the server's goroutines and leaves out the benchmark's own HTTP client.
func BenchmarkHTTPTransfer(b *testing.B) {
	s := startServer(b, map[string]string{"TRANSFERS_REQUIRE_KEY": "false", "LOG_LEVEL": "error"})
	_, token := s.principal("bench")
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	post := func(path, key, body string) (int, string) {
		req, err := http.NewRequest(http.MethodPost, s.url+path, strings.NewReader(body))
		if err != nil {
			return -1, err.Error()
		}
		req.Header.Set("Authorization", "Bearer "+token)
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		res, err := client.Do(req)
		if err != nil {
			return -1, err.Error()
		}
		defer res.Body.Close()
		out, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(out)
	}
	idField := regexp.MustCompile(`"id":(\d+)`)
	ids := make([]int, 100)
	for i := range ids {
		st, body := post("/v1/accounts", "", `{"name":"a","currency":"EUR"}`)
		m := idField.FindStringSubmatch(body)
		if st != http.StatusCreated || m == nil {
			b.Fatalf("create account: %d %s", st, body)
		}
		ids[i], _ = strconv.Atoi(m[1])
		if st, body := post(fmt.Sprintf("/v1/accounts/%d/deposits", ids[i]), "", `{"amount":1000000000000}`); st != http.StatusCreated {
			b.Fatalf("deposit: %d %s", st, body)
		}
	}
	transfer := func(rng *rand.Rand) string {
		a := rng.IntN(len(ids))
		c := (a + 1 + rng.IntN(len(ids)-1)) % len(ids)
		return fmt.Sprintf(`{"from":%d,"to":%d,"amount":1}`, ids[a], ids[c])
	}
	type done struct{ key, body string }
	replays := make([]done, 500)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range replays {
		replays[i] = done{fmt.Sprintf("replay-%d", i), transfer(rng)}
		if st, body := post("/v1/transfers", replays[i].key, replays[i].body); st != http.StatusCreated {
			b.Fatalf("complete a key to replay: %d %s", st, body)
		}
	}

	var seq atomic.Int64
	for _, variant := range []string{"no key", "fresh key", "replay"} {
		b.Run(strings.ReplaceAll(variant, " ", "_"), func(b *testing.B) {
			b.SetParallelism(4) // 8 clients on 2 cores, as the pool is 20
			b.RunParallel(func(pb *testing.PB) {
				rng := rand.New(rand.NewPCG(uint64(seq.Add(1)), 7))
				for pb.Next() {
					key, body := "", transfer(rng)
					switch variant {
					case "fresh key":
						key = fmt.Sprintf("k-%d", seq.Add(1))
					case "replay":
						d := replays[rng.IntN(len(replays))]
						key, body = d.key, d.body
					}
					if st, out := post("/v1/transfers", key, body); st != http.StatusCreated {
						b.Errorf("%s: %d %s", variant, st, out)
						return
					}
				}
			})
		})
	}
}
