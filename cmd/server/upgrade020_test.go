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
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
	"github.com/pgidem/pgidem/internal/release020"
)

// The upgrade from release 0.2.0: its real server (built from git, internal/release020) serves a
// database it migrated and filled while this tree's migrate runs. Every migration after 0.2.0
// must be expand-only for it: 0.2.0 keeps answering keyed requests without a 5xx during this
// migrate and after it, every key 0.2.0 stored replays through this tree's server, and a lease
// claim 0.2.0 has in flight keeps its provider key.

// storedHeaders020 are the response headers 0.2.0's middleware stores and replays (its
// default Options.StoredHeaders).
var storedHeaders020 = []string{"Content-Type", "Location", "ETag", "Content-Location", "Last-Modified"}

// exchange is one keyed request and its answer.
type exchange struct {
	method, path, key, body string
	status                  int
	header                  http.Header // the stored headers of the answer, and Idempotent-Replayed
	resp                    string
	began, ended            time.Time
}

// stored tells whether 0.2.0 stores an answer of this status for replay: a 2xx or a final
// error (its default FinalStatus).
func (e exchange) stored() bool {
	return e.status/100 == 2 || slices.Contains([]int{400, 403, 404, 409, 410, 412, 413, 415, 422}, e.status) &&
		!strings.Contains(e.resp, "request_in_progress")
}

// same tells whether two answers are the same byte for byte: status, body and stored headers.
func (e exchange) same(o exchange) bool {
	if e.status != o.status || e.resp != o.resp {
		return false
	}
	for _, h := range storedHeaders020 {
		if !slices.Equal(e.header.Values(h), o.header.Values(h)) {
			return false
		}
	}
	return true
}

func (e exchange) String() string {
	var h []string
	for _, name := range storedHeaders020 {
		if v := e.header.Values(name); len(v) > 0 {
			h = append(h, name+": "+strings.Join(v, ", "))
		}
	}
	return fmt.Sprintf("%d [%s] %q", e.status, strings.Join(h, "; "), e.resp)
}

// keyedSender sends keyed requests of one principal to a server.
type keyedSender struct {
	t     *testing.T
	token string
}

func (k keyedSender) send(base, method, path, key, body string) exchange {
	e := exchange{method: method, path: path, key: key, body: body, began: time.Now()}
	var h http.Header
	e.status, h, e.resp = pgtest.Send(k.t, context.Background(), method, base+path, body,
		"Authorization", "Bearer "+k.token, "Idempotency-Key", key, "Content-Type", "application/json")
	e.ended = time.Now()
	e.header = http.Header{}
	for _, name := range append(slices.Clone(storedHeaders020), "Idempotent-Replayed") {
		if v := h.Values(name); len(v) > 0 {
			e.header[name] = v
		}
	}
	return e
}

// binary020 builds (or finds) release 0.2.0's server, and says how long that took.
func binary020(t *testing.T) {
	t.Helper()
	began := time.Now()
	bin, err := release020.Binary()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("release 0.2.0's server (commit %.12s): %s, ready in %v", release020.Commit, bin, time.Since(began).Round(time.Millisecond))
}

// migrateLogged runs this tree's `server migrate` on url and returns how long it took.
func migrateLogged(t *testing.T, url string) time.Duration {
	t.Helper()
	var log bytes.Buffer
	m := NewMain(io.Discard, &log)
	if err := m.ParseFlags([]string{"migrate"}, serverEnv(url, nil)); err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	err := m.Run(context.Background())
	took := time.Since(began)
	_ = m.Close()
	if err != nil {
		t.Fatalf("this tree's migrate over 0.2.0: %v\n%s", err, log.String())
	}
	return took
}

// TestUpgradeFrom020UnderTraffic: release 0.2.0's server, on a database its own migrate made and
// that holds UPGRADE_KEYS keys of its shape (20,000 by default; `make upgrade-check` runs 1.5
// million), answers six clients' keyed deposits, transfers (some refused 422, a stored final
// error), payouts (a lease route) and replays of their keys while this tree's migrate runs and
// 1.5 s after it. No answer may be a 5xx (or a failed connection). Then 0.2.0 stops, this
// tree's server starts on the database, and every key 0.2.0 answered replays through it byte
// for byte: status, body and stored headers; every key took effect once.
func TestUpgradeFrom020UnderTraffic(t *testing.T) {
	t.Parallel()
	fill := 20000
	if v := os.Getenv("UPGRADE_KEYS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			t.Fatalf("UPGRADE_KEYS=%q: want a number of keys", v)
		}
		fill = n
	}
	binary020(t)
	ctx := context.Background()
	url := pgtest.NewEmptyDB(t)
	if err := release020.Migrate(ctx, url); err != nil {
		t.Fatal(err)
	}
	conn := pgtest.Connect(t, url)
	began := time.Now()
	if err := release020.Fill(ctx, conn, fill); err != nil {
		t.Fatal(err)
	}
	t.Logf("0.2.0's key table filled with %d keys in %v", fill, time.Since(began).Round(time.Millisecond))
	_, token, err := release020.Principal(ctx, url, "alice")
	if err != nil {
		t.Fatal(err)
	}
	old, err := release020.Serve(ctx, url, map[string]string{"PAYOUT_PROVIDER_DELAY": "10ms", "DATABASE_POOL_SIZE": "8"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = old.Kill() })
	k := keyedSender{t: t, token: token}

	var (
		mu        sync.Mutex
		exchanges []exchange
	)
	record := func(e exchange) exchange {
		mu.Lock()
		exchanges = append(exchanges, e)
		mu.Unlock()
		return e
	}
	account := func(key string) int64 {
		e := record(k.send(old.URL, "POST", "/v1/accounts", key, `{"name":"`+key+`","currency":"EUR"}`))
		var a struct{ ID int64 }
		if e.status != http.StatusCreated || json.Unmarshal([]byte(e.resp), &a) != nil {
			t.Fatalf("0.2.0's POST /v1/accounts: %v\n%s", e, old.Log())
		}
		return a.ID
	}
	a1, a2 := account("acct-1"), account("acct-2")
	// Payouts go to an account of their own: in 0.2.0 a transfer locked its accounts FOR
	// UPDATE, and a payout's record on one of them could deadlock with it (a 500 of 0.2.0's
	// own, with or without a migrate; D185).
	a3 := account("acct-3")

	var (
		stop  = make(chan struct{})
		wg    sync.WaitGroup
		total atomic.Int64
	)
	const clients = 6
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(c), 20))
			var mine []exchange // this client's answers that 0.2.0 stored, to replay
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				key := fmt.Sprintf("c%d-%d", c, i)
				var e exchange
				switch i % 8 {
				case 0, 1, 2:
					e = k.send(old.URL, "POST", fmt.Sprintf("/v1/accounts/%d/deposits", a1), key, `{"amount":1}`)
				case 3:
					e = k.send(old.URL, "POST", "/v1/transfers", key, fmt.Sprintf(`{"from":%d,"to":%d,"amount":1}`, a1, a2))
				case 4: // more than a2 ever holds: 422 insufficient_funds, a stored final error
					e = k.send(old.URL, "POST", "/v1/transfers", key, fmt.Sprintf(`{"from":%d,"to":%d,"amount":1000000000}`, a2, a1))
				case 5:
					e = k.send(old.URL, "POST", "/v1/payouts", key, fmt.Sprintf(`{"account":%d,"amount":3}`, a3))
				default: // a retry of an earlier request of this client, with its key
					if len(mine) == 0 {
						continue
					}
					p := mine[rng.IntN(len(mine))]
					e = k.send(old.URL, p.method, p.path, p.key, p.body)
				}
				record(e)
				total.Add(1)
				if e.stored() && i%8 < 6 {
					mine = append(mine, e)
				}
			}
		}()
	}
	for total.Load() < 100 {
		time.Sleep(10 * time.Millisecond)
	}

	// The functions of 0.2.0, by oid: this migrate may replace them in place, never drop one
	// (a call of 0.2.0 planned before the drop and run after it fails: D135).
	functionsOf := func() map[string]uint32 {
		rows, err := conn.Query(ctx, `SELECT p.oid::regprocedure::text, p.oid FROM pg_proc p WHERE p.pronamespace = 'idem'::regnamespace`)
		if err != nil {
			t.Fatal(err)
		}
		m := map[string]uint32{}
		for rows.Next() {
			var name string
			var oid uint32
			if err := rows.Scan(&name, &oid); err != nil {
				t.Fatal(err)
			}
			m[name] = oid
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return m
	}
	before := functionsOf()

	migStart := time.Now()
	took := migrateLogged(t, url)
	migEnd := time.Now()
	after := functionsOf()
	for name, oid := range before {
		if after[name] != oid {
			t.Errorf("0.2.0's function %s was dropped by this migrate (oid %d, now %d): 0.2.0's calls in flight fail", name, oid, after[name])
		}
	}
	time.Sleep(1500 * time.Millisecond) // 0.2.0 keeps serving on the migrated database
	close(stop)
	wg.Wait()

	// 0.2.0's answers before, during and after the migrate.
	type phase struct {
		statuses map[int]int
		slowest  time.Duration
	}
	phases := map[string]*phase{}
	var failed []exchange
	for _, e := range exchanges {
		name := "before"
		switch {
		case e.began.After(migEnd):
			name = "after"
		case e.ended.After(migStart):
			name = "during"
		}
		p := phases[name]
		if p == nil {
			p = &phase{statuses: map[int]int{}}
			phases[name] = p
		}
		p.statuses[e.status]++
		p.slowest = max(p.slowest, e.ended.Sub(e.began))
		if e.status >= 500 || e.status < 0 {
			failed = append(failed, e)
		}
	}
	t.Logf("this tree's migrate took %v over %d keys of 0.2.0; 0.2.0 answered %d keyed requests", took.Round(time.Millisecond), fill, len(exchanges))
	for _, name := range []string{"before", "during", "after"} {
		if p := phases[name]; p != nil {
			t.Logf("  %-6s the migrate: %v, the slowest %v", name, p.statuses, p.slowest.Round(time.Millisecond))
		}
	}
	if phases["after"] == nil {
		t.Error("0.2.0 answered nothing after the migrate")
	}
	t.Logf("0.2.0's answers with a status of 500 or more (or no answer): %d", len(failed))
	for i, e := range failed {
		if i < 5 {
			t.Errorf("0.2.0 answered %s %s (key %s) %v: want no 5xx during or after the migrate", e.method, e.path, e.key, e)
		}
	}
	if err := old.Stop(); err != nil {
		t.Errorf("0.2.0's shutdown: %v", err)
	}
	if t.Failed() {
		t.Fatalf("0.2.0's log:\n%s", old.Log())
	}

	// Every key 0.2.0 answered, through this tree's server.
	byKey := map[string][]exchange{}
	var keys []string
	for _, e := range exchanges {
		if _, ok := byKey[e.key]; !ok {
			keys = append(keys, e.key)
		}
		byKey[e.key] = append(byKey[e.key], e)
	}
	sort.Strings(keys)
	s := serveOn(t, url, nil)
	var (
		replayed atomic.Int64
		next     atomic.Int64
		rw       sync.WaitGroup
		bad      sync.Mutex
		mismatch []string
	)
	for range 4 {
		rw.Add(1)
		go func() {
			defer rw.Done()
			for i := int(next.Add(1)) - 1; i < len(keys); i = int(next.Add(1)) - 1 {
				all := byKey[keys[i]]
				first := all[0]
				var problems []string
				if !first.stored() {
					problems = append(problems, fmt.Sprintf("0.2.0's first answer %v is not one it stores", first))
				}
				for _, e := range all[1:] {
					if !e.same(first) || e.header.Get("Idempotent-Replayed") != "true" {
						problems = append(problems, fmt.Sprintf("0.2.0's own retry got %v (replayed %q)", e, e.header.Get("Idempotent-Replayed")))
					}
				}
				r := k.send(s.url, first.method, first.path, first.key, first.body)
				if !r.same(first) || r.header.Get("Idempotent-Replayed") != "true" {
					problems = append(problems, fmt.Sprintf("this tree's server answered %v (replayed %q)", r, r.header.Get("Idempotent-Replayed")))
				} else {
					replayed.Add(1)
				}
				if len(problems) > 0 {
					bad.Lock()
					mismatch = append(mismatch, fmt.Sprintf("key %s (%s %s): 0.2.0 answered %v; %s", first.key, first.method, first.path,
						first, strings.Join(problems, "; ")))
					bad.Unlock()
				}
			}
		}()
	}
	rw.Wait()
	sort.Strings(mismatch)
	for i, m := range mismatch {
		if i < 10 {
			t.Error(m)
		}
	}
	if len(mismatch) > 10 {
		t.Errorf("... %d keys in all do not replay as 0.2.0 answered them", len(mismatch))
	}
	t.Logf("%d of %d keys answered by 0.2.0 replayed byte for byte through this tree's server", replayed.Load(), len(keys))

	// Every key took effect once: one row per key that 0.2.0 answered 201.
	var want [3]int // keys answered 201: deposits, transfers, payouts
	for _, key := range keys {
		if e := byKey[key][0]; e.status == http.StatusCreated {
			switch {
			case strings.HasSuffix(e.path, "/deposits"):
				want[0]++
			case e.path == "/v1/transfers":
				want[1]++
			case e.path == "/v1/payouts":
				want[2]++
			}
		}
	}
	var deposits, transfers, payouts int
	if err := conn.QueryRow(ctx, `SELECT (SELECT count(DISTINCT idempotency_key) FROM ledger.deposits WHERE idempotency_key IS NOT NULL),
		(SELECT count(*) FROM ledger.transfers), (SELECT count(*) FROM ledger.payouts)`).Scan(&deposits, &transfers, &payouts); err != nil {
		t.Fatal(err)
	}
	if got := [3]int{deposits, transfers, payouts}; got != want {
		t.Errorf("deposits, transfers and payouts in the ledger: %v; keys 0.2.0 answered 201 for each: %v", got, want)
	}

	// Keys of the fill (0.2.0's rows written straight into its table) replay too.
	for _, g := range []int{1, fill / 2, fill} {
		if g < 1 {
			continue
		}
		var outcome string
		var status int
		if err := conn.QueryRow(ctx, `SELECT outcome, response_status FROM idem.idem_begin('p_fill', 'fill-' || $1::integer,
			'POST /v1/accounts/{id}/deposits', sha256($1::integer::text::bytea))`, g).Scan(&outcome, &status); err != nil ||
			outcome != "replay" || status != http.StatusCreated {
			t.Errorf("fill key %d after the migrate: %s %d %v, want a replay of 201", g, outcome, status, err)
		}
	}
}

// TestUpgradeFrom020LeaseInFlight: a payout that release 0.2.0's server has claimed (a lease
// claim) and is still working on while this tree's migrate runs keeps its lease (0.2.0's
// heartbeat goes on extending it on the migrated database) and its provider key: once 0.2.0 dies
// and the lease runs out, idem_begin takes the claim over in the same generation with the
// provider key 0.2.0 handed the provider, and this tree's server, retrying the payout, pays
// under that key (the provider counts a repeat, not a second payout).
func TestUpgradeFrom020LeaseInFlight(t *testing.T) {
	t.Parallel()
	binary020(t)
	ctx := context.Background()
	url := pgtest.NewEmptyDB(t)
	if err := release020.Migrate(ctx, url); err != nil {
		t.Fatal(err)
	}
	conn := pgtest.Connect(t, url)
	principal, token, err := release020.Principal(ctx, url, "alice")
	if err != nil {
		t.Fatal(err)
	}
	// A provider that takes ten minutes: the payout stays in flight across the migrate.
	old, err := release020.Serve(ctx, url, map[string]string{"PAYOUTS_LEASE": "1s", "PAYOUT_PROVIDER_DELAY": "10m", "SHUTDOWN_TIMEOUT": "1s"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = old.Kill() })
	k := keyedSender{t: t, token: token}
	acct := k.send(old.URL, "POST", "/v1/accounts", "acct", `{"name":"main","currency":"EUR"}`)
	var a struct{ ID int64 }
	if acct.status != http.StatusCreated || json.Unmarshal([]byte(acct.resp), &a) != nil {
		t.Fatalf("0.2.0's POST /v1/accounts: %v", acct)
	}
	body := fmt.Sprintf(`{"account":%d,"amount":7}`, a.ID)
	const key = "payout-in-flight"
	go func() { _ = k.send(old.URL, "POST", "/v1/payouts", key, body) }() // ends when 0.2.0 is killed

	// 0.2.0 has claimed the key and called the provider with its provider key.
	pgtest.WaitFor(t, conn, `SELECT count(*) FROM provider.payouts`)
	var providerKey string
	var attempt int64
	var fingerprint []byte
	if err := conn.QueryRow(ctx, `SELECT p.idempotency_key, k.attempt, k.request_sha256
		FROM provider.payouts AS p, idem.idempotency_keys AS k WHERE k.principal_id = $1 AND k.key = $2 AND k.state = 'p'`,
		principal, key).Scan(&providerKey, &attempt, &fingerprint); err != nil {
		t.Fatal(err)
	}
	inProgress := func(when string) {
		t.Helper()
		var outcome, pk string
		if err := conn.QueryRow(ctx, `SELECT outcome, provider_key FROM idem.idem_begin($1, $2, 'POST /v1/payouts', $3)`,
			principal, key, fingerprint).Scan(&outcome, &pk); err != nil || outcome != "in_progress" || pk != providerKey {
			t.Fatalf("idem_begin on 0.2.0's lease claim %s: %s %s %v, want in_progress with 0.2.0's provider key %s",
				when, outcome, pk, err, providerKey)
		}
	}
	inProgress("before the migrate")

	took := migrateLogged(t, url)
	t.Logf("this tree's migrate took %v while 0.2.0's payout was in flight", took.Round(time.Millisecond))
	inProgress("after the migrate")
	// 0.2.0's heartbeat (every third of its 1 s lease) goes on extending the lease.
	var leaseEnd time.Time
	if err := conn.QueryRow(ctx, `SELECT lease_expires_at FROM idem.idempotency_keys WHERE principal_id = $1 AND key = $2`,
		principal, key).Scan(&leaseEnd); err != nil {
		t.Fatal(err)
	}
	pgtest.WaitFor(t, conn, `SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = $1 AND key = $2 AND lease_expires_at > $3`,
		principal, key, leaseEnd)
	if strings.Contains(old.Log(), `"level":"ERROR"`) {
		t.Errorf("0.2.0 logged errors while its payout was in flight across the migrate:\n%s", old.Log())
	}

	// 0.2.0 dies mid-payout; its lease runs out within a second.
	if err := old.Kill(); err != nil {
		t.Fatal(err)
	}
	pgtest.WaitFor(t, conn, `SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = $1 AND key = $2 AND lease_expires_at < now()`,
		principal, key)
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var outcome, pk string
	var took2 int64
	err = tx.QueryRow(ctx, `SELECT outcome, attempt, provider_key FROM idem.idem_begin($1, $2, 'POST /v1/payouts', $3, p_lease => '1 minute')`,
		principal, key, fingerprint).Scan(&outcome, &took2, &pk)
	_ = tx.Rollback(ctx) // the takeover is the new server's to make, below
	if err != nil || outcome != "claimed" || took2 <= attempt || pk != providerKey {
		t.Fatalf("idem_begin taking over 0.2.0's lease claim (attempt %d) after the migrate: %s, attempt %d, provider key %s (%v); "+
			"want claimed, a later attempt, 0.2.0's provider key %s", attempt, outcome, took2, pk, err, providerKey)
	}

	// The client's retry through this tree's server takes the payout over under the same
	// provider key; the provider (whose ten minutes are made up here) answers it from 0.2.0's
	// call.
	pgtest.Exec(t, conn, `UPDATE provider.payouts SET ready_at = clock_timestamp()`)
	s := serveOn(t, url, map[string]string{"PAYOUTS_LEASE": "5s"})
	r := k.send(s.url, "POST", "/v1/payouts", key, body)
	var p struct {
		ProviderKey string `json:"provider_key"`
	}
	if r.status != http.StatusCreated || json.Unmarshal([]byte(r.resp), &p) != nil || p.ProviderKey != providerKey {
		t.Fatalf("the retry of 0.2.0's payout through this tree's server: %v, want 201 with provider_key %s", r, providerKey)
	}
	calls := s.call("GET", "/v1/provider/calls/"+providerKey, token, "", "")
	var c struct{ Calls, Repeats int }
	if calls.status != http.StatusOK || json.Unmarshal([]byte(calls.body), &c) != nil || c.Calls != 1 || c.Repeats != 1 {
		t.Fatalf("the provider's calls under %s: %d %s, want 1 call (0.2.0's) and 1 repeat (the takeover's)", providerKey, calls.status, calls.body)
	}
	if again := k.send(s.url, "POST", "/v1/payouts", key, body); !again.same(r) || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("the payout's replay: %v, want %v replayed", again, r)
	}
}
