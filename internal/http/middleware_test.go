package idemhttp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorilla/mux"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// app is a real HTTP server over a real database. Its handlers write one effect row per run
// through the ambient transaction and answer as the request body says.
type app struct {
	t       testing.TB
	m       *idemhttp.Middleware
	pool    *pgxpool.Pool
	srv     *httptest.Server
	runs    atomic.Int32
	started chan struct{}
	// finished receives when a blocking handler of the effect route returns.
	finished chan struct{}
	release  chan struct{}
	// blocked is the request context of the last blocking handler of the effect route.
	blocked atomic.Pointer[context.Context]
	once    sync.Once
	seen    sync.Map // X-Test-Run -> runs, for the serialization-failure test
	// provider is the provider key the last run of the job route was given, keyed whether its
	// request had a key.
	provider atomic.Pointer[string]
	keyed    atomic.Bool
	// jobCauses receives the cause of a blocked job's context when it ended before release.
	jobCauses chan error
}

type order struct {
	Amount   int    `json:"amount"`
	Status   int    `json:"status"`
	Panic    bool   `json:"panic"`
	Block    bool   `json:"block"`
	Conflict bool   `json:"conflict"`
	InBatch  bool   `json:"in_batch"`
	Flush    bool   `json:"flush"`
	StepUp   bool   `json:"step_up"`
	Big      bool   `json:"big"`
	FK       bool   `json:"fk_violation"`
	ETag     string `json:"etag"`
	Problem  bool   `json:"problem"`
	Refuse   string `json:"refuse"`
	SleepMS  int    `json:"sleep_ms"`
	// Savepoint makes the handler take a savepoint named as the middleware's once was
	// (idem_claim), after its write.
	Savepoint bool `json:"savepoint"`
	// Code is the SQLSTATE of a conflict (default 40001); InRows raises it while the handler
	// reads rows, which it closes without asking Err.
	Code   string `json:"code"`
	InRows bool   `json:"in_rows"`
}

func newApp(t testing.TB, edit func(*idemhttp.Options)) *app {
	t.Helper()
	pool, _ := pgtest.NewPool(t, 80)
	a := &app{t: t, pool: pool, started: make(chan struct{}, 100), finished: make(chan struct{}, 100),
		release: make(chan struct{}), jobCauses: make(chan error, 10)}
	t.Cleanup(a.unblock) // a failing test must not leave a handler blocked until the timeout
	if _, err := pool.Exec(context.Background(), `CREATE TABLE effects (id serial PRIMARY KEY, path text, amount int);
		CREATE FUNCTION conflict_on(n int, code text) RETURNS int LANGUAGE plpgsql AS $$
		BEGIN
			IF n = 2 THEN RAISE EXCEPTION 'conflict' USING ERRCODE = code; END IF;
			RETURN n;
		END $$`); err != nil {
		t.Fatal(err)
	}
	opts := idemhttp.Options{
		DB: pool,
		Principal: func(r *http.Request) (string, bool) {
			p := r.Header.Get("X-Principal")
			return p, p != ""
		},
		Logger:             slog.New(slog.NewTextHandler(io.Discard, nil)),
		MaxBodyBytes:       1024,
		MaxStoredBodyBytes: 512,
		LockTimeout:        5 * time.Second,
		RouteTemplate:      muxTemplate,
	}
	if edit != nil {
		edit(&opts)
	}
	m, err := idemhttp.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	a.m = m
	r := mux.NewRouter()
	r.Handle("/transfers", m.Route(idemhttp.Route{Required: true})(http.HandlerFunc(a.effect))).Methods("POST")
	r.HandleFunc("/accounts/{id}/deposits", a.effect).Methods("POST")
	m.Declare("POST", "/accounts/{id}/deposits", idemhttp.Route{Action: "POST /accounts/{id}/deposits"})
	r.Handle("/tokens", m.Route(idemhttp.Route{})(http.HandlerFunc(a.token))).Methods("POST")
	r.Handle("/jobs", m.Route(idemhttp.Route{Lease: time.Minute})(http.HandlerFunc(a.job))).Methods("POST")
	r.HandleFunc("/undeclared", a.effect).Methods("POST")
	r.Use(m.Handler)
	a.srv = httptest.NewServer(r)
	t.Cleanup(func() { a.unblock(); a.srv.Close() }) // a blocked handler would keep Close waiting
	return a
}

func (a *app) effect(w http.ResponseWriter, r *http.Request) {
	n := a.runs.Add(1)
	var o order
	body, _ := io.ReadAll(r.Body)
	_ = json.Unmarshal(body, &o)
	if o.Panic {
		panic("handler bug")
	}
	var tx interface {
		Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
		QueryRow(context.Context, string, ...any) pgx.Row
	} = a.pool // an undeclared route writes on its own
	if t := idemhttp.Tx(r.Context()); t != nil {
		tx = t
	} else if r.URL.Path != "/undeclared" {
		http.Error(w, "no transaction", 500)
		return
	}
	if o.FK {
		_, err := tx.Exec(r.Context(), `DO $$ BEGIN RAISE EXCEPTION 'no parent' USING ERRCODE = '23503'; END $$`)
		http.Error(w, fmt.Sprint(err), 500)
		return
	}
	time.Sleep(time.Duration(o.SleepMS) * time.Millisecond)
	if o.Block || r.Header.Get("X-Block") != "" {
		defer func() { a.finished <- struct{}{} }()
		ctx := r.Context()
		a.blocked.Store(&ctx)
		a.started <- struct{}{}
		<-a.release
	}
	if o.Conflict {
		run := r.Header.Get("X-Test-Run")
		prev, _ := a.seen.LoadOrStore(run, new(atomic.Int32))
		if prev.(*atomic.Int32).Add(1) == 1 {
			code := o.Code
			if code == "" {
				code = "40001"
			}
			raise := `DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '` + code + `'; END $$`
			var err error
			switch {
			case o.InRows:
				// The error comes with the second row: the handler reads to the end and
				// closes, as many do, and never calls Err.
				rows, qerr := tx.(interface {
					Query(context.Context, string, ...any) (pgx.Rows, error)
				}).Query(r.Context(), `SELECT conflict_on(g, $1) FROM generate_series(1, 3) AS g`, code)
				if qerr == nil {
					for rows.Next() {
					}
					rows.Close()
				}
				http.Error(w, "could not read", 500)
				return
			case o.InBatch:
				b := &pgx.Batch{}
				b.Queue(raise)
				err = idemhttp.Tx(r.Context()).SendBatch(r.Context(), b).Close()
			default:
				_, err = tx.Exec(r.Context(), raise)
			}
			if err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
		}
	}
	var id int
	if err := tx.QueryRow(r.Context(), `INSERT INTO effects (path, amount) VALUES ($1, $2) RETURNING id`, r.URL.Path, o.Amount).Scan(&id); err != nil {
		http.Error(w, err.Error(), 500)
		return
	}
	if o.Savepoint {
		if _, err := tx.Exec(r.Context(), `SAVEPOINT idem_claim`); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
	}
	if o.Refuse != "" {
		idemhttp.Refuse(w, r, o.Refuse, "refused")
		return
	}
	if o.Flush {
		fmt.Fprint(w, `{"partial":`)
		w.(http.Flusher).Flush()
		panic("failed after flushing")
	}
	if o.StepUp && r.Header.Get("X-Step-Up") == "" {
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	status := o.Status
	if status == 0 {
		status = http.StatusCreated
	}
	if o.Problem {
		idemhttp.WriteProblem(w, status, "https://example.com/problems#", "rejected", "Rejected", "no", r.Header.Get("X-Request-Id"))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", fmt.Sprintf("/effects/%d", id))
	w.Header().Set("X-Not-Stored", "yes")
	if o.ETag != "" {
		w.Header().Set("ETag", o.ETag)
	}
	w.WriteHeader(status)
	if o.Big {
		fmt.Fprintf(w, `{"id":%d,"pad":%q}`, id, strings.Repeat("x", 2048))
		return
	}
	fmt.Fprintf(w, `{"id":%d,"amount":%d,"run":%d}`, id, o.Amount, n)
}

// unblock releases every handler blocked on a.release; safe to call more than once.
func (a *app) unblock() { a.once.Do(func() { close(a.release) }) }

func (a *app) token(w http.ResponseWriter, r *http.Request) {
	a.runs.Add(1)
	idemhttp.MarkOneTimeSecret(r.Context())
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"token":"secret-%d"}`, time.Now().UnixNano())
}

// job is a lease route's handler (work outside the database): it answers as the body says,
// after blocking when asked to.
func (a *app) job(w http.ResponseWriter, r *http.Request) {
	n := a.runs.Add(1)
	if idemhttp.Tx(r.Context()) != nil {
		http.Error(w, "a lease route has no transaction", 500)
		return
	}
	claim, keyed := idemhttp.ClaimOf(r.Context())
	a.provider.Store(&claim.ProviderKey)
	a.keyed.Store(keyed)
	var o order
	body, _ := io.ReadAll(r.Body)
	_ = json.Unmarshal(body, &o)
	time.Sleep(time.Duration(o.SleepMS) * time.Millisecond)
	if o.Block {
		a.started <- struct{}{}
		select {
		case <-a.release:
		case <-r.Context().Done():
			a.jobCauses <- context.Cause(r.Context())
			http.Error(w, "stopped", http.StatusServiceUnavailable)
			return
		}
	}
	status := o.Status
	if status == 0 {
		status = http.StatusAccepted
	}
	w.WriteHeader(status)
	fmt.Fprintf(w, `{"job":"done","run":%d}`, n)
}

type reply struct {
	status int
	header http.Header
	body   string
}

func (a *app) do(method, path, principal, key string, body string, headers ...string) reply {
	return a.doCtx(context.Background(), method, path, principal, key, body, headers...)
}

func (a *app) doCtx(ctx context.Context, method, path, principal, key string, body string, headers ...string) reply {
	a.t.Helper()
	status, header, b := pgtest.Send(a.t, ctx, method, a.srv.URL+path, body,
		append([]string{"X-Principal", principal, "Idempotency-Key", key}, headers...)...)
	return reply{status, header, b}
}

func (a *app) count(sql string, args ...any) int {
	a.t.Helper()
	return pgtest.Count(a.t, a.pool, sql, args...)
}

func (a *app) effects() int { return a.count(`SELECT count(*) FROM effects`) }
func (a *app) keys() int    { return a.count(`SELECT count(*) FROM idem.idempotency_keys`) }

func problemCode(t *testing.T, r reply) string {
	t.Helper()
	var p idemhttp.Problem
	if err := json.Unmarshal([]byte(r.body), &p); err != nil || r.header.Get("Content-Type") != "application/problem+json" {
		t.Fatalf("not a problem: %d %s %v", r.status, r.body, r.header)
	}
	if p.Status != r.status || p.Type == "" || p.Title == "" || !strings.HasSuffix(p.Type, "#"+p.Code) {
		t.Errorf("problem %+v is incomplete", p)
	}
	return p.Code
}

func TestReplayIsByteForByte(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	first := a.do("POST", "/transfers", "alice", "k1", `{"amount":100}`)
	if first.status != 201 || first.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("first: %+v", first)
	}
	second := a.do("POST", "/transfers", "alice", "k1", `{"amount":100}`, "X-Request-Id", "req-2")
	if second.status != 201 || second.body != first.body || second.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay: %+v, want %q", second, first.body)
	}
	for _, h := range []string{"Content-Type", "Location"} {
		if second.header.Get(h) != first.header.Get(h) {
			t.Errorf("replayed %s = %q, want %q", h, second.header.Get(h), first.header.Get(h))
		}
	}
	if second.header.Get("X-Request-Id") != "req-2" {
		t.Errorf("the replay carries correlation id %q, want the current request's req-2", second.header.Get("X-Request-Id"))
	}
	if second.header.Get("X-Not-Stored") != "" {
		t.Error("a header outside the allowlist was replayed")
	}
	if a.runs.Load() != 1 || a.effects() != 1 {
		t.Fatalf("handler ran %d times, %d effects; want 1 and 1", a.runs.Load(), a.effects())
	}
	// Equivalent JSON is the same request.
	third := a.do("POST", "/transfers", "alice", "k1", " { \"amount\" : 100.0 } ")
	if third.status != 201 || third.body != first.body || a.runs.Load() != 1 {
		t.Fatalf("equivalent JSON: %+v", third)
	}
	// Quoted (RFC 8941) and bare keys are the same key.
	if r := a.do("POST", "/transfers", "alice", `"k1"`, `{"amount":100}`); r.body != first.body || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("quoted key: %+v", r)
	}
}

func TestMismatch(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	a.do("POST", "/transfers", "alice", "k1", `{"amount":100,"to":"x"}`)
	r := a.do("POST", "/transfers", "alice", "k1", `{"amount":999,"to":"x"}`)
	if r.status != 422 || problemCode(t, r) != idemhttp.CodeKeyReuse {
		t.Fatalf("other body: %+v", r)
	}
	var p idemhttp.Problem
	_ = json.Unmarshal([]byte(r.body), &p)
	if p.ChangedFields == nil || len(*p.ChangedFields) != 1 || (*p.ChangedFields)[0] != "amount" || strings.Contains(r.body, "999") {
		t.Fatalf("changed fields in %s: want [amount] and no values", r.body)
	}
	a.do("POST", "/accounts/1/deposits", "alice", "d1", `{"amount":5}`)
	r = a.do("POST", "/accounts/2/deposits", "alice", "d1", `{"amount":5}`)
	if r.status != 422 || problemCode(t, r) != idemhttp.CodeKeyReuse || !strings.Contains(r.body, `"changed_fields":[]`) {
		t.Fatalf("other path: %+v, want changed_fields []", r)
	}
	if a.effects() != 2 {
		t.Fatalf("%d effects, want 2", a.effects())
	}
}

// TestMismatchWithLongMemberNames: member names of more than 4,096 bytes together are not
// stored with the key (D153): the row holds no field hashes, and a mismatch cannot name the
// changed fields.
func TestMismatchWithLongMemberNames(t *testing.T) {
	t.Parallel()
	a := newApp(t, func(o *idemhttp.Options) { o.MaxBodyBytes = 16 << 10 })
	long := strings.Repeat("n", 4096-len("amount")+1) // with "amount": 4,097 bytes of names
	if r := a.do("POST", "/transfers", "alice", "k-long", `{"amount":1,"`+long+`":1}`); r.status != 201 {
		t.Fatalf("long member name: %+v", r)
	}
	var stored *int
	if err := a.pool.QueryRow(context.Background(), `SELECT octet_length(request_fields) FROM idem.idempotency_keys WHERE key = 'k-long'`).Scan(&stored); err != nil || stored != nil {
		t.Fatalf("request_fields of the long names: %v bytes (%v), want NULL", stored, err)
	}
	r := a.do("POST", "/transfers", "alice", "k-long", `{"amount":2,"`+long+`":1}`)
	if r.status != 422 || problemCode(t, r) != idemhttp.CodeKeyReuse || strings.Contains(r.body, "changed_fields") {
		t.Fatalf("long member name, other body: %+v, want 422 without changed_fields", r)
	}
	// One byte fewer: the names are stored, and the mismatch names the field.
	if r := a.do("POST", "/transfers", "alice", "k-short", `{"amount":1,"`+long[1:]+`":1}`); r.status != 201 {
		t.Fatalf("member names of 4,096 bytes: %+v", r)
	}
	r = a.do("POST", "/transfers", "alice", "k-short", `{"amount":2,"`+long[1:]+`":1}`)
	if r.status != 422 || !strings.Contains(r.body, `"changed_fields":["amount"]`) {
		t.Fatalf("member names of 4,096 bytes, other body: %+v, want changed_fields [amount]", r)
	}
	if a.effects() != 2 {
		t.Fatalf("%d effects, want 2", a.effects())
	}
}

func TestConcurrentRepeatWaitsThen409(t *testing.T) {
	t.Parallel()
	a := newApp(t, func(o *idemhttp.Options) { o.LockTimeout, o.DuplicateWait = 300*time.Millisecond, 300*time.Millisecond })
	done := make(chan reply, 1)
	go func() { done <- a.do("POST", "/transfers", "alice", "k1", `{"amount":1,"block":true}`) }()
	<-a.started
	r := a.do("POST", "/transfers", "alice", "k1", `{"amount":1,"block":true}`)
	if r.status != 409 || problemCode(t, r) != idemhttp.CodeInProgress || r.header.Get("Retry-After") != "1" {
		t.Fatalf("repeat during the first: %+v", r)
	}
	a.unblock()
	first := <-done
	if first.status != 201 {
		t.Fatalf("first: %+v", first)
	}
	if r := a.do("POST", "/transfers", "alice", "k1", `{"amount":1,"block":true}`); r.body != first.body || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("repeat after the first: %+v", r)
	}
	if a.effects() != 1 {
		t.Fatalf("%d effects", a.effects())
	}
}

func TestSixtyFourParallelRequestsOneEffect(t *testing.T) {
	t.Parallel()
	a := newApp(t, func(o *idemhttp.Options) { o.LockTimeout = 20 * time.Second })
	var wg sync.WaitGroup
	start := make(chan struct{})
	replies := make([]reply, 64)
	for i := range replies {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			replies[i] = a.do("POST", "/transfers", "alice", "same", `{"amount":64}`)
		}()
	}
	close(start)
	wg.Wait()
	for i, r := range replies {
		if r.status != 201 || r.body != replies[0].body {
			t.Fatalf("reply %d: %+v, want %q", i, r, replies[0].body)
		}
	}
	if a.effects() != 1 || a.runs.Load() != 1 {
		t.Fatalf("%d effects, %d runs; want 1 and 1", a.effects(), a.runs.Load())
	}
}

func TestStepUpThenRetryTakesEffectOnce(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	if r := a.do("POST", "/transfers", "alice", "k1", `{"amount":7,"step_up":true}`); r.status != 401 {
		t.Fatalf("first: %+v", r)
	}
	if a.effects() != 0 || a.keys() != 0 {
		t.Fatal("a 401 left state behind")
	}
	if r := a.do("POST", "/transfers", "alice", "k1", `{"amount":7,"step_up":true}`, "X-Step-Up", "otp"); r.status != 201 {
		t.Fatalf("retry: %+v", r)
	}
	if a.effects() != 1 {
		t.Fatalf("%d effects, want 1", a.effects())
	}
}

func TestNonFinalResponsesStoreNothing(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	for _, c := range []struct {
		body   string
		status int
	}{
		{`{"status":500}`, 500}, {`{"status":503}`, 503}, {`{"status":429}`, 429},
		{`{"status":428}`, 428}, {`{"status":408}`, 408}, {`{"status":302}`, 302}, {`{"panic":true}`, 500},
	} {
		r := a.do("POST", "/transfers", "alice", "k-"+c.body, c.body)
		if r.status != c.status {
			t.Errorf("%s: status %d, want %d", c.body, r.status, c.status)
		}
	}
	if a.effects() != 0 || a.keys() != 0 {
		t.Fatalf("%d effects, %d keys after non-final responses; want none", a.effects(), a.keys())
	}
	if r := a.do("POST", "/transfers", "alice", `k-{"status":500}`, `{"status":201}`); r.status != 201 {
		t.Fatalf("a retry after a 5xx runs: %+v", r)
	}
}

func TestFinalErrorsAreStoredWithoutEffect(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	for _, status := range []int{404, 409, 422} {
		key := fmt.Sprintf("final-%d", status)
		body := fmt.Sprintf(`{"status":%d}`, status)
		first := a.do("POST", "/transfers", "alice", key, body)
		again := a.do("POST", "/transfers", "alice", key, body)
		if first.status != status || again.status != status || again.body != first.body || again.header.Get("Idempotent-Replayed") != "true" {
			t.Fatalf("%d: first %+v, again %+v", status, first, again)
		}
		// A replayed problem goes out as the first did: problem+json with nosniff.
		key, body = "problem-"+key, fmt.Sprintf(`{"status":%d,"problem":true}`, status)
		first, again = a.do("POST", "/transfers", "alice", key, body), a.do("POST", "/transfers", "alice", key, body)
		for _, r := range []reply{first, again} {
			if r.status != status || r.header.Get("Content-Type") != "application/problem+json" || r.header.Get("X-Content-Type-Options") != "nosniff" {
				t.Fatalf("%d: a problem without its headers: %d %v", status, r.status, r.header)
			}
		}
		if again.header.Get("Idempotent-Replayed") != "true" || again.body != first.body {
			t.Fatalf("%d: the problem was not replayed: %+v", status, again)
		}
	}
	if a.effects() != 0 || a.runs.Load() != 6 || a.keys() != 6 {
		t.Fatalf("%d effects, %d runs, %d keys; want 0, 6, 6", a.effects(), a.runs.Load(), a.keys())
	}
}

// TestHandlerSavepointCannotKeepAFinalErrorsWork: a handler that writes and then takes a
// savepoint of its own, named as the middleware's once was, and answers 422: its write is
// rolled back with the rest of the work (the middleware's savepoint has a name no handler
// can take), and the 422 is stored.
func TestHandlerSavepointCannotKeepAFinalErrorsWork(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	first := a.do("POST", "/transfers", "alice", "sp", `{"status":422,"savepoint":true}`)
	again := a.do("POST", "/transfers", "alice", "sp", `{"status":422,"savepoint":true}`)
	if first.status != 422 || again.status != 422 || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("first %+v, again %+v", first, again)
	}
	if n := a.effects(); n != 0 {
		t.Fatalf("%d effects committed under a stored 422, want 0", n)
	}
}

func TestPrincipalsAreIndependent(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	x := a.do("POST", "/transfers", "alice", "k1", `{"amount":1}`)
	y := a.do("POST", "/transfers", "bob", "k1", `{"amount":1}`)
	if x.status != 201 || y.status != 201 || x.body == y.body || a.effects() != 2 {
		t.Fatalf("alice %+v, bob %+v, %d effects", x, y, a.effects())
	}
}

func TestOneTimeSecret(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	first := a.do("POST", "/tokens", "alice", "t1", `{}`)
	if first.status != 201 || !strings.Contains(first.body, "secret-") {
		t.Fatalf("first: %+v", first)
	}
	if n := a.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = 't1' AND response_body IS NULL AND withheld = 'one_time_secret' AND response_status = 201`); n != 1 {
		t.Fatal("the secret's body was stored")
	}
	r := a.do("POST", "/tokens", "alice", "t1", `{}`)
	if r.status != 409 || problemCode(t, r) != idemhttp.CodeOneTimeSecret || strings.Contains(r.body, "secret-") {
		t.Fatalf("repeat: %+v", r)
	}
	if a.runs.Load() != 1 {
		t.Fatalf("the handler ran %d times", a.runs.Load())
	}
}

func TestOversizeResponse(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	first := a.do("POST", "/transfers", "alice", "big", `{"big":true}`)
	if first.status != 201 || len(first.body) < 2048 {
		t.Fatalf("first: %d, %d bytes", first.status, len(first.body))
	}
	r := a.do("POST", "/transfers", "alice", "big", `{"big":true}`)
	if r.status != 409 || problemCode(t, r) != idemhttp.CodeNotReplayable {
		t.Fatalf("repeat: %+v", r)
	}
	var p idemhttp.Problem
	_ = json.Unmarshal([]byte(r.body), &p)
	var body struct{ ID json.Number }
	_ = json.Unmarshal([]byte(first.body), &body)
	if p.ResourceID != body.ID.String() || p.ResourceID == "" {
		t.Fatalf("resource id %q, want the first body's top-level id %q", p.ResourceID, body.ID)
	}
	if a.effects() != 1 {
		t.Fatalf("%d effects", a.effects())
	}
}

// TestAnswerOutlivesAShortTTL: the TTL counts from the answer. With a TTL of one second and
// work that takes 1.2 seconds, the answer is stored after the claim's TTL has run out; the
// retry right after the answer still replays it (transactional and lease routes), and
// another request under the key is still refused.
func TestAnswerOutlivesAShortTTL(t *testing.T) {
	t.Parallel()
	a := newApp(t, func(o *idemhttp.Options) { o.TTL = time.Second; o.LockTimeout = 500 * time.Millisecond })
	for _, path := range []string{"/transfers", "/jobs"} {
		first := a.do("POST", path, "alice", "slow"+path, `{"amount":1,"sleep_ms":1200}`)
		if first.status/100 != 2 {
			t.Fatalf("%s first: %+v", path, first)
		}
		again := a.do("POST", path, "alice", "slow"+path, `{"amount":1,"sleep_ms":1200}`)
		if again.status != first.status || again.body != first.body || again.header.Get("Idempotent-Replayed") != "true" {
			t.Fatalf("%s: the retry right after a late answer got %+v, want the replay of %+v", path, again, first)
		}
		if other := a.do("POST", path, "alice", "slow"+path, `{"amount":2}`); other.status != 422 {
			t.Fatalf("%s: another request under the key: %+v", path, other)
		}
	}
	if n := a.runs.Load(); n != 2 {
		t.Fatalf("the handlers ran %d times, want 2", n)
	}
}

func TestExpiredKeyRunsAgain(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	a.do("POST", "/transfers", "alice", "k1", `{"amount":1}`)
	if _, err := a.pool.Exec(context.Background(), `UPDATE idem.idempotency_keys SET expires_at = now() - interval '1 day', lease_expires_at = now() - interval '1 day'`); err != nil {
		t.Fatal(err)
	}
	r := a.do("POST", "/transfers", "alice", "k1", `{"amount":1}`)
	if r.status != 201 || r.header.Get("Idempotent-Replayed") != "" || a.effects() != 2 {
		t.Fatalf("after expiry: %+v, %d effects", r, a.effects())
	}
}

func TestKeyValidation(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	for _, key := range []string{`""`, strings.Repeat("k", 256), `"a b"`, "a\tb", "clé", `"unterminated`, `"a\qb"`} {
		r := a.do("POST", "/transfers", "alice", key, `{"amount":1}`)
		if r.status != 400 || problemCode(t, r) != idemhttp.CodeKeyInvalid {
			t.Errorf("key %q: %+v", key, r)
		}
	}
	r := a.do("POST", "/transfers", "alice", "", `{"amount":1}`, "Idempotency-Key", "a", "Idempotency-Key", "b")
	if r.status != 400 || problemCode(t, r) != idemhttp.CodeKeyInvalid || !strings.Contains(string(r.body), "carries 2 Idempotency-Key headers") {
		t.Errorf("two keys: %+v, want 400 idempotency_key_invalid that says why", r)
	}
	r = a.do("POST", "/transfers", "alice", "", `{"amount":1}`)
	if r.status != 400 || problemCode(t, r) != idemhttp.CodeKeyMissing {
		t.Errorf("missing key on a required route: %+v", r)
	}
	for _, key := range []string{"", "a b"} {
		var p idemhttp.Problem
		if r := a.do("POST", "/transfers", "alice", key, `{"amount":1}`); json.Unmarshal([]byte(r.body), &p) != nil || p.Header != "Idempotency-Key" {
			t.Errorf("key %q: the problem does not name the header: %s", key, r.body)
		}
	}
	if r := a.do("POST", "/transfers", "alice", strings.Repeat("k", 255), `{"amount":1}`); r.status != 201 {
		t.Errorf("a 255-byte key: %+v", r)
	}
	if a.effects() != 1 || a.keys() != 1 {
		t.Fatalf("%d effects, %d keys; only the valid request may leave any", a.effects(), a.keys())
	}
}

func TestAnonymousAndUndeclaredIgnoreTheKey(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	for range 2 {
		if r := a.do("POST", "/transfers", "", "k1", `{"amount":1}`); r.status != 201 || r.header.Get("Idempotent-Replayed") != "" {
			t.Fatalf("anonymous: %+v", r)
		}
		if r := a.do("POST", "/undeclared", "alice", "k2", `{"amount":1}`); r.status != 201 {
			t.Fatalf("undeclared: %+v", r)
		}
	}
	if a.keys() != 0 || a.count(`SELECT count(*) FROM effects WHERE path = '/transfers'`) != 2 {
		t.Fatalf("%d keys, %d effects", a.keys(), a.effects())
	}
}

func TestSerializationFailureRerunsWithFullBody(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	body := `{"amount":4242,"conflict":true,"pad":"` + strings.Repeat("p", 500) + `"}`
	r := a.do("POST", "/transfers", "alice", "k1", body, "X-Test-Run", "run-1")
	if r.status != 201 || a.runs.Load() != 2 {
		t.Fatalf("%+v after %d runs; want 201 after 2", r, a.runs.Load())
	}
	if n := a.count(`SELECT count(*) FROM effects WHERE amount = 4242`); n != 1 || a.effects() != 1 {
		t.Fatalf("%d effects with the full amount, %d in all", n, a.effects())
	}
}

func TestSerializationFailureInABatchReruns(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	r := a.do("POST", "/transfers", "alice", "k1", `{"amount":77,"conflict":true,"in_batch":true}`, "X-Test-Run", "batch-1")
	if r.status != 201 || a.runs.Load() != 2 || a.effects() != 1 {
		t.Fatalf("%+v after %d runs, %d effects; want 201 after 2 runs, 1 effect", r, a.runs.Load(), a.effects())
	}
}

// TestRetryableErrorsRerun: a serialization failure that surfaces only when the handler
// closes its rows (it never asks Err), and a lock timeout of the handler's own statement,
// make the unit of work run again instead of answering the handler's 500.
func TestRetryableErrorsRerun(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	for i, body := range []string{`{"amount":5,"conflict":true,"in_rows":true}`, `{"amount":6,"conflict":true,"code":"55P03"}`} {
		before := a.runs.Load()
		r := a.do("POST", "/transfers", "alice", fmt.Sprintf("rerun-%d", i), body, "X-Test-Run", fmt.Sprintf("rerun-%d", i))
		if r.status != 201 || a.runs.Load()-before != 2 {
			t.Fatalf("%s: %+v after %d runs; want 201 after 2", body, r, a.runs.Load()-before)
		}
	}
	if a.effects() != 2 {
		t.Fatalf("%d effects, want 2", a.effects())
	}
}

// TestFlushThenPanicSendsNothingPartial: a handler that flushed part of its response and
// then failed leaves no effect, no key, and the client sees only the 500 problem.
func TestFlushThenPanicSendsNothingPartial(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	r := a.do("POST", "/transfers", "alice", "k1", `{"amount":1,"flush":true}`)
	if r.status != 500 || strings.Contains(r.body, "partial") || problemCode(t, r) != idemhttp.CodeInternalError {
		t.Fatalf("%+v", r)
	}
	if a.effects() != 0 || a.keys() != 0 {
		t.Fatalf("%d effects, %d keys after a failed streaming handler", a.effects(), a.keys())
	}
}

func TestBodyOverTheLimit(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	r := a.do("POST", "/transfers", "alice", "k1", `{"amount":1,"pad":"`+strings.Repeat("x", 2000)+`"}`)
	if r.status != 413 || problemCode(t, r) != idemhttp.CodeRequestTooLarge {
		t.Fatalf("%+v", r)
	}
	if a.keys() != 0 || a.effects() != 0 || a.runs.Load() != 0 {
		t.Fatal("an oversized request left state or ran the handler")
	}
}

func TestLeaseRoute(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	first := a.do("POST", "/jobs", "alice", "j1", `{"n":1}`)
	again := a.do("POST", "/jobs", "alice", "j1", `{"n":1}`)
	if first.status != 202 || again.status != 202 || again.body != first.body || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("first %+v, again %+v", first, again)
	}
	if a.runs.Load() != 1 {
		t.Fatalf("the job ran %d times", a.runs.Load())
	}
}

func TestMetricsAndLogsHoldNoKeysOrBodies(t *testing.T) {
	t.Parallel()
	var logs bytes.Buffer
	var mu sync.Mutex
	obs := newObserver()
	a := newApp(t, func(o *idemhttp.Options) {
		o.Logger = slog.New(slog.NewJSONHandler(lockedWriter{&mu, &logs}, &slog.HandlerOptions{Level: slog.LevelDebug}))
		o.Metrics = obs
	})
	const key, secret = "key-visible-in-no-log", "body-visible-in-no-log"
	a.do("POST", "/transfers", "alice", key, `{"amount":1,"memo":"`+secret+`"}`)
	a.do("POST", "/transfers", "alice", key, `{"amount":1,"memo":"`+secret+`"}`)
	a.do("POST", "/transfers", "alice", key, `{"amount":2,"memo":"`+secret+`"}`)
	a.do("POST", "/transfers", "alice", "k-500", `{"status":500,"memo":"`+secret+`"}`)
	got := obs.counts()
	want := map[string]float64{"acquired": 2, "replayed": 1, "key_reused": 1}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("state %s counted %v times, want %v (all: %v)", k, got[k], v, got)
		}
	}
	if len(got) != len(want) {
		t.Errorf("states counted: %v, want exactly %v", got, want)
	}
	mu.Lock()
	defer mu.Unlock()
	if strings.Contains(logs.String(), key) || strings.Contains(logs.String(), secret) {
		t.Fatalf("a log line holds a raw key or body:\n%s", logs.String())
	}
	if !strings.Contains(logs.String(), `"state":"key_reused"`) || !strings.Contains(logs.String(), `"key_hash"`) {
		t.Fatalf("the mismatch was not logged:\n%s", logs.String())
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// TestStormOfLargeDuplicatesHoldsBoundedMemory: while the first request with a key runs, 64
// duplicates of its 1 MiB body arrive at once. The duplicates that wait for it in Go hold at
// most MaxWaitingBytes (8 MiB here); the rest are answered 409 request_in_progress with
// Retry-After at once and let go of their bodies, so the heap stays within a few MiB of
// the bound instead of growing by the 64 bodies. Not parallel: it reads the process's heap.
func TestStormOfLargeDuplicatesHoldsBoundedMemory(t *testing.T) {
	const bound, storm = 8 << 20, 64
	a := newApp(t, func(o *idemhttp.Options) {
		o.MaxBodyBytes, o.MaxWaitingBytes = 2<<20, bound
	})
	// Not JSON (and sent as text): fingerprinted as its bytes, so the storm costs no
	// canonicalization, which under the race detector would take seconds per request.
	body := strings.Repeat("x", 1<<20)
	first := make(chan reply, 1)
	go func() {
		first <- a.do("POST", "/transfers", "alice", "storm", body, "Content-Type", "text/plain", "X-Block", "1")
	}()
	<-a.started

	gauge := func(name string) float64 {
		s := a.m.GateStats()
		return map[string]float64{"waiting": float64(s.Waiting), "waiting_bytes": float64(s.WaitingBytes)}[name]
	}
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)

	var refused atomic.Int32
	var wg sync.WaitGroup
	replies := make(chan reply, storm)
	for range storm {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := a.do("POST", "/transfers", "alice", "storm", body, "Content-Type", "text/plain", "X-Block", "1")
			if r.status == http.StatusConflict {
				refused.Add(1)
			}
			replies <- r
		}()
	}
	deadline := time.Now().Add(30 * time.Second)
	for int(refused.Load())+int(gauge("waiting")) < storm {
		if time.Now().After(deadline) {
			t.Fatalf("after 30 s: %d refused, %v waiting", refused.Load(), gauge("waiting"))
		}
		time.Sleep(10 * time.Millisecond)
	}
	waiting, held := gauge("waiting"), gauge("waiting_bytes")
	runtime.GC()
	var during runtime.MemStats
	runtime.ReadMemStats(&during)
	grown := int64(during.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("%d duplicates refused at once, %v waiting holding %v bytes; the heap grew by %d KiB", refused.Load(), waiting, held, grown>>10)
	if held > bound || waiting < 1 || refused.Load() < storm/2 {
		t.Fatalf("%v waiting duplicates hold %v bytes (bound %d), %d refused", waiting, held, bound, refused.Load())
	}
	if grown > 3*bound {
		t.Fatalf("the heap grew by %d MiB under the storm, want about the %d MiB bound", grown>>20, bound>>20)
	}

	a.unblock()
	if r := <-first; r.status != http.StatusCreated {
		t.Fatalf("the first request: %+v", r)
	}
	wg.Wait()
	close(replies)
	for r := range replies {
		switch {
		case r.status == http.StatusConflict:
			if r.header.Get("Retry-After") == "" || problemCode(t, r) != idemhttp.CodeInProgress {
				t.Fatalf("a refused duplicate: %+v", r)
			}
		case r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "true":
			t.Fatalf("a waiting duplicate: %+v, want the replay", r)
		}
	}
	if n := a.effects(); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
}

// TestRefuseWithAnUnknownCode: Refuse with a code that is none of this package's (an
// application's own, which belongs to WriteProblem) is answered 500 internal_error: the work
// is rolled back and nothing is stored, so the retry runs. It used to go out with status 0,
// as a 200 that committed the work and was stored as the answer.
func TestRefuseWithAnUnknownCode(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	r := a.do("POST", "/transfers", "alice", "refuse-own", `{"refuse":"invalid_order"}`)
	if r.status != 500 || !strings.Contains(r.body, `"code":"internal_error"`) {
		t.Fatalf("Refuse with an unknown code: %+v, want 500 internal_error", r)
	}
	if a.effects() != 0 || a.keys() != 0 {
		t.Fatalf("%d effects and %d keys after the refusal, want none", a.effects(), a.keys())
	}
	rec := httptest.NewRecorder()
	idemhttp.Refuse(rec, httptest.NewRequest("POST", "/plain", nil), "invalid_order", "x") // outside a route: no panic
	if rec.Code != 500 {
		t.Fatalf("outside a declared route: %d, want 500", rec.Code)
	}
}
