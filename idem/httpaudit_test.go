package idem_test

// An audit of the promises of `go doc ./idem`, docs/http.md and README.md, against a real
// PostgreSQL. Each test names the promise it checks; the first six and
// TestAuditDefaultActionOfAPathWithNUL failed before D166.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

var auditQuiet = slog.New(slog.DiscardHandler)

// auditServer builds a middleware with opts (DB, Principal and Logger filled in when unset), wraps
// h on POST /things with rt, and serves it.
func auditServer(t *testing.T, opts idem.Options, rt idem.Route, h http.HandlerFunc) (*httptest.Server, *idem.Middleware) {
	t.Helper()
	if opts.DB == nil {
		pool, _ := pgtest.NewPool(t, 8)
		opts.DB = pool
	}
	if opts.Principal == nil {
		opts.Principal = alice
	}
	if opts.Logger == nil {
		opts.Logger = auditQuiet
	}
	m, err := idem.New(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /things", m.Route(rt)(h))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv, m
}

func auditPost(t *testing.T, url, key, body string, headers ...string) (int, http.Header, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	h := append([]string{"Idempotency-Key", key, "Content-Type", "application/json"}, headers...)
	return pgtest.Send(t, ctx, "POST", url+"/things", body, h...)
}

func auditCode(body string) string {
	var p idem.Problem
	_ = json.Unmarshal([]byte(body), &p)
	return p.Code
}

// TestAuditCustomFingerprintOfAFieldAcceptsValidJSON: Route.Fingerprint "replaces the default
// fingerprint ... for a route whose meaning is narrower than its body" (go doc Route), "a function
// built on" ComputeFingerprint. A route whose meaning is one string member hashes that member.
// Promise: a strictly valid JSON body is served (201), and a repeat replays it. The strict-JSON
// refusal ("sent as JSON but not strictly valid JSON: 400 malformed_body") is about the body,
// not about what the route's fingerprint chose to hash.
func TestAuditCustomFingerprintOfAFieldAcceptsValidJSON(t *testing.T) {
	t.Parallel()
	var runs atomic.Int32
	byAccount := func(r *http.Request, body []byte) idem.Fingerprint {
		var v struct {
			Account string `json:"account"`
		}
		_ = json.Unmarshal(body, &v)
		return idem.ComputeFingerprint(r.Method, r.URL.EscapedPath(), []byte(v.Account))
	}
	srv, _ := auditServer(t, idem.Options{}, idem.Route{Fingerprint: byAccount}, func(w http.ResponseWriter, r *http.Request) {
		var in struct {
			Account string `json:"account"`
			Note    string `json:"note"`
		}
		if !idem.DecodeJSON(w, r, &in) {
			return
		}
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"account":%q}`, in.Account)
	})
	s1, _, b1 := auditPost(t, srv.URL, "fp-1", `{"account":"acc-1","note":"a"}`)
	s2, h2, b2 := auditPost(t, srv.URL, "fp-1", `{"account":"acc-1","note":"b"}`)
	if s1 != 201 || s2 != 201 || b1 != b2 || h2.Get("Idempotent-Replayed") != "true" || runs.Load() != 1 {
		t.Fatalf("a valid JSON body on a route with a custom fingerprint: %d %s (code %q); repeat %d %s; %d runs",
			s1, b1, auditCode(b1), s2, b2, runs.Load())
	}
}

// TestAuditLargestMaxBodyBytesKeepsTheBody: Options.MaxBodyBytes "is the largest request body
// read ... Not negative" (go doc Options): every non-negative value is accepted by New, the
// largest one included. Promise: a body under the bound reaches the handler whole.
func TestAuditLargestMaxBodyBytesKeepsTheBody(t *testing.T) {
	t.Parallel()
	var got atomic.Value
	got.Store("")
	srv, _ := auditServer(t, idem.Options{MaxBodyBytes: math.MaxInt64}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		var in struct {
			Amount int `json:"amount"`
		}
		b, _ := io.ReadAll(r.Body)
		got.Store(string(b))
		if !idem.DecodeJSON(w, r, &in) {
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"amount":%d}`, in.Amount)
	})
	s, _, b := auditPost(t, srv.URL, "big-1", `{"amount":7}`)
	if s != 201 || b != `{"amount":7}` || got.Load() != `{"amount":7}` {
		t.Fatalf("MaxBodyBytes math.MaxInt64: %d %s (code %q); the handler read %q", s, b, auditCode(b), got.Load())
	}
}

// TestAuditPrincipalNotUTF8IsAFinalAnswer: a principal is "1 to 255 characters"; one the store
// refuses is "500 idempotency_misconfigured, final: no Retry-After" (docs/http.md), and 503
// store_unavailable means "the database failed ... nothing was changed. Retry with the same key"
// (which idemclient does, ten times). The shop example takes its principal from a request
// header (X-Customer), whose value may carry obs-text bytes that are not UTF-8. Promise: the
// answer is final (not a 503 that every retry gets again).
func TestAuditPrincipalNotUTF8IsAFinalAnswer(t *testing.T) {
	t.Parallel()
	var runs atomic.Int32
	srv, _ := auditServer(t, idem.Options{Principal: func(r *http.Request) (string, bool) {
		c := r.Header.Get("X-Customer")
		return c, c != ""
	}}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	})
	s, h, b := auditPost(t, srv.URL, "p-1", `{}`, "X-Customer", "caf\xe9")
	if s >= 500 && auditCode(b) != idem.CodeMisconfigured || h.Get("Retry-After") != "" {
		t.Fatalf("a principal that is not UTF-8: %d Retry-After %q %s", s, h.Get("Retry-After"), b)
	}
}

// TestAuditReplayKeepsHeaderBytes: a repeat gets "the stored status, headers and body, byte for
// byte" (docs/http.md). ETag is a stored header by default; an opaque-tag may hold obs-text
// (RFC 9110 etagc: %x21 / %x23-7E / obs-text). Promise: the replayed ETag is the first one's
// bytes.
func TestAuditReplayKeepsHeaderBytes(t *testing.T) {
	t.Parallel()
	etag := "\"v\xe9\xff1\""
	srv, _ := auditServer(t, idem.Options{}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("ETag", etag)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"id":1}`)
	})
	s1, h1, _ := auditPost(t, srv.URL, "etag-1", `{}`)
	s2, h2, _ := auditPost(t, srv.URL, "etag-1", `{}`)
	if s1 != 201 || s2 != 201 || h1.Get("ETag") != etag || h2.Get("ETag") != etag || h2.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("first %d ETag %q; replay %d ETag %q (replayed %q)", s1, h1.Get("ETag"), s2, h2.Get("ETag"), h2.Get("Idempotent-Replayed"))
	}
}

// TestAuditReplayKeepsRepeatedHeaderLines: "byte for byte" (docs/http.md) for a stored header
// that a handler sends as two lines (Set-Cookie in Options.StoredHeaders, which takes any
// header name). go doc Response says several values are stored "joined with ", "", which is
// not the same response for Set-Cookie (RFC 6265: never folded).
func TestAuditReplayKeepsRepeatedHeaderLines(t *testing.T) {
	t.Parallel()
	srv, _ := auditServer(t, idem.Options{StoredHeaders: []string{"Content-Type", "Set-Cookie"}}, idem.Route{},
		func(w http.ResponseWriter, r *http.Request) {
			w.Header().Add("Set-Cookie", "a=1; Expires=Wed, 21 Oct 2037 07:28:00 GMT")
			w.Header().Add("Set-Cookie", "b=2")
			w.WriteHeader(http.StatusCreated)
		})
	_, h1, _ := auditPost(t, srv.URL, "cookie-1", `{}`)
	_, h2, _ := auditPost(t, srv.URL, "cookie-1", `{}`)
	if fmt.Sprint(h1.Values("Set-Cookie")) != fmt.Sprint(h2.Values("Set-Cookie")) {
		t.Fatalf("first Set-Cookie %q; replay %q", h1.Values("Set-Cookie"), h2.Values("Set-Cookie"))
	}
}

// TestReplayedPartialContentKeepsItsRange: a 206 is stored and replayed, and its body is the
// part its Content-Range names; Content-Range is not among the default StoredHeaders, so the
// replay was the part's bytes with nothing to say which part. It is stored with a 206's (and a
// 416's) body whatever the allowlist says, as Content-Encoding is. docs/http.md: a repeat gets
// "the stored status, headers and body".
func TestReplayedPartialContentKeepsItsRange(t *testing.T) {
	t.Parallel()
	srv, _ := auditServer(t, idem.Options{}, idem.Route{},
		func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Range", "bytes 0-4/10")
			w.Header().Set("X-Other", "not stored")
			w.WriteHeader(http.StatusPartialContent)
			w.Write([]byte("01234"))
		})
	s1, h1, b1 := auditPost(t, srv.URL, "range-1", `{}`)
	s2, h2, b2 := auditPost(t, srv.URL, "range-1", `{}`)
	if s1 != 206 || s2 != 206 || b1 != b2 || h2.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("first %d %q; replay %d %q (replayed %q)", s1, b1, s2, b2, h2.Get("Idempotent-Replayed"))
	}
	if h1.Get("Content-Range") != "bytes 0-4/10" || h2.Get("Content-Range") != "bytes 0-4/10" || h2.Get("X-Other") != "" {
		t.Fatalf("first Content-Range %q; replay Content-Range %q, X-Other %q", h1.Get("Content-Range"), h2.Get("Content-Range"), h2.Get("X-Other"))
	}
}

// TestLeaseAnswerKeptTheTTLAfterTheAnswer: docs/http.md, "How long a key lives": on a lease
// route, "once the answer is stored, the key lives the TTL after the answer". A lease route with
// a 1 s TTL and a 10 s lease kept its answer until the lease's end plus the TTL (11 s): another
// request under the key got 422 for ten seconds more than the TTL (D200).
func TestLeaseAnswerKeptTheTTLAfterTheAnswer(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	var runs atomic.Int32
	srv, _ := auditServer(t, idem.Options{DB: pool, TTL: time.Second}, idem.Route{Lease: 10 * time.Second},
		func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			w.WriteHeader(http.StatusCreated)
		})
	if s, _, b := auditPost(t, srv.URL, "lease-ttl", `{"amount":1}`); s != 201 {
		t.Fatalf("first: %d %s", s, b)
	}
	var now time.Time
	if err := pool.QueryRow(context.Background(), "SELECT clock_timestamp()").Scan(&now); err != nil {
		t.Fatal(err)
	}
	story, ok, err := idem.ReadKey(context.Background(), pool, "alice", "lease-ttl")
	if err != nil || !ok {
		t.Fatal(ok, err)
	}
	if left := story.KeptUntil.Sub(now); left > 1500*time.Millisecond {
		t.Errorf("the answer is kept %v more with a 1 s TTL (its claim's expiry %v more)", left, story.ExpiresAt.Sub(now))
	}
	time.Sleep(1300 * time.Millisecond)
	if s, _, b := auditPost(t, srv.URL, "lease-ttl", `{"amount":2}`); s != 201 || runs.Load() != 2 {
		t.Fatalf("another request 1.3 s after the answer (TTL 1 s): %d %s, %d runs", s, b, runs.Load())
	}
}

// TestAuditLeaseAbortHandlerGivesTheLeaseUp: on a lease route, "the handler answers anything else
// (5xx, 401, 429, a panic): gives the lease up at once without an answer ... the same request:
// a fresh run at once, with the same provider key" (docs/http.md). net/http's own way for a
// handler to abort is panic(http.ErrAbortHandler). Promise: the client's retry runs at once
// (not after a DuplicateWait of 409s, nor after the 30 s lease).
func TestAuditLeaseAbortHandlerGivesTheLeaseUp(t *testing.T) {
	t.Parallel()
	var runs atomic.Int32
	srv, _ := auditServer(t, idem.Options{DuplicateWait: 2 * time.Second}, idem.Route{Lease: 30 * time.Second},
		func(w http.ResponseWriter, r *http.Request) {
			if runs.Add(1) == 1 {
				panic(http.ErrAbortHandler)
			}
			w.WriteHeader(http.StatusCreated)
			fmt.Fprint(w, `{"id":1}`)
		})
	s1, _, _ := auditPost(t, srv.URL, "abort-1", `{}`)
	start := time.Now()
	s2, h2, b2 := auditPost(t, srv.URL, "abort-1", `{}`)
	if s1 != -1 || s2 != 201 || time.Since(start) > time.Second {
		t.Fatalf("first %d; retry %d after %s (code %q, Retry-After %q); %d runs", s1, s2, time.Since(start).Round(time.Millisecond),
			auditCode(b2), h2.Get("Retry-After"), runs.Load())
	}
}

// TestAuditTransactionalAbortHandlerStoresNothing: the same panic on a transactional route rolls
// back and stores nothing; the retry runs at once and takes effect once.
func TestAuditTransactionalAbortHandlerStoresNothing(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	pgtest.Exec(t, pool, `CREATE TABLE audit_effects (id serial PRIMARY KEY)`)
	var runs atomic.Int32
	srv, _ := auditServer(t, idem.Options{DB: pool, DuplicateWait: 2 * time.Second}, idem.Route{},
		func(w http.ResponseWriter, r *http.Request) {
			if _, err := idem.TxFrom(r.Context()).Exec(r.Context(), `INSERT INTO audit_effects DEFAULT VALUES`); err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
			if runs.Add(1) == 1 {
				panic(http.ErrAbortHandler)
			}
			w.WriteHeader(http.StatusCreated)
		})
	s1, _, _ := auditPost(t, srv.URL, "abort-tx", `{}`)
	start := time.Now()
	s2, _, b2 := auditPost(t, srv.URL, "abort-tx", `{}`)
	n := pgtest.Count(t, pool, `SELECT count(*) FROM audit_effects`)
	if s1 != -1 || s2 != 201 || n != 1 || time.Since(start) > time.Second {
		t.Fatalf("first %d; retry %d %s after %s; %d effects", s1, s2, b2, time.Since(start), n)
	}
}

// TestAuditDefaultsInEffect: every documented default of Options, as Options() reports it and as
// the store applies it (go doc Options; docs/http.md "How long a key lives": TTL 24 hours).
func TestAuditDefaultsInEffect(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	srv, m := auditServer(t, idem.Options{DB: pool}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"id":1}`)
	})
	o := m.Options()
	if o.WorkTimeout != 30*time.Second || o.DuplicateWait != 10*time.Second || o.MaxBodyBytes != 1<<20 ||
		o.MaxStoredBodyBytes != 256<<10 || o.MaxWaitingBytes != 16<<20 || o.MaxAttempts != 3 ||
		fmt.Sprint(o.StoredHeaders) != "[Content-Type Location ETag Content-Location Last-Modified]" ||
		o.KeyHeader != "Idempotency-Key" || o.ReplayHeader != "Idempotent-Replayed" || o.CorrelationHeader != "X-Request-Id" ||
		o.ProblemBase != "https://github.com/pgidem/pgidem/blob/main/docs/http.md#" || o.TTL != 0 || o.LockTimeout != 0 ||
		o.MaxWaitingClaims != 0 || o.Metrics != nil || o.TracerProvider != nil || o.Logger == nil || o.FinalStatus == nil {
		t.Fatalf("options in effect: %+v", o)
	}
	pool2, _ := pgtest.NewPool(t, 8)
	m2, err := idem.New(context.Background(), idem.Options{DB: pool2, Principal: alice, MaxBodyBytes: 2 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if m2.Options().MaxWaitingBytes != 32<<20 {
		t.Fatalf("MaxWaitingBytes with 2 MiB bodies: %d, want 16 times MaxBodyBytes", m2.Options().MaxWaitingBytes)
	}
	before := time.Now()
	if s, _, b := auditPost(t, srv.URL, "ttl-1", `{}`); s != 201 {
		t.Fatalf("%d %s", s, b)
	}
	k, ok, err := idem.ReadKey(context.Background(), pool, "alice", "ttl-1")
	if err != nil || !ok {
		t.Fatal(ok, err)
	}
	if d := k.KeptUntil.Sub(before); d < 24*time.Hour-time.Minute || d > 24*time.Hour+time.Minute {
		t.Fatalf("the answer is kept %s after it was given, want the default TTL of 24 hours", d)
	}
}

// TestAuditUnreadableBodyIs400: "request_body_unreadable: 400. The request body could not be
// read" (docs/http.md), a problem with nosniff, and nothing stored for the key.
func TestAuditUnreadableBodyIs400(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	var runs atomic.Int32
	srv, _ := auditServer(t, idem.Options{DB: pool}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	})
	conn, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprint(conn, "POST /things HTTP/1.1\r\nHost: x\r\nIdempotency-Key: unread-1\r\nContent-Type: application/json\r\n"+
		"Transfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\nzz\r\n")
	res, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(res.Body)
	_, ok, _ := idem.ReadKey(context.Background(), pool, "alice", "unread-1")
	if res.StatusCode != 400 || auditCode(string(b)) != idem.CodeBodyUnreadable || res.Header.Get("X-Content-Type-Options") != "nosniff" ||
		ok || runs.Load() != 0 {
		t.Fatalf("%d %s; stored %v; %d runs", res.StatusCode, b, ok, runs.Load())
	}
}

// TestAuditOversizeFinalErrorIsSentOnceThenNotReplayable: "response larger than
// MaxStoredBodyBytes, success or final error: sent once; stored without the body; a repeat of
// it: 409 response_not_replayable with resource_id, with Idempotent-Replayed: true".
func TestAuditOversizeFinalErrorIsSentOnceThenNotReplayable(t *testing.T) {
	t.Parallel()
	big := `{"id":"r-9","pad":"` + strings.Repeat("x", 200) + `"}`
	srv, _ := auditServer(t, idem.Options{MaxStoredBodyBytes: 64}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusUnprocessableEntity)
		fmt.Fprint(w, big)
	})
	s1, _, b1 := auditPost(t, srv.URL, "over-1", `{}`)
	s2, h2, b2 := auditPost(t, srv.URL, "over-1", `{}`)
	var p idem.Problem
	_ = json.Unmarshal([]byte(b2), &p)
	if s1 != 422 || b1 != big || s2 != 409 || p.Code != idem.CodeNotReplayable || p.ResourceID != "r-9" ||
		h2.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("first %d (%d bytes); repeat %d %s replayed %q", s1, len(b1), s2, b2, h2.Get("Idempotent-Replayed"))
	}
}

// TestAuditDefaultActionOfAPathWithNUL: without a router's template, "the template is the URL
// path", and the default action "stays one the database stores and a bounded label: ... bytes
// of the path that are not UTF-8 (/x/%ff) become U+FFFD" (docs/http.md). A client may send
// %00 in the path. Promise: the request is served as any other (201, then a replay), not
// answered 503 store_unavailable ("the database failed"), which idemclient retries in vain.
func TestAuditDefaultActionOfAPathWithNUL(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: alice, Logger: auditQuiet})
	if err != nil {
		t.Fatal(err)
	}
	// Any other router: here none at all, so the template is the URL path.
	srv := httptest.NewServer(m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"id":1}`)
	})))
	defer srv.Close()
	ctx := context.Background()
	for _, path := range []string{"/x/%ff", "/x/%00"} {
		s1, _, b1 := pgtest.Send(t, ctx, "POST", srv.URL+path, `{}`, "Idempotency-Key", "nul"+path[3:], "Content-Type", "application/json")
		s2, h2, _ := pgtest.Send(t, ctx, "POST", srv.URL+path, `{}`, "Idempotency-Key", "nul"+path[3:], "Content-Type", "application/json")
		if s1 != 201 || s2 != 201 || h2.Get("Idempotent-Replayed") != "true" {
			t.Errorf("POST %s: %d %s (code %q); repeat %d", path, s1, b1, auditCode(b1), s2)
		}
	}
}

// TestAuditCrossProcessDuplicateGetsTheAnswerSoon: on a transactional route a duplicate in
// another process "waits ... on the key's row lock with a wait slot; it is answered the moment
// the first commits, and claims again after each wait of the lock timeout until its own wait
// is over" (docs/http.md), "within half a second of the answer being stored". Two middlewares
// on one database; the first holds the key (its handler waits on a barrier) across several lock
// timeouts of the duplicate's.
func TestAuditCrossProcessDuplicateGetsTheAnswerSoon(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	hold := make(chan struct{})
	entered := make(chan struct{}, 1)
	var runs atomic.Int32
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		entered <- struct{}{}
		<-hold
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"run":%d}`, n)
	})
	opts := idem.Options{LockTimeout: 300 * time.Millisecond, DuplicateWait: 8 * time.Second}
	opts.DB = newPool(t, url)
	a, _ := auditServer(t, opts, idem.Route{}, h)
	opts.DB = newPool(t, url)
	b, _ := auditServer(t, opts, idem.Route{}, h)
	type answer struct {
		status int
		header http.Header
		body   string
		at     time.Time
	}
	first, dup := make(chan answer, 1), make(chan answer, 1)
	go func() {
		s, h, body := auditPost(t, a.URL, "xp-1", `{"amount":1}`)
		first <- answer{s, h, body, time.Now()}
	}()
	<-entered
	go func() {
		s, h, body := auditPost(t, b.URL, "xp-1", `{"amount":1}`)
		dup <- answer{s, h, body, time.Now()}
	}()
	watcher := pgtest.Connect(t, url)
	pgtest.WaitFor(t, watcher, pgtest.KeyWaiters)
	time.Sleep(time.Second) // several of the duplicate's lock timeouts
	close(hold)
	f := <-first
	var d answer
	select {
	case d = <-dup:
	case <-time.After(10 * time.Second):
		t.Fatal("the duplicate never answered")
	}
	if f.status != 201 || d.status != 201 || d.body != f.body || d.header.Get("Idempotent-Replayed") != "true" || runs.Load() != 1 {
		t.Fatalf("first %d %s; duplicate %d %s (code %q); %d runs", f.status, f.body, d.status, d.body, auditCode(d.body), runs.Load())
	}
	if lag := d.at.Sub(f.at); lag > 500*time.Millisecond {
		t.Fatalf("the duplicate answered %s after the first", lag)
	}
}

// TestAuditDeclaredActionPGCannotHoldPanics: a declared Route.Action that is not valid UTF-8,
// or holds U+0000, could never be claimed (PostgreSQL's text holds neither: 22021 on every
// request): it panics when the route is declared, as an over-long one does (D166).
func TestAuditDeclaredActionPGCannotHoldPanics(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 2)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: alice, Logger: auditQuiet})
	if err != nil {
		t.Fatal(err)
	}
	for _, action := range []string{"POST /x\x00", "POST /caf\xe9"} {
		func() {
			defer func() {
				if p := recover(); p == nil || !strings.Contains(fmt.Sprint(p), "valid UTF-8") {
					t.Errorf("Route{Action: %q}: recovered %v", action, p)
				}
			}()
			m.Route(idem.Route{Action: action})
		}()
	}
}
