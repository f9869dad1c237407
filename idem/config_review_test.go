package idem_test

// The configuration surface of package idem, from a review of it: Options at their bounds,
// principal functions, key headers, Declare. Each test asserts a documented promise.

import (
	"context"
	"fmt"
	"io"
	"log"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// cfgEnv: a pool with an effects table, a middleware and a server for one route.
type cfgEnv struct {
	pool *pgxpool.Pool
	m    *idem.Middleware
	srv  *httptest.Server
}

func cfgEffectHandler(pool *pgxpool.Pool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		var id int
		var err error
		if tx := idem.TxFrom(ctx); tx != nil {
			err = tx.QueryRow(ctx, `INSERT INTO cfg_effects (path) VALUES ($1) RETURNING id`, r.URL.Path).Scan(&id)
		} else {
			err = pool.QueryRow(ctx, `INSERT INTO cfg_effects (path) VALUES ($1) RETURNING id`, r.URL.Path).Scan(&id)
		}
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(201)
		fmt.Fprintf(w, `{"id":%d}`, id)
	}
}

func cfgNew(t *testing.T, conns int32, o idem.Options, rt idem.Route) *cfgEnv {
	t.Helper()
	pool, _ := pgtest.NewPool(t, conns)
	pgtest.Exec(t, pool, `CREATE TABLE cfg_effects (id serial PRIMARY KEY, path text)`)
	o.DB = pool
	if o.Principal == nil {
		o.Principal = alice
	}
	if o.Logger == nil {
		o.Logger = quietLogger()
	}
	m, err := idem.New(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(m.Route(rt)(cfgEffectHandler(pool)))
	t.Cleanup(srv.Close)
	return &cfgEnv{pool: pool, m: m, srv: srv}
}

func (e *cfgEnv) effects(t *testing.T) int {
	return pgtest.Count(t, e.pool, `SELECT count(*) FROM cfg_effects`)
}
func (e *cfgEnv) keys(t *testing.T) int {
	return pgtest.Count(t, e.pool, `SELECT count(*) FROM idem.idempotency_keys`)
}

// cfgRaw sends a raw HTTP/1.1 request with header lines as written (names as written, each value after its first colon).
func cfgRaw(t *testing.T, srv *httptest.Server, body string, lines ...string) (int, string) {
	t.Helper()
	headers := []string{"Content-Type", "application/json"}
	for _, l := range lines {
		name, value, _ := strings.Cut(l, ":")
		headers = append(headers, name, strings.TrimPrefix(value, " "))
	}
	return routingRaw(t, srv, "POST", "/x", body, headers...)
}

// TestConfigBoundsWorkAtRequestTime: every option at the largest value New takes works at the
// first request too (no option surfaces only then): WorkTimeout and Route.WorkTimeout at
// math.MaxInt64, LockTimeout at MaxLockTimeout, TTL at MaxDuration, sizes at their type's
// maximum, DuplicateWait at MaxDuplicateWait, a lease route at MaxDuration with LeaseTimeout
// at math.MaxInt64. Asserted: 201, then a replay; the lease route alike.
func TestConfigBoundsWorkAtRequestTime(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	o := idem.Options{WorkTimeout: math.MaxInt64, LockTimeout: idem.MaxLockTimeout, TTL: idem.MaxDuration,
		MaxBodyBytes: math.MaxInt64, MaxStoredBodyBytes: math.MaxInt, MaxAttempts: math.MaxInt,
		DuplicateWait: idem.MaxDuplicateWait}
	e := cfgNew(t, 4, o, idem.Route{Action: "POST /x", WorkTimeout: math.MaxInt64})
	for i, want := range []string{"", "true"} {
		st, h, body := pgtest.Send(t, ctx, "POST", e.srv.URL+"/x", `{"a":1}`, "Idempotency-Key", "big")
		if st != 201 || h.Get("Idempotent-Replayed") != want {
			t.Fatalf("request %d with options at their bounds: %d replayed=%q %s", i, st, h.Get("Idempotent-Replayed"), body)
		}
	}
	lease := httptest.NewServer(e.m.Route(idem.Route{Action: "POST /lease", Lease: idem.MaxDuration, LeaseTimeout: math.MaxInt64})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(201)
			io.WriteString(w, `{"id":"p1"}`)
		})))
	defer lease.Close()
	for i, want := range []string{"", "true"} {
		st, h, body := pgtest.Send(t, ctx, "POST", lease.URL+"/lease", `{"a":1}`, "Idempotency-Key", "big-lease")
		if st != 201 || h.Get("Idempotent-Replayed") != want {
			t.Fatalf("lease request %d at the bounds: %d replayed=%q %s", i, st, h.Get("Idempotent-Replayed"), body)
		}
	}
	if n := e.effects(t); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
}

// TestConfigLockTimeoutAboveDuplicateWait: a LockTimeout far above DuplicateWait does not
// stretch a duplicate's wait: "409 request_in_progress comes when DuplicateWait is over".
// Asserted: with LockTimeout 1 minute and DuplicateWait 300ms, a duplicate of a key held by
// another process gets 409 with Retry-After within 2 seconds.
func TestConfigLockTimeoutAboveDuplicateWait(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := cfgNew(t, 4, idem.Options{LockTimeout: time.Minute, DuplicateWait: 300 * time.Millisecond}, idem.Route{Action: "POST /x"})
	holder := pgtest.Connect(t, pgtest.URLOf(t, e.pool))
	pgtest.Exec(t, holder, `BEGIN`)
	pgtest.Exec(t, holder, `SELECT idem.idem_begin('alice', 'k1', 'POST /x', sha256('x'::bytea))`)
	defer holder.Exec(ctx, `ROLLBACK`)
	start := time.Now()
	st, h, body := pgtest.Send(t, ctx, "POST", e.srv.URL+"/x", `{}`, "Idempotency-Key", "k1")
	if took := time.Since(start); st != 409 || h.Get("Retry-After") == "" || took > 2*time.Second {
		t.Fatalf("duplicate with LockTimeout 1m, DuplicateWait 300ms: %d Retry-After=%q after %s: %s", st, h.Get("Retry-After"), took, body)
	}
}

// TestConfigPrincipals: what the principal function returns. Documented: "Keys belong to a
// principal: 1 to 255 characters (longer is a 500 idempotency_misconfigured)", and a
// principal that PostgreSQL's text cannot hold (U+0000, not UTF-8) is 500 misconfigured too;
// nothing is stored for a refused one. Asserted per case: status and code, the handler's
// effect count and the key rows.
func TestConfigPrincipals(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var mu sync.Mutex
	principal := "alice"
	e := cfgNew(t, 4, idem.Options{Principal: func(*http.Request) (string, bool) {
		mu.Lock()
		defer mu.Unlock()
		return principal, true
	}}, idem.Route{Action: "POST /x"})
	for i, c := range []struct {
		name, principal string
		status          int
		code            string
		stored          bool
	}{
		{"empty", "", 500, idem.CodeMisconfigured, false},
		{"255 chars", strings.Repeat("p", 255), 201, "", true},
		{"255 two-byte chars", strings.Repeat("é", 255), 201, "", true},
		{"256 chars", strings.Repeat("p", 256), 500, idem.CodeMisconfigured, false},
		{"300 chars", strings.Repeat("p", 300), 500, idem.CodeMisconfigured, false},
		{"U+0000", "al\x00ice", 500, idem.CodeMisconfigured, false},
		{"not UTF-8", "al\xffice", 500, idem.CodeMisconfigured, false},
		{"control char", "al\x01ice", 201, "", true},
	} {
		mu.Lock()
		principal = c.principal
		mu.Unlock()
		effects, keys := e.effects(t), e.keys(t)
		st, _, body := pgtest.Send(t, ctx, "POST", e.srv.URL+"/x", `{}`, "Idempotency-Key", fmt.Sprintf("k%d", i))
		if st != c.status || (c.code != "" && !strings.Contains(body, `"code":"`+c.code+`"`)) {
			t.Errorf("%s: %d %s, want %d %s", c.name, st, body, c.status, c.code)
		}
		de, dk := e.effects(t)-effects, e.keys(t)-keys
		if c.stored && (de != 1 || dk != 1) || !c.stored && (de != 0 || dk != 0) {
			t.Errorf("%s: %d effects and %d keys stored (stored=%v)", c.name, de, dk, c.stored)
		}
	}
	// Two principals under one key are two key spaces: both run, each replays its own.
	for _, p := range []string{"tenant-a", "tenant-b"} {
		mu.Lock()
		principal = p
		mu.Unlock()
		st1, _, b1 := pgtest.Send(t, ctx, "POST", e.srv.URL+"/x", `{}`, "Idempotency-Key", "shared")
		st2, h2, b2 := pgtest.Send(t, ctx, "POST", e.srv.URL+"/x", `{}`, "Idempotency-Key", "shared")
		if st1 != 201 || st2 != 201 || b1 != b2 || h2.Get("Idempotent-Replayed") != "true" {
			t.Errorf("%s: %d %s then %d %s", p, st1, b1, st2, b2)
		}
	}
}

// TestConfigPanickingPrincipalLeavesNoWork: a principal function that panics (answered 500
// internal_error, as a handler's panic, D222; net/http used to drop the connection) must not
// leave the request counted as work in flight: Shutdown returns nil at once. Asserted:
// Shutdown with a 2 s deadline returns nil within it, and no key is stored.
func TestConfigPanickingPrincipalLeavesNoWork(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := cfgNew(t, 4, idem.Options{Principal: func(r *http.Request) (string, bool) {
		if r.Header.Get("X-Boom") != "" {
			panic("auth backend exploded")
		}
		return "alice", true
	}}, idem.Route{Action: "POST /x"})
	e.srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	if st, _, b := pgtest.Send(t, ctx, "POST", e.srv.URL+"/x", `{}`, "Idempotency-Key", "k1", "X-Boom", "1"); st != 500 || auditCode(b) != idem.CodeInternalError {
		t.Fatalf("panicking principal: %d %s, want 500 internal_error", st, b)
	}
	if st, _, b := pgtest.Send(t, ctx, "POST", e.srv.URL+"/x", `{}`, "X-Boom", "1"); st != 500 || auditCode(b) != idem.CodeInternalError {
		t.Fatalf("panicking principal without key: %d %s, want 500 internal_error", st, b)
	}
	sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	start := time.Now()
	if err := e.m.Shutdown(sctx); err != nil {
		t.Fatalf("Shutdown after a panicking principal: %v after %s", err, time.Since(start))
	}
	if n := e.keys(t); n != 0 {
		t.Fatalf("%d keys stored", n)
	}
}

// TestConfigKeyHeaderVariants: docs/http.md "The key": a bare or quoted (RFC 8941 sf-string)
// value names the same key; after unquoting 1 to 255 visible ASCII characters; two header
// lines get 400; the header name is case-insensitive (HTTP). Asserted per case: the status
// (and the replay of the first answer when the key is the same).
func TestConfigKeyHeaderVariants(t *testing.T) {
	t.Parallel()
	e := cfgNew(t, 4, idem.Options{}, idem.Route{Action: "POST /x", Required: true})
	k255 := strings.Repeat("k", 255)
	for _, c := range []struct {
		name   string
		lines  []string
		status int
	}{
		{"lowercase name", []string{"idempotency-key: lower1"}, 201},
		{"lowercase name, replay", []string{"IDEMPOTENCY-KEY: lower1"}, 201},
		{"quoted is the bare key", []string{`Idempotency-Key: "lower1"`}, 201},
		{"two lines", []string{"Idempotency-Key: a1", "Idempotency-Key: a2"}, 400},
		{"two lines, same value", []string{"Idempotency-Key: a1", "idempotency-key: a1"}, 400},
		{"empty", []string{"Idempotency-Key:"}, 400},
		{"whitespace only", []string{"Idempotency-Key:  \t "}, 400},
		{"surrounding whitespace", []string{"Idempotency-Key:   ws1  "}, 201},
		{"inner space", []string{"Idempotency-Key: a b"}, 400},
		{"255", []string{"Idempotency-Key: " + k255}, 201},
		{"256", []string{"Idempotency-Key: " + k255 + "k"}, 400},
		{"quoted 255", []string{`Idempotency-Key: "` + k255 + `"`}, 201},
		{"quoted 256", []string{`Idempotency-Key: "` + k255 + `k"`}, 400},
		{"non-ASCII", []string{"Idempotency-Key: clé"}, 400},
		{"quoted empty", []string{`Idempotency-Key: ""`}, 400},
		{"unterminated quote", []string{`Idempotency-Key: "abc`}, 400},
		{"escaped quote", []string{`Idempotency-Key: "a\"b"`}, 201},
		{"missing on required route", nil, 400},
	} {
		st, body := cfgRaw(t, e.srv, `{}`, c.lines...)
		if st != c.status {
			t.Errorf("%s: %d %s, want %d", c.name, st, body, c.status)
		}
	}
	if n := pgtest.Count(t, e.pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'lower1'`); n != 1 {
		t.Errorf("lower1 rows: %d", n)
	}
	if n := e.effects(t); n != 4 {
		t.Errorf("%d effects, want 4 (lower1, ws1, the 255-character key once, a\"b)", n)
	}
}

// TestConfigDeclareThatCannotWorkPanics: Middleware.Declare "panics on a declaration that
// cannot work". A declaration with an empty method or template, a template that is not a path
// (no leading "/"), or a ServeMux-style pattern as the method ("POST /v1/orders") can never be
// matched by Handler: every request to the route the user believed idempotent ran every time,
// key or not, silently. Each of them panics now.
func TestConfigDeclareThatCannotWorkPanics(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: alice, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range [][2]string{{"", "/v1/orders"}, {"POST", ""}, {"POST", "v1/orders"}, {"POST /v1/orders", "/v1/orders"},
		{"POST", "POST /v1/orders"}} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("Declare(%q, %q) was accepted; it can never match a request", c[0], c[1])
				}
			}()
			m.Declare(c[0], c[1], idem.Route{Required: true})
		}()
	}
}

// TestConfigKeyHeaderThatIsTheCorrelationHeader: New accepted a KeyHeader equal to the
// CorrelationHeader (an API whose clients send their idempotency key as X-Request-Id). The
// middleware then logged the raw key as request_id and echoed it in every problem's
// correlation_id, where Options.Logger promises "never a raw key or body: keys are logged as a
// short hash". New refuses the combination, naming both fields.
func TestConfigKeyHeaderThatIsTheCorrelationHeader(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var logs strings.Builder
	var mu sync.Mutex
	lw := writerFunc(func(p []byte) (int, error) { mu.Lock(); defer mu.Unlock(); return logs.Write(p) })
	pool, _ := pgtest.NewPool(t, 4)
	pgtest.Exec(t, pool, `CREATE TABLE cfg_effects (id serial PRIMARY KEY, path text)`)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice, KeyHeader: "X-Request-Id",
		Logger: slog.New(slog.NewTextHandler(lw, nil))})
	if err != nil {
		if strings.Contains(err.Error(), "KeyHeader") && strings.Contains(err.Error(), "CorrelationHeader") {
			return
		}
		t.Fatalf("New: %v", err)
	}
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /x"})(cfgEffectHandler(pool)))
	defer srv.Close()
	const key = "01J9SECRETKEY-acct-42"
	pgtest.Send(t, ctx, "POST", srv.URL+"/x", `{"a":1}`, "X-Request-Id", key)
	st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/x", `{"a":2}`, "X-Request-Id", key) // 422, logged
	mu.Lock()
	defer mu.Unlock()
	if strings.Contains(logs.String(), key) {
		t.Fatalf("the raw key is in the logs (the 422's body: %d %s):\n%s", st, body, logs.String())
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// TestConfigNewIsBoundedByItsContext: "ctx bounds the check": a pool whose server accepts the
// TCP connection and never answers (no connect_timeout in its string) must not hold New past
// ctx. Asserted: New returns an error within a second of ctx's 500 ms deadline.
func TestConfigNewIsBoundedByItsContext(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close() // hold it, answer nothing
		}
	}()
	pool, err := pgxpool.New(context.Background(), "postgres://u:p@"+ln.Addr().String()+"/db?sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = idem.New(ctx, idem.Options{DB: pool, Principal: alice})
	if took := time.Since(start); err == nil || took > 1500*time.Millisecond {
		t.Fatalf("New on a server that never answers: %v after %s", err, took)
	}
}

// TestConfigTinyMaxBodyBytes: MaxBodyBytes at 2: a body of exactly 2 bytes is read, one of 3
// is 413 request_too_large before any database work, with a Content-Length or chunked, and
// nothing is stored for it. Asserted: statuses, one effect, one key row.
func TestConfigTinyMaxBodyBytes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := cfgNew(t, 4, idem.Options{MaxBodyBytes: 2}, idem.Route{Action: "POST /x"})
	if st, _, b := pgtest.Send(t, ctx, "POST", e.srv.URL+"/x", `{}`, "Idempotency-Key", "k1"); st != 201 {
		t.Fatalf("2 bytes: %d %s", st, b)
	}
	if st, _, b := pgtest.Send(t, ctx, "POST", e.srv.URL+"/x", `{ }`, "Idempotency-Key", "k2"); st != 413 {
		t.Fatalf("3 bytes: %d %s", st, b)
	}
	req, _ := http.NewRequest("POST", e.srv.URL+"/x", io.MultiReader(strings.NewReader("{"), strings.NewReader(" }")))
	req.ContentLength = -1
	req.Header.Set("Idempotency-Key", "k3")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != 413 {
		t.Fatalf("3 bytes chunked: %d", res.StatusCode)
	}
	if e.effects(t) != 1 || e.keys(t) != 1 {
		t.Fatalf("%d effects, %d keys", e.effects(t), e.keys(t))
	}
}

// TestConfigReplayHeaderThatIsAnotherHeader: New accepted a ReplayHeader equal to the
// KeyHeader, and every replay carried "Idempotency-Key: true" (a QA review of the go doc; New
// refused the same for CorrelationHeader). It refuses a ReplayHeader that is the KeyHeader or
// the CorrelationHeader, in any case, defaults included.
func TestConfigReplayHeaderThatIsAnotherHeader(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	for _, o := range []idem.Options{
		{ReplayHeader: "Idempotency-Key"},
		{ReplayHeader: "x-request-id"},
		{ReplayHeader: "K", KeyHeader: "k"},
		{ReplayHeader: "Idempotent-Replayed", CorrelationHeader: "idempotent-replayed"},
	} {
		o.DB, o.Principal = pool, alice
		if _, err := idem.New(ctx, o); err == nil || !strings.Contains(err.Error(), "ReplayHeader") {
			t.Errorf("ReplayHeader %q, KeyHeader %q, CorrelationHeader %q: %v, want New to refuse it",
				o.ReplayHeader, o.KeyHeader, o.CorrelationHeader, err)
		}
	}
	if _, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice, ReplayHeader: "X-Replayed"}); err != nil {
		t.Fatalf("another ReplayHeader: %v", err)
	}
}
