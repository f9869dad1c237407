package idemhttp_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// A mutation review of the middleware's answers (D235): single-point changes of internal/http
// that the suite let pass (a status, a header, a bound's comparison, a metric's label). Each
// test here failed with its change applied; the comment names the promise it keeps.

// mutServer is one declared route over a fresh database: principal "alice", quiet logs, a
// counting observer, the options edited by edit.
func mutServer(t *testing.T, edit func(*idemhttp.Options), rt idemhttp.Route, h http.HandlerFunc) (string, *pgxpool.Pool, *observer) {
	t.Helper()
	pool, _ := pgtest.NewPool(t, 8)
	obs := newObserver()
	o := idemhttp.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true },
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Metrics: obs}
	if edit != nil {
		edit(&o)
	}
	m, err := idemhttp.New(o)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(m.Route(rt)(h))
	t.Cleanup(srv.Close)
	return srv.URL, pool, obs
}

func mutSend(t *testing.T, url, key, body string) reply {
	t.Helper()
	st, h, b := pgtest.Send(t, context.Background(), "POST", url, body, "Idempotency-Key", key, "Content-Type", "application/json")
	return reply{st, h, b}
}

// TestWorkLockTimeoutIsCountedAcquired: docs/http.md, "What happens": "the work's lock timeouts
// (its statements' or its COMMIT's) in every run | 503 `store_unavailable` with `Retry-After: 1`,
// nothing changed (counted `acquired`, not `store_error`: the store did not fail)". A handler whose
// statement times out on a row another transaction holds, in every run: 503 with Retry-After: 1,
// and no store_error counted (an operator's alert on store_error must not fire for the
// application's own lock waits).
func TestWorkLockTimeoutIsCountedAcquired(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var runs atomic.Int32
	url, pool, obs := mutServer(t, nil, idemhttp.Route{Action: "POST /held"}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		tx := idemhttp.Tx(r.Context())
		if _, err := tx.Exec(r.Context(), `SET LOCAL lock_timeout = '100ms'`); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if _, err := tx.Exec(r.Context(), `UPDATE held SET n = n + 1 WHERE id = 1`); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.WriteHeader(201)
	})
	pgtest.Exec(t, pool, `CREATE TABLE held (id int PRIMARY KEY, n int NOT NULL DEFAULT 0); INSERT INTO held VALUES (1)`)
	locker, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = locker.Rollback(ctx) }()
	if _, err := locker.Exec(ctx, `SELECT * FROM held WHERE id = 1 FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	r := mutSend(t, url, "held-1", `{"a":1}`)
	got := obs.counts()
	t.Logf("%d Retry-After %q %s; runs %d; states %v", r.status, r.header.Get("Retry-After"), r.body, runs.Load(), got)
	if r.status != 503 || problemCode(t, r) != idemhttp.CodeStoreUnavailable || r.header.Get("Retry-After") != "1" {
		t.Fatalf("the work's own lock timeouts in every run: %d %s; want 503 store_unavailable with Retry-After: 1", r.status, r.body)
	}
	if got["store_error"] != 0 || got["acquired"] < 1 {
		t.Fatalf("the work's own lock timeouts counted %v; want acquired and no store_error (the store did not fail)", got)
	}
}

// TestNotReplayableNamesItsLocation: docs/http.md, "response_not_replayable": "`resource_id` names
// what it created: what the handler named with `SetResourceID`, else the top-level `id` of the
// first response's JSON body, else its `Location`." A response too large to store, with no id in
// its body, is named by its Location on the repeat.
func TestNotReplayableNamesItsLocation(t *testing.T) {
	t.Parallel()
	url, _, _ := mutServer(t, func(o *idemhttp.Options) { o.MaxStoredBodyBytes = 16 }, idemhttp.Route{Action: "POST /things"},
		func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/plain")
			w.Header().Set("Location", "/v1/things/42")
			w.WriteHeader(201)
			_, _ = io.WriteString(w, strings.Repeat("x", 100))
		})
	if r := mutSend(t, url, "loc-1", `{"a":1}`); r.status != 201 || len(r.body) != 100 {
		t.Fatalf("first: %d %q", r.status, r.body)
	}
	r := mutSend(t, url, "loc-1", `{"a":1}`)
	var p idemhttp.Problem
	_ = json.Unmarshal([]byte(r.body), &p)
	if r.status != 409 || problemCode(t, r) != idemhttp.CodeNotReplayable || p.ResourceID != "/v1/things/42" ||
		r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("repeat of a response too large to store: %d %s (replayed %q); want 409 response_not_replayable with resource_id /v1/things/42",
			r.status, r.body, r.header.Get("Idempotent-Replayed"))
	}
}

// TestBodyOfExactlyMaxStoredBodyBytesReplays: Options.MaxStoredBodyBytes "is the largest response
// body stored for replay; a larger response is sent once and stored without its body"
// (docs/http.md: "response larger than `MaxStoredBodyBytes` ... stored without the body"). A body
// of exactly the bound is stored and replayed byte for byte; one byte more is not.
func TestBodyOfExactlyMaxStoredBodyBytesReplays(t *testing.T) {
	t.Parallel()
	const bound = 64
	url, _, obs := mutServer(t, func(o *idemhttp.Options) { o.MaxStoredBodyBytes = bound }, idemhttp.Route{Action: "POST /sized"},
		func(w http.ResponseWriter, r *http.Request) {
			var n struct {
				N int `json:"n"`
			}
			if !idemhttp.DecodeJSON(w, r, &n) {
				return
			}
			w.Header().Set("Content-Type", "text/plain")
			w.WriteHeader(201)
			_, _ = io.WriteString(w, strings.Repeat("b", n.N))
		})
	exact := mutSend(t, url, "exact", `{"n":64}`)
	again := mutSend(t, url, "exact", `{"n":64}`)
	if exact.status != 201 || again.status != 201 || again.body != exact.body || len(again.body) != bound ||
		again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("a body of exactly MaxStoredBodyBytes (%d): first %d (%d bytes), repeat %d %q (replayed %q); want it replayed byte for byte",
			bound, exact.status, len(exact.body), again.status, again.body, again.header.Get("Idempotent-Replayed"))
	}
	over := mutSend(t, url, "over", `{"n":65}`)
	overAgain := mutSend(t, url, "over", `{"n":65}`)
	if over.status != 201 || len(over.body) != bound+1 || overAgain.status != 409 || problemCode(t, overAgain) != idemhttp.CodeNotReplayable {
		t.Fatalf("a body one byte over: first %d, repeat %d %s; want 201 then 409 response_not_replayable", over.status, overAgain.status, overAgain.body)
	}
	if got := obs.counts(); got["oversize"] != 1 {
		t.Fatalf("states %v: want oversize counted once (the body over the bound alone)", got)
	}
}

// TestStatus999IsSent: docs/http.md, "What happens": "the handler writes a status no response can
// carry (below 100 or above 999) | it panics, as under net/http alone: 500 `internal_error`". 999
// is a status a response can carry (net/http sends it): it is the handler's answer, sent as it is,
// not a panic's 500; not a 2xx nor final, so rolled back and not stored.
func TestStatus999IsSent(t *testing.T) {
	t.Parallel()
	var runs atomic.Int32
	url, _, _ := mutServer(t, nil, idemhttp.Route{Action: "POST /odd"}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(999)
		_, _ = io.WriteString(w, "odd")
	})
	for i := range 2 {
		r := mutSend(t, url, "odd-1", `{"a":1}`)
		if r.status != 999 || r.body != "odd" {
			t.Fatalf("try %d: a handler's 999: %d %q; want 999 \"odd\", as net/http alone sends it", i, r.status, r.body)
		}
	}
	if runs.Load() != 2 {
		t.Fatalf("the handler ran %d times; want 2 (a 999 is not stored)", runs.Load())
	}
}

// TestStatus300IsRolledBack: docs/http.md, "What happens": "handler 401, 408, 428, 429, 3xx, 5xx |
// the handler's response; its effect rolled back | no" (stored). A 300 is not a 2xx: its write is
// rolled back, and a repeat runs the handler again.
func TestStatus300IsRolledBack(t *testing.T) {
	t.Parallel()
	var runs atomic.Int32
	url, pool, _ := mutServer(t, nil, idemhttp.Route{Action: "POST /choices"}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		if _, err := idemhttp.Tx(r.Context()).Exec(r.Context(), `INSERT INTO choices DEFAULT VALUES`); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.Header().Set("Location", "/v1/choices/1")
		w.WriteHeader(http.StatusMultipleChoices)
	})
	pgtest.Exec(t, pool, `CREATE TABLE choices (id serial PRIMARY KEY)`)
	for i := range 2 {
		if r := mutSend(t, url, "choices-1", `{"a":1}`); r.status != 300 || r.header.Get("Idempotent-Replayed") != "" {
			t.Fatalf("try %d: %d (replayed %q); want the handler's 300, not a replay", i, r.status, r.header.Get("Idempotent-Replayed"))
		}
	}
	if n, k := pgtest.Count(t, pool, `SELECT count(*) FROM choices`), pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys`); n != 0 || k != 0 || runs.Load() != 2 {
		t.Fatalf("a 300: %d effects, %d keys stored, %d runs; want its effect rolled back, nothing stored, 2 runs", n, k, runs.Load())
	}
}

// actionsSeen is an Observer that keeps the action label of every count, as a dashboard's
// idempotency_requests_total{action,state} does.
type actionsSeen struct {
	observer
	mu      sync.Mutex
	actions map[string]int
}

func (o *actionsSeen) Count(action string, s idemhttp.State) {
	o.mu.Lock()
	o.actions[action+"|"+string(s)]++
	o.mu.Unlock()
	o.observer.Count(action, s)
}

// TestUnknownMethodIsActionOTHER: Route.Action's default is "the method and the route template ...,
// a method outside RFC 9110's nine named OTHER" (options.go), and docs/http.md names the action a
// metric label (idempotency_requests_total{action,state}). A keyed request with a method of its own
// on a route that takes any method is counted under "OTHER /x", so that clients cannot grow the
// label set.
func TestUnknownMethodIsActionOTHER(t *testing.T) {
	t.Parallel()
	obs := &actionsSeen{observer: observer{states: map[string]float64{}}, actions: map[string]int{}}
	url, _, _ := mutServer(t, func(o *idemhttp.Options) { o.Metrics = obs }, idemhttp.Route{},
		func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) })
	st, _, body := pgtest.Send(t, context.Background(), "FROB", url+"/x", `{"a":1}`, "Idempotency-Key", "frob-1")
	obs.mu.Lock()
	got := fmt.Sprint(obs.actions)
	n := obs.actions["OTHER /x|acquired"]
	obs.mu.Unlock()
	if st != 201 || n != 1 {
		t.Fatalf("a keyed FROB /x: %d %s, counted %s; want 201 counted acquired under the action \"OTHER /x\"", st, body, got)
	}
}

// TestPlusJSONIsJSON: docs/http.md, "What is hashed is what is executed": a body is sent as JSON
// with "`application/json`, `application/*+json`, or no `Content-Type`", and DecodeJSON answers 415
// only for "a `Content-Type` other than JSON". A keyed application/merge-patch+json body is
// decoded, and its repeat with another spelling of the same JSON is the same request (canonical
// fingerprint).
func TestPlusJSONIsJSON(t *testing.T) {
	t.Parallel()
	var runs atomic.Int32
	url, _, _ := mutServer(t, nil, idemhttp.Route{Action: "PATCH /doc"}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		var in struct {
			Amount int `json:"amount"`
		}
		if !idemhttp.DecodeJSON(w, r, &in) {
			return
		}
		w.WriteHeader(200)
		fmt.Fprintf(w, `{"amount":%d}`, in.Amount)
	})
	send := func(body string) reply {
		st, h, b := pgtest.Send(t, context.Background(), "PATCH", url, body, "Idempotency-Key", "patch-1",
			"Content-Type", "application/merge-patch+json")
		return reply{st, h, b}
	}
	first, again := send(`{"amount":100}`), send(`{ "amount": 1e2 }`)
	if first.status != 200 || first.body != `{"amount":100}` || again.status != 200 || again.header.Get("Idempotent-Replayed") != "true" || runs.Load() != 1 {
		t.Fatalf("application/merge-patch+json: %d %s, then the same JSON spelled otherwise %d %s (replayed %q), %d runs; want 200 decoded, then its replay",
			first.status, first.body, again.status, again.body, again.header.Get("Idempotent-Replayed"), runs.Load())
	}
}

// TestFinal416KeepsItsContentRange: docs/http.md, "What happens" (after the table): a body is
// stored as sent "and replayed so (so is a 206's or 416's `Content-Range`, which says what part the
// body is)". With 416 declared final (Options.FinalStatus), its repeat carries the Content-Range
// that the allowlist does not name.
func TestFinal416KeepsItsContentRange(t *testing.T) {
	t.Parallel()
	final := func(s int) bool { return s == 416 || idemhttp.DefaultFinalStatus(s) }
	url, _, _ := mutServer(t, func(o *idemhttp.Options) { o.FinalStatus = final }, idemhttp.Route{Action: "POST /range"},
		func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Range", "bytes */100")
			w.WriteHeader(http.StatusRequestedRangeNotSatisfiable)
		})
	first := mutSend(t, url, "range-1", `{"a":1}`)
	again := mutSend(t, url, "range-1", `{"a":1}`)
	if first.status != 416 || again.status != 416 || again.header.Get("Idempotent-Replayed") != "true" ||
		again.header.Get("Content-Range") != "bytes */100" {
		t.Fatalf("a final 416: %d, repeat %d (replayed %q) Content-Range %q; want its replay with Content-Range bytes */100",
			first.status, again.status, again.header.Get("Idempotent-Replayed"), again.header.Get("Content-Range"))
	}
}

// TestLeaseOversizeIsCounted: docs/http.md, "Metrics, traces and logs": `oversize` is "counted on
// top of `acquired` for a response too large to store", on every route: a lease route's answer over
// MaxStoredBodyBytes counts it too.
func TestLeaseOversizeIsCounted(t *testing.T) {
	t.Parallel()
	url, _, obs := mutServer(t, func(o *idemhttp.Options) { o.MaxStoredBodyBytes = 16 }, idemhttp.Route{Action: "POST /lease", Lease: 2 * time.Second},
		func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(201)
			_, _ = io.WriteString(w, strings.Repeat("z", 100))
		})
	r := mutSend(t, url, "lease-big", `{"a":1}`)
	again := mutSend(t, url, "lease-big", `{"a":1}`)
	if got := obs.counts(); r.status != 201 || again.status != 409 || got["acquired"] != 1 || got["oversize"] != 1 {
		t.Fatalf("a lease answer over MaxStoredBodyBytes: %d, repeat %d, states %v; want 201, 409, acquired 1 and oversize 1", r.status, again.status, got)
	}
}

// TestExactContentLengthIsKept: docs/http.md, "What happens": a first 2xx is "the handler's
// response" and its repeat "the stored status, headers and body, byte for byte". A handler that
// declares its Content-Length and writes exactly that many bytes sends them, and its repeat gets
// them.
func TestExactContentLengthIsKept(t *testing.T) {
	t.Parallel()
	url, _, _ := mutServer(t, nil, idemhttp.Route{Action: "POST /cl"}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "5")
		w.WriteHeader(201)
		_, _ = io.WriteString(w, "hello")
	})
	first := mutSend(t, url, "cl-1", `{"a":1}`)
	again := mutSend(t, url, "cl-1", `{"a":1}`)
	if first.status != 201 || first.body != "hello" || again.status != 201 || again.body != "hello" {
		t.Fatalf("Content-Length 5 and 5 bytes written: %d %q, repeat %d %q; want \"hello\" both times", first.status, first.body, again.status, again.body)
	}
}

// TestLeaseUnrecordedAnswerRetryAfterIsTheLease: docs/http.md, "outcome_unknown": on a lease route
// it "also answers work that was done but whose answer could not be stored before the storing's
// deadline ...: `Retry-After` is the lease, after which the retry takes the key over". With a lease
// of 2 s: Retry-After: 2.
func TestLeaseUnrecordedAnswerRetryAfterIsTheLease(t *testing.T) {
	t.Parallel()
	var pool *pgxpool.Pool
	url, p, _ := mutServer(t, nil, idemhttp.Route{Action: "POST /pay", Lease: 2 * time.Second},
		func(w http.ResponseWriter, r *http.Request) {
			// The store fails under the work (a function gone), as a database can.
			pgtest.Exec(t, pool, `ALTER FUNCTION idem.idem_complete RENAME TO idem_complete_gone`)
			w.WriteHeader(201)
		})
	pool = p
	r := mutSend(t, url, "pay-1", `{"a":1}`)
	pgtest.Exec(t, pool, `ALTER FUNCTION idem.idem_complete_gone RENAME TO idem_complete`)
	if r.status != 503 || problemCode(t, r) != idemhttp.CodeOutcomeUnknown || r.header.Get("Retry-After") != "2" {
		t.Fatalf("a lease answer that could not be recorded: %d Retry-After %q %s; want 503 outcome_unknown with Retry-After: 2 (the lease)",
			r.status, r.header.Get("Retry-After"), r.body)
	}
}

// TestRequiredRouteRunsAnAnonymousRequest: Route.Required "makes a request without the key a 400
// idempotency_key_missing, when Options.Principal names a principal for it: a request without one
// (anonymous, ...) runs every time, key or not" (options.go); docs/http.md, "Which requests take
// part": "answers 400 `idempotency_key_missing` to an authenticated request without the key".
func TestRequiredRouteRunsAnAnonymousRequest(t *testing.T) {
	t.Parallel()
	var runs atomic.Int32
	url, _, _ := mutServer(t, func(o *idemhttp.Options) {
		o.Principal = func(r *http.Request) (string, bool) { p := r.Header.Get("X-Principal"); return p, p != "" }
	}, idemhttp.Route{Action: "POST /req", Required: true}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(201)
	})
	st, _, body := pgtest.Send(t, context.Background(), "POST", url, `{"a":1}`, "Content-Type", "application/json")
	if st != 201 || runs.Load() != 1 {
		t.Fatalf("an anonymous request without a key on a Required route: %d %s, %d runs; want the handler's 201", st, body, runs.Load())
	}
	st, _, body = pgtest.Send(t, context.Background(), "POST", url, `{"a":1}`, "Content-Type", "application/json", "X-Principal", "alice")
	if st != 400 || !strings.Contains(body, idemhttp.CodeKeyMissing) {
		t.Fatalf("an authenticated request without a key on a Required route: %d %s; want 400 %s", st, body, idemhttp.CodeKeyMissing)
	}
}

// TestUnkeyedLeaseAfterShutdownHasRetryAfter: docs/http.md, "shutting_down": "503 with
// `Retry-After: 1`"; a request without a key on a lease route "that comes after Shutdown's deadline
// gets 503 `shutting_down` before its handler runs" ("Work outside the database").
func TestUnkeyedLeaseAfterShutdownHasRetryAfter(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	m, err := idemhttp.New(idemhttp.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true },
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	h := m.Route(idemhttp.Route{Action: "POST /pay", Lease: 5 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(201)
	}))
	sctx, cancel := context.WithCancel(context.Background())
	cancel()
	_ = m.Shutdown(sctx) // its deadline has passed
	req := httptest.NewRequest("POST", "/pay", strings.NewReader(`{"a":1}`))
	req.Header.Set("Content-Type", "application/json")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, req)
	if w.Code != 503 || !strings.Contains(w.Body.String(), idemhttp.CodeShuttingDown) || w.Header().Get("Retry-After") != "1" || runs.Load() != 0 {
		t.Fatalf("an unkeyed lease request after Shutdown's deadline: %d Retry-After %q %s, %d runs; want 503 shutting_down with Retry-After: 1, no run",
			w.Code, w.Header().Get("Retry-After"), w.Body.String(), runs.Load())
	}
}

// TestMultipartFilesParsedBeforeIsMisconfigured: docs/http.md, "idempotency_misconfigured": 500
// when "a handler before the middleware parsed the request's form and so read its body, which then
// cannot be fingerprinted (keyed requests only)". A multipart form of files alone (no values in
// PostForm) parsed before the middleware is refused so too, before any claim: not run as a request
// with an empty body.
func TestMultipartFilesParsedBeforeIsMisconfigured(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	m, err := idemhttp.New(idemhttp.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true },
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	inner := m.Route(idemhttp.Route{Action: "POST /upload"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(201)
	}))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = r.ParseMultipartForm(1 << 20) // a middleware in front reads the form
		inner.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	const boundary = "zzb"
	body := "--" + boundary + "\r\nContent-Disposition: form-data; name=\"f\"; filename=\"a.txt\"\r\nContent-Type: text/plain\r\n\r\nhello\r\n--" + boundary + "--\r\n"
	st, _, b := pgtest.Send(t, context.Background(), "POST", srv.URL, body, "Idempotency-Key", "up-1",
		"Content-Type", "multipart/form-data; boundary="+boundary)
	keys := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys`)
	if st != 500 || !strings.Contains(b, idemhttp.CodeMisconfigured) || runs.Load() != 0 || keys != 0 {
		t.Fatalf("a keyed multipart request whose files were parsed before the middleware: %d %s, %d runs, %d keys; want 500 %s, no run, no key",
			st, b, runs.Load(), keys, idemhttp.CodeMisconfigured)
	}
}

// TestRetryAfterIsAtMostTheLeasesRest: docs/http.md, "A client that gives up early": past its wait
// the duplicate gets 409 `request_in_progress` "with a `Retry-After` that estimates the rest of the
// work, not of the lease: how long this action's lease work typically takes in this process, less
// how long the holder has worked, at least a second and at most the lease's rest". Work that
// typically takes 3 s on a lease of 1 s (extended as it runs): the duplicate's Retry-After is 1,
// the lease's rest, not the 2 s or more of work left.
func TestRetryAfterIsAtMostTheLeasesRest(t *testing.T) {
	t.Parallel()
	started := make(chan struct{}, 4)
	url, _, _ := mutServer(t, func(o *idemhttp.Options) { o.DuplicateWait = 500 * time.Millisecond },
		idemhttp.Route{Action: "POST /slow", Lease: time.Second}, func(w http.ResponseWriter, r *http.Request) {
			started <- struct{}{}
			time.Sleep(3 * time.Second)
			w.WriteHeader(201)
		})
	if r := mutSend(t, url, "warm", `{"a":1}`); r.status != 201 { // the action's typical work: 3 s
		t.Fatalf("warm-up: %d %s", r.status, r.body)
	}
	<-started
	done := make(chan reply, 1)
	go func() { done <- mutSend(t, url, "held", `{"a":2}`) }()
	<-started
	time.Sleep(200 * time.Millisecond)
	dup := mutSend(t, url, "held", `{"a":2}`)
	if first := <-done; first.status != 201 {
		t.Fatalf("the holder: %d %s", first.status, first.body)
	}
	if dup.status != 409 || problemCode(t, dup) != idemhttp.CodeInProgress || dup.header.Get("Retry-After") != "1" {
		t.Fatalf("a duplicate past its wait, the holder's lease 1 s and its work typically 3 s: %d Retry-After %q %s; want 409 with Retry-After: 1 (at most the lease's rest)",
			dup.status, dup.header.Get("Retry-After"), dup.body)
	}
}
