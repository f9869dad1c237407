package idem_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemtest"
)

// exampleDB is a database with schema idem installed for an example (idemtest finds a
// PostgreSQL as the package's tests do), and a pool on it.
func exampleDB() (*pgxpool.Pool, func()) {
	pool, err := pgxpool.New(context.Background(), idemtest.ExampleDB())
	if err != nil {
		log.Fatal(err)
	}
	return pool, pool.Close
}

// send POSTs body under key and prints the status, whether it was a replay, and the body.
func send(url, key, body string) { fmt.Println(answer(url, key, body)) }

// answer sends body to url under key and returns the status, whether it was a replay, and the
// body.
func answer(url, key, body string) string {
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("X-User", "alice")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		log.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return fmt.Sprint(res.StatusCode, " ", res.Header.Get("Idempotent-Replayed") == "true", " ", strings.TrimSpace(string(b)))
}

// The wiring: the middleware on a ServeMux route, a handler that writes through the
// request's transaction. The retry gets the first answer. (The database's owner installed
// schema idem beforehand, with package idemmigrate; New checks its version.)
func Example() {
	ctx := context.Background()
	pool, done := exampleDB()
	defer done()
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (id serial PRIMARY KEY, sku text NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	m, err := idem.New(ctx, idem.Options{
		DB:        pool,
		Principal: func(r *http.Request) (string, bool) { return r.Header.Get("X-User"), r.Header.Get("X-User") != "" },
	})
	if err != nil {
		log.Fatal(err)
	}
	createOrder := func(w http.ResponseWriter, r *http.Request) {
		var o struct {
			SKU string `json:"sku"`
		}
		if !idem.DecodeJSON(w, r, &o) {
			return
		}
		var id int
		if err := idem.TxFrom(r.Context()).QueryRow(r.Context(),
			`INSERT INTO orders (sku) VALUES ($1) RETURNING id`, o.SKU).Scan(&id); err != nil {
			http.Error(w, "try again", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d,"sku":%q}`, id, o.SKU)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", m.Route(idem.Route{Required: true})(http.HandlerFunc(createOrder)))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	send(srv.URL+"/orders", "order-1", `{"sku":"a1"}`)
	send(srv.URL+"/orders", "order-1", `{"sku":"a1"}`) // the client retries
	send(srv.URL+"/orders", "order-1", `{"sku":"b2"}`) // another order under the same key
	// Output:
	// 201 false {"id":1,"sku":"a1"}
	// 201 true {"id":1,"sku":"a1"}
	// 422 false {"type":"https://github.com/pgidem/pgidem/blob/main/docs/http.md#idempotency_key_reuse","title":"Idempotency key reused for another request","status":422,"detail":"this Idempotency-Key was used for another request","code":"idempotency_key_reuse","changed_fields":["sku"]}
}

// A route whose meaning is narrower than its body: the client's trace id is not part of the
// request, so the fingerprint leaves it out, and a retry with a new trace id replays. Another
// amount is another request, however close: the rewritten body keeps every digit.
func ExampleRoute_fingerprint() {
	pool, done := exampleDB()
	defer done()
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true }})
	if err != nil {
		log.Fatal(err)
	}
	withoutTrace := func(r *http.Request, body []byte) idem.Fingerprint {
		// json.Number keeps every number's digits: through float64, amounts of 2^53 and more,
		// or of 17 significant digits, would share a fingerprint with their neighbours
		dec := json.NewDecoder(bytes.NewReader(body))
		dec.UseNumber()
		var v map[string]any
		if dec.Decode(&v) != nil || dec.More() {
			return idem.RequestFingerprint(r, body) // not one JSON object: the default
		}
		delete(v, "trace")
		body, _ = json.Marshal(v)
		return idem.ComputeFingerprint(r.Method, r.URL.EscapedPath(), body)
	}
	var runs int
	mux := http.NewServeMux()
	mux.Handle("POST /notes", m.Route(idem.Route{Fingerprint: withoutTrace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"run":%d}`, runs)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	send(srv.URL+"/notes", "n1", `{"text":"hi","amount":9007199254740993,"trace":"t-1"}`)
	send(srv.URL+"/notes", "n1", `{"text":"hi","amount":9007199254740993,"trace":"t-2"}`)
	send(srv.URL+"/notes", "n1", `{"text":"hi","amount":9007199254740992,"trace":"t-3"}`) // another amount
	// Output:
	// 201 false {"run":1}
	// 201 true {"run":1}
	// 422 false {"type":"https://github.com/pgidem/pgidem/blob/main/docs/http.md#idempotency_key_reuse","title":"Idempotency key reused for another request","status":422,"detail":"this Idempotency-Key was used for another request","code":"idempotency_key_reuse","changed_fields":["amount"]}
}

// A lease route for work outside the database: the provider deduplicates by the claim's
// provider key, which every attempt of the request shares. The lease is extended while the
// work runs; a repeat meanwhile waits for the answer and replays it, as does one after it.
func ExampleRoute_lease() {
	pool, done := exampleDB()
	defer done()
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true }})
	if err != nil {
		log.Fatal(err)
	}
	var mu sync.Mutex
	calls := map[string]int{} // the provider's calls, by its idempotency key
	pay := func(ctx context.Context, key string) string {
		mu.Lock()
		calls[key]++
		mu.Unlock()
		time.Sleep(2500 * time.Millisecond) // longer than the lease: the heartbeat keeps it
		return "po_1"
	}
	mux := http.NewServeMux()
	mux.Handle("POST /payouts", m.Route(idem.Route{Lease: time.Second, Required: true})(http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) {
			claim, _ := idem.ClaimOf(r.Context())
			ref := pay(r.Context(), claim.ProviderKey)
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"payout":%q}`, ref)
		})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	first := make(chan string, 1)
	go func() { first <- answer(srv.URL+"/payouts", "p1", `{"amount":700}`) }()
	time.Sleep(1300 * time.Millisecond) // past the first lease's end
	// Still running: the duplicate waits for the answer (without a connection), then replays it.
	duplicate := answer(srv.URL+"/payouts", "p1", `{"amount":700}`)
	fmt.Println(<-first)
	fmt.Println(duplicate)
	send(srv.URL+"/payouts", "p1", `{"amount":700}`) // done: the recorded answer
	mu.Lock()
	for _, n := range calls {
		fmt.Println("provider keys:", len(calls), "calls under it:", n)
	}
	mu.Unlock()
	// Output:
	// 201 false {"payout":"po_1"}
	// 201 true {"payout":"po_1"}
	// 201 true {"payout":"po_1"}
	// provider keys: 1 calls under it: 1
}

// Work that is not HTTP: a queue consumer runs a job at most once per message id, in the same
// transaction as the key's claim; a redelivery gets the stored result.
func ExampleDo() {
	ctx := context.Background()
	pool, done := exampleDB()
	defer done()
	if _, err := pool.Exec(ctx, `CREATE TABLE emails (id serial PRIMARY KEY, address text)`); err != nil {
		log.Fatal(err)
	}
	job := idem.Job{Principal: "mailer", Key: "msg-42", Action: "send welcome", Input: map[string]string{"to": "a@example.com"}}
	for range 2 { // the message is delivered twice
		id, replayed, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
			var id int
			err := tx.QueryRow(ctx, `INSERT INTO emails (address) VALUES ('a@example.com') RETURNING id`).Scan(&id)
			return id, err
		})
		fmt.Println(id, replayed, err)
	}
	// Output:
	// 1 false <nil>
	// 1 true <nil>
}

// The cleaner a service starts beside its routes: a pass every Interval (a minute by default),
// paced, one batch at a time across processes. Here a key whose TTL is a millisecond is gone
// after the first pass.
func ExampleStartCleaner() {
	ctx := context.Background()
	pool, done := exampleDB()
	defer done()
	job := idem.Job{Principal: "mailer", Key: "msg-1", Action: "send", TTL: time.Millisecond}
	if _, _, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (bool, error) { return true, nil }); err != nil {
		log.Fatal(err)
	}

	cleaner, err := idem.StartCleaner(ctx, pool, idem.CleanerOptions{Interval: 100 * time.Millisecond})
	if err != nil {
		log.Fatal(err)
	}
	defer cleaner.Stop()

	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if s, err := idem.ReadSummary(ctx, pool, false); err == nil && s[0].Keys == 0 {
			break
		}
	}
	s, _ := idem.ReadSummary(ctx, pool, false)
	fmt.Println("keys left:", s[0].Keys)
	// Output:
	// keys left: 0
}

// A database without schema idem: New (and CheckSchema, StartCleaner, the first Do) refuses
// it at start with an error that says what to run, instead of answering 503 to every request.
func ExampleCheckSchema() {
	ctx := context.Background()
	pool, done := exampleDB()
	defer done()
	if _, err := pool.Exec(ctx, `DROP SCHEMA idem CASCADE`); err != nil { // as if nobody had migrated
		log.Fatal(err)
	}
	_, err := idem.New(ctx, idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true }})
	var se *idem.SchemaError
	fmt.Println(errors.Is(err, idem.ErrNotMigrated), errors.As(err, &se) && se.Schema == 0)
	fmt.Println(strings.Contains(err.Error(), "idemmigrate.Migrate"))
	// Output:
	// true true
	// true
}
