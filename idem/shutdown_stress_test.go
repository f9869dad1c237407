package idem_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

type shutdownEvent struct {
	what string
	key  string
	at   time.Time
	late bool // the request was sent after Shutdown was called
}

// TestShutdownStressInvariants: hundreds of requests (fresh keys, duplicates, anonymous with
// a key header, lease routes with and without a key) while Shutdown runs, under -race.
// Invariants checked:
//   - when Shutdown returned an error before its grace ran out, no handler of this middleware
//     started or ended after it returned, and no key was claimed after it;
//   - when Shutdown returned nil, no handler of a request that had passed its principal before
//     Shutdown was called is still running or starts after;
//   - the tx route's effects match its 2xx answers, one per key at most; no key is left in
//     progress.
func TestShutdownStressInvariants(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 8)
	pgtest.Exec(t, pool, `CREATE TABLE stress_effects (id serial PRIMARY KEY, k text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`)
	rounds := 6
	for round := 0; round < rounds; round++ {
		deadline := []time.Duration{30 * time.Millisecond, 120 * time.Millisecond, 3 * time.Second}[round%3]
		t.Run(fmt.Sprintf("round=%d_deadline=%v", round, deadline), func(t *testing.T) {
			var mu sync.Mutex
			var events []shutdownEvent
			add := func(what, key string, late bool) {
				mu.Lock()
				events = append(events, shutdownEvent{what, key, time.Now(), late})
				mu.Unlock()
			}
			var principals sync.WaitGroup
			var shutdownCalled atomic.Bool
			m, err := idem.New(ctx, idem.Options{DB: pool, Principal: func(r *http.Request) (string, bool) {
				if r.Header.Get("X-Phase") == "early" {
					defer principals.Done()
				}
				return bearerOK(r)
			}, DuplicateWait: 2 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			prefix := fmt.Sprintf("r%d-", round)
			txH := m.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				k := r.Header.Get("Idempotency-Key")
				late := r.Header.Get("X-Phase") == "late"
				add("tx_start", k, late)
				sleep := rand.IntN(200)
				if _, err := idem.TxFrom(r.Context()).Exec(r.Context(), `INSERT INTO stress_effects (k) VALUES ($1)`, k); err != nil {
					add("tx_fail", k, late)
					http.Error(w, err.Error(), 500)
					return
				}
				if _, err := idem.TxFrom(r.Context()).Exec(r.Context(), fmt.Sprintf(`SELECT pg_sleep(%f)`, float64(sleep)/1000)); err != nil {
					add("tx_fail", k, late)
					http.Error(w, err.Error(), 500)
					return
				}
				add("tx_end", k, late)
				w.WriteHeader(201)
				fmt.Fprint(w, `{"id":1}`)
			}))
			leaseH := m.Route(idem.Route{Action: "POST /pay", Lease: 2 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				k := r.Header.Get("Idempotency-Key")
				late := r.Header.Get("X-Phase") == "late"
				add("lease_start", k, late)
				select {
				case <-r.Context().Done():
					add("lease_cut", k, late)
					return
				case <-time.After(time.Duration(rand.IntN(250)) * time.Millisecond):
				}
				add("lease_end", k, late)
				w.WriteHeader(201)
				fmt.Fprint(w, `{"id":2}`)
			}))
			type result struct {
				kind, key string
				code      int
				replayed  bool
				late      bool
			}
			var rmu sync.Mutex
			var results []result
			var wg sync.WaitGroup
			send := func(i int, late bool) {
				defer wg.Done()
				kind := []string{"tx", "tx", "tx_dup", "anon", "lease", "lease_nokey", "lease_anon"}[i%7]
				key := fmt.Sprintf("%s%s-%d", prefix, kind, i)
				if kind == "tx_dup" {
					key = fmt.Sprintf("%sdup-%d", prefix, i%5)
				}
				path, h := "/t", txH
				if strings.HasPrefix(kind, "lease") {
					path, h = "/pay", leaseH
				}
				req := httptest.NewRequest("POST", path, strings.NewReader(`{"a":1}`))
				req.Header.Set("Content-Type", "application/json")
				if kind != "lease_nokey" {
					req.Header.Set("Idempotency-Key", key)
				} else {
					key = ""
				}
				if kind != "anon" && kind != "lease_anon" {
					req.Header.Set("Authorization", "Bearer ok")
				}
				if late {
					req.Header.Set("X-Phase", "late")
				} else {
					req.Header.Set("X-Phase", "early")
				}
				w := httptest.NewRecorder()
				h.ServeHTTP(w, req)
				rmu.Lock()
				res := result{kind, key, w.Code, w.Header().Get("Idempotent-Replayed") != "", late}
				if w.Code >= 400 {
					var p struct{ Code string }
					_ = json.Unmarshal(w.Body.Bytes(), &p)
					res.kind += "/" + p.Code
				}
				results = append(results, res)
				rmu.Unlock()
			}
			const early, late = 150, 150
			principals.Add(early)
			wg.Add(early)
			for i := 0; i < early; i++ {
				go send(i, false)
			}
			principals.Wait() // every early request has been counted (its principal ran)
			sctx, cancel := context.WithTimeout(ctx, deadline)
			defer cancel()
			stopLate := make(chan struct{})
			var lateWG sync.WaitGroup
			lateWG.Add(1)
			go func() {
				defer lateWG.Done()
				for i := early; i < early+late; i++ {
					select {
					case <-stopLate:
						return
					default:
					}
					wg.Add(1)
					go send(i, true)
					time.Sleep(time.Millisecond)
				}
			}()
			shutdownCalled.Store(true)
			start := time.Now()
			serr := m.Shutdown(sctx)
			ret := time.Now()
			close(stopLate)
			lateWG.Wait()
			wg.Wait()
			took := ret.Sub(start)
			mu.Lock()
			evs := append([]shutdownEvent(nil), events...)
			mu.Unlock()
			t.Logf("Shutdown returned %v after %v (deadline %v); %d events", serr, took.Round(time.Millisecond), deadline, len(evs))
			graceExhausted := serr != nil && took >= deadline+5*time.Second-100*time.Millisecond
			for _, e := range evs {
				if !e.at.After(ret) || (strings.Contains(e.key, "-anon-") && strings.HasPrefix(e.what, "tx_")) {
					continue // an anonymous request on a transactional route is not the middleware's work
				}
				switch {
				case serr != nil && !graceExhausted:
					t.Errorf("Shutdown returned %v at +%v, before its grace ran out, but %s for key %q (late=%v) came %v after it",
						serr, took.Round(time.Millisecond), e.what, e.key, e.late, e.at.Sub(ret).Round(time.Microsecond))
				case serr == nil && !e.late:
					t.Errorf("Shutdown returned nil, but %s for key %q of a request counted before Shutdown came %v after it",
						e.what, e.key, e.at.Sub(ret).Round(time.Microsecond))
				}
			}
			// Keys claimed after Shutdown returned with an error.
			if serr != nil && !graceExhausted {
				n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key LIKE $1 AND claimed_at > $2`, prefix+"%", ret)
				if n > 0 {
					t.Errorf("%d keys claimed after Shutdown returned %v", n, serr)
				}
				n = pgtest.Count(t, pool, `SELECT count(*) FROM stress_effects WHERE k LIKE $1 AND k NOT LIKE '%-anon-%' AND at > $2`, prefix+"%", ret)
				if n > 0 {
					t.Errorf("%d effects written after Shutdown returned %v", n, serr)
				}
			}
			// Effects of the tx route: one per key at most, and one for every key answered 2xx.
			ok := map[string]bool{}
			unknown := map[string]bool{} // 503 outcome_unknown: a COMMIT in flight at the deadline may have landed
			codes := map[string]int{}
			for _, r := range results {
				codes[fmt.Sprintf("%s:%d", r.kind, r.code)]++
				if (r.kind == "tx" || r.kind == "tx_dup") && r.code == 201 {
					ok[r.key] = true
				}
				if strings.HasSuffix(r.kind, "/"+idem.CodeOutcomeUnknown) {
					unknown[r.key] = true
				}
			}
			t.Logf("answers: %v", codes)
			for k, n := range codes {
				if strings.Contains(k, "store_unavailable") || strings.Contains(k, "internal_error") {
					t.Errorf("%d answers %s: Shutdown's deadline is not a store failure", n, k)
				}
			}
			rows, err := pool.Query(ctx, `SELECT k, count(*) FROM stress_effects WHERE k LIKE $1 GROUP BY k`, prefix+"%")
			if err != nil {
				t.Fatal(err)
			}
			effects := map[string]int{}
			for rows.Next() {
				var k string
				var n int
				if err := rows.Scan(&k, &n); err != nil {
					t.Fatal(err)
				}
				effects[k] = n
			}
			rows.Close()
			for k := range ok {
				if effects[k] != 1 {
					t.Errorf("key %q answered 201 but has %d effects", k, effects[k])
				}
			}
			for k, n := range effects {
				if strings.Contains(k, "anon") {
					continue
				}
				if n != 1 || (!ok[k] && !unknown[k]) {
					t.Errorf("key %q has %d effects, answered 201: %v", k, n, ok[k])
				}
			}
			if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key LIKE $1 AND state = 'p' AND lease_expires_at > now()`, prefix+"%"); n > 0 {
				t.Errorf("%d keys left in progress", n)
				rows, _ := pool.Query(ctx, `SELECT key, attempt, coalesce(extract(epoch FROM lease_expires_at - now()), -1)::float8, coalesce(extract(epoch FROM claimed_at - $2::timestamptz), -999)::float8 FROM idem.idempotency_keys WHERE key LIKE $1 AND state = 'p' AND lease_expires_at > now()`, prefix+"%", ret)
				for rows.Next() {
					var k string
					var a int64
					var left, claimedRel float64
					_ = rows.Scan(&k, &a, &left, &claimedRel)
					var answer []string
					for _, r := range results {
						if r.key == k {
							answer = append(answer, fmt.Sprint(r.code))
						}
					}
					var kev []string
					for _, e := range evs {
						if e.key == k {
							kev = append(kev, fmt.Sprintf("%s@%+v", e.what, e.at.Sub(ret).Round(time.Millisecond)))
						}
					}
					t.Logf("  in progress: %s attempt %d lease left %.2fs claimed %.3fs after Shutdown returned; answers %v; events %v", k, a, left, claimedRel, answer, kev)
				}
				rows.Close()
			}
		})
	}
}
