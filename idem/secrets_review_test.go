package idem_test

// A review (helper session; topic: secrets and sensitive data) found no broken promise; its
// tests are kept: where request headers, bodies, keys, principals
// and one-time secrets go, through the public middleware against a real PostgreSQL.

import (
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// secretsLog is a slog destination that tests can read while the middleware writes.
type secretsLog struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *secretsLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *secretsLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

func (l *secretsLog) logger() *slog.Logger {
	return slog.New(slog.NewJSONHandler(l, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// secretsObserver records every action label the middleware hands its Observer.
type secretsObserver struct {
	mu      sync.Mutex
	actions map[string]int
}

func (o *secretsObserver) add(a string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.actions == nil {
		o.actions = map[string]int{}
	}
	o.actions[a]++
}
func (o *secretsObserver) Count(action string, _ idem.State)                 { o.add(action) }
func (o *secretsObserver) Done(idem.State, time.Duration)                    {}
func (o *secretsObserver) LeaseExtended(action string)                       { o.add(action) }
func (o *secretsObserver) LeaseEnded(action string, _ bool, _ time.Duration) { o.add(action) }

// secretsPrincipal reads the principal from X-Principal (a stand-in for an authentication
// middleware in front of idem).
func secretsPrincipal(r *http.Request) (string, bool) {
	p := r.Header.Get("X-Principal")
	return p, p != ""
}

func secretsSend(t *testing.T, url, principal, key, body string, headers ...string) (int, http.Header, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	h := append([]string{"X-Principal", principal, "Idempotency-Key", key, "Content-Type", "application/json"}, headers...)
	return pgtest.Send(t, ctx, "POST", url, body, h...)
}

// secretsRowText is every row of the key table for key, as text (bytea as hex), read by the owner.
func secretsRowText(t *testing.T, pool *pgxpool.Pool, key string) string {
	t.Helper()
	var s *string
	if err := pool.QueryRow(context.Background(), `SELECT string_agg(k::text, ' ') FROM idem.idempotency_keys AS k WHERE k.key = $1`,
		key).Scan(&s); err != nil {
		t.Fatal(err)
	}
	if s == nil {
		return ""
	}
	return *s
}

// secretsHolds reports which of the secrets text holds, as they are or hex-encoded (a bytea).
func secretsHolds(text string, secrets ...string) []string {
	var found []string
	for _, s := range secrets {
		if strings.Contains(text, s) || strings.Contains(text, hex.EncodeToString([]byte(s))) {
			found = append(found, s)
		}
	}
	return found
}

func secretsWaitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

type secretsAnswer struct {
	status int
	header http.Header
	body   string
}

// TestSecretsSensitiveHeadersAreNeitherStoredNorReplayed: docs/http.md, "What happens":
// "which headers are stored is Options.StoredHeaders (Content-Type, Location, ETag,
// Content-Location, Last-Modified)"; the request is stored as its fingerprint. A response's
// Set-Cookie, Authorization-like headers and the request's Authorization, Cookie and body must
// not be in the key's row, nor come back on a replay to the same key.
func TestSecretsSensitiveHeadersAreNeitherStoredNorReplayed(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: secretsPrincipal, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	mux := http.NewServeMux()
	mux.Handle("POST /things", m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Add("Set-Cookie", "session=ZZRESPCOOKIE1; HttpOnly")
		w.Header().Add("Set-Cookie", "csrf=ZZRESPCOOKIE2")
		w.Header().Set("Authorization", "Bearer ZZRESPAUTH")
		w.Header().Set("Proxy-Authorization", "Basic ZZRESPPROXY")
		w.Header().Set("X-Api-Key", "ZZRESPAPIKEY")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"id":1}`)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	const key = "zz-secrets-headers"
	reqSecrets := []string{"ZZREQAUTH", "ZZREQCOOKIE", "ZZREQPROXY", "ZZBODYSECRET"}
	send := func() (int, http.Header, string) {
		return secretsSend(t, srv.URL+"/things", "alice", key, `{"password":"ZZBODYSECRET","amount":1}`,
			"Authorization", "Bearer ZZREQAUTH", "Cookie", "sid=ZZREQCOOKIE", "Proxy-Authorization", "Basic ZZREQPROXY")
	}
	s1, h1, _ := send()
	if s1 != 201 || h1.Get("Set-Cookie") == "" {
		t.Fatalf("first answer: %d %v", s1, h1)
	}
	s2, h2, b2 := send()
	if s2 != 201 || h2.Get("Idempotent-Replayed") != "true" || runs.Load() != 1 {
		t.Fatalf("repeat: %d %v %s (%d runs)", s2, h2, b2, runs.Load())
	}
	for _, name := range []string{"Set-Cookie", "Authorization", "Proxy-Authorization", "X-Api-Key"} {
		if v := h2.Values(name); len(v) > 0 {
			t.Errorf("the replay carries the first answer's %s: %q", name, v)
		}
	}
	row := secretsRowText(t, pool, key)
	if row == "" {
		t.Fatal("no row for the key")
	}
	if found := secretsHolds(row, append(reqSecrets, "ZZRESPCOOKIE1", "ZZRESPCOOKIE2", "ZZRESPAUTH", "ZZRESPPROXY", "ZZRESPAPIKEY")...); len(found) > 0 {
		t.Errorf("the key's row holds %v: %s", found, row)
	}
	story, ok, err := idem.ReadKey(context.Background(), pool, "alice", key)
	if err != nil || !ok {
		t.Fatalf("ReadKey: %v %v", ok, err)
	}
	if found := secretsHolds(fmt.Sprint(story), "ZZRESPCOOKIE1", "ZZRESPAUTH", "ZZREQAUTH", "ZZBODYSECRET"); len(found) > 0 {
		t.Errorf("the key's story holds %v: %+v", found, story)
	}
}

// TestSecretsOneTimeSecretReachesNoDuplicate: go doc MarkOneTimeSecret: "it is sent, stored
// without its body, and a repeat gets 409 one_time_secret"; docs/http.md: "sent once".
// A duplicate that waits (in this process) for the first request must get 409
// one_time_secret, not the secret, on a transactional route and on a lease route; and the
// key's row must not hold the secret.
func TestSecretsOneTimeSecretReachesNoDuplicate(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		rt   idem.Route
	}{{"transactional", idem.Route{}}, {"lease", idem.Route{Lease: 10 * time.Second}}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			pool, _ := pgtest.NewPool(t, 8)
			m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: secretsPrincipal,
				Logger: slog.New(slog.DiscardHandler), DuplicateWait: 20 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			started, release := make(chan struct{}), make(chan struct{})
			var once sync.Once
			const token = "ZZONETIMETOKEN0123456789"
			mux := http.NewServeMux()
			mux.Handle("POST /tokens", m.Route(c.rt)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				once.Do(func() { close(started) })
				<-release
				idem.MarkOneTimeSecret(r.Context())
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusCreated)
				fmt.Fprintf(w, `{"id":7,"token":%q}`, token)
			})))
			srv := httptest.NewServer(mux)
			defer srv.Close()
			key := "zz-secrets-once-" + c.name
			answers := make(chan secretsAnswer, 2)
			go func() {
				s, h, b := secretsSend(t, srv.URL+"/tokens", "alice", key, `{"name":"ci"}`)
				answers <- secretsAnswer{s, h, b}
			}()
			<-started
			go func() {
				s, h, b := secretsSend(t, srv.URL+"/tokens", "alice", key, `{"name":"ci"}`)
				answers <- secretsAnswer{s, h, b}
			}()
			secretsWaitUntil(t, "the duplicate to wait", func() bool {
				st := m.GateStats()
				return st.Waiting >= 1 || st.Coalesced >= 1
			})
			close(release)
			a, b := <-answers, <-answers
			withToken := 0
			for _, x := range []secretsAnswer{a, b} {
				if strings.Contains(x.body, token) {
					withToken++
				}
			}
			if withToken != 1 {
				t.Errorf("the one-time secret reached %d clients, want 1: %d %s / %d %s", withToken, a.status, a.body, b.status, b.body)
			}
			dup := b
			if strings.Contains(b.body, token) {
				dup = a
			}
			if dup.status != http.StatusConflict || auditCode(dup.body) != "one_time_secret" {
				t.Errorf("the duplicate: %d %s, want 409 one_time_secret", dup.status, dup.body)
			}
			if row := secretsRowText(t, pool, key); secretsHolds(row, token) != nil {
				t.Errorf("the key's row holds the one-time secret: %s", row)
			}
			// A later repeat: 409 one_time_secret too.
			s, _, body := secretsSend(t, srv.URL+"/tokens", "alice", key, `{"name":"ci"}`)
			if s != http.StatusConflict || strings.Contains(body, token) {
				t.Errorf("a later repeat: %d %s", s, body)
			}
		})
	}
}

// TestSecretsSameKeyUnderTwoPrincipalsIsIndependent: go doc Job: "keys of different
// principals never collide"; docs/sql-api.md: "another principal uses the same key | a
// different [provider key]". Bob's request under the key Alice's request holds (still
// running) must neither wait for it, nor be refused, nor get Alice's answer; Bob learns
// nothing of Alice's key.
func TestSecretsSameKeyUnderTwoPrincipalsIsIndependent(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		rt   idem.Route
	}{{"transactional", idem.Route{}}, {"lease", idem.Route{Lease: 10 * time.Second}}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			pool, _ := pgtest.NewPool(t, 8)
			m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: secretsPrincipal,
				Logger: slog.New(slog.DiscardHandler), DuplicateWait: 3 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			aliceIn, releaseAlice := make(chan struct{}), make(chan struct{})
			mux := http.NewServeMux()
			mux.Handle("POST /things", m.Route(c.rt)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				p := r.Header.Get("X-Principal")
				claim, _ := idem.ClaimOf(r.Context())
				if p == "alice" {
					close(aliceIn)
					<-releaseAlice
				}
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusCreated)
				fmt.Fprintf(w, `{"owner":%q,"provider_key":%q}`, p, claim.ProviderKey)
			})))
			srv := httptest.NewServer(mux)
			defer srv.Close()
			const key = "zz-shared-key"
			aliceDone := make(chan secretsAnswer, 1)
			go func() {
				s, h, b := secretsSend(t, srv.URL+"/things", "alice", key, `{"amount":100}`)
				aliceDone <- secretsAnswer{s, h, b}
			}()
			<-aliceIn
			if _, ok, err := idem.ReadKey(context.Background(), pool, "bob", key); err != nil || ok {
				t.Errorf("bob's story of the key alice holds: %v %v", ok, err)
			}
			start := time.Now()
			s, h, b := secretsSend(t, srv.URL+"/things", "bob", key, `{"amount":999}`)
			took := time.Since(start)
			if s != 201 || h.Get("Idempotent-Replayed") != "" || !strings.Contains(b, `"owner":"bob"`) || took > 2*time.Second {
				t.Errorf("bob under alice's key while alice's request runs: %d %v %s after %s", s, h, b, took)
			}
			if st := m.GateStats(); st.Coalesced != 0 || st.Refused != 0 {
				t.Errorf("bob's request was held back with alice's: %+v", st)
			}
			close(releaseAlice)
			a := <-aliceDone
			if a.status != 201 || !strings.Contains(a.body, `"owner":"alice"`) {
				t.Fatalf("alice: %d %s", a.status, a.body)
			}
			// Each replays its own answer; the provider keys differ.
			s2, h2, b2 := secretsSend(t, srv.URL+"/things", "bob", key, `{"amount":999}`)
			if s2 != 201 || h2.Get("Idempotent-Replayed") != "true" || b2 != b {
				t.Errorf("bob's repeat: %d %s, want a replay of %s", s2, b2, b)
			}
			s3, _, b3 := secretsSend(t, srv.URL+"/things", "alice", key, `{"amount":100}`)
			if s3 != 201 || b3 != a.body {
				t.Errorf("alice's repeat: %d %s, want %s", s3, b3, a.body)
			}
			if a.body[strings.Index(a.body, "provider_key"):] == b[strings.Index(b, "provider_key"):] {
				t.Errorf("one provider key for two principals: %s %s", a.body, b)
			}
		})
	}
}

// TestSecretsLogsAndLabelsHoldNoKeyBodyOrCredentials: docs/http.md, "Metrics, traces and
// logs": "Logs carry the state, the action, the request id and key_hash ...: never a raw key,
// never a body"; go doc Options.Logger: "never a raw key or body". The middleware is fed
// failures (a mismatch, a malformed body, an invalid key, a duplicate told 409, a handler
// panic, a handler's failed statement, a connection killed under the work, a lease route's
// 5xx) with a recording logger and Observer: no key, no body, no Authorization or Cookie
// value may appear in the log or in the metric labels.
func TestSecretsLogsAndLabelsHoldNoKeyBodyOrCredentials(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	var log secretsLog
	obs := &secretsObserver{}
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: secretsPrincipal, Logger: log.logger(),
		Metrics: obs, DuplicateWait: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	hold, holding := make(chan struct{}), make(chan struct{}, 1)
	mux := http.NewServeMux()
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var in struct {
			Mode   string `json:"mode"`
			Secret string `json:"secret"`
		}
		if !idem.DecodeJSON(w, r, &in) {
			return
		}
		switch in.Mode {
		case "panic":
			panic("the handler gave up")
		case "divide":
			var x int
			if err := idem.TxFrom(r.Context()).QueryRow(r.Context(), `SELECT 1/0`).Scan(&x); err != nil {
				http.Error(w, "failed", 500)
				return
			}
		case "kill":
			_, _ = idem.TxFrom(r.Context()).Exec(r.Context(), `SELECT pg_terminate_backend(pg_backend_pid())`)
			w.WriteHeader(201)
			return
		case "hold":
			holding <- struct{}{}
			<-hold
		case "fail":
			http.Error(w, "failed", http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"id":1}`)
	})
	mux.Handle("POST /things/{id}", m.Route(idem.Route{})(handler))
	mux.Handle("POST /leases/{id}", m.Route(idem.Route{Lease: 5 * time.Second})(handler))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	creds := []string{"Authorization", "Bearer ZZLOGAUTH", "Cookie", "sid=ZZLOGCOOKIE"}
	var keys []string
	post := func(path, key, body string) (int, string) {
		keys = append(keys, key)
		s, _, b := secretsSend(t, srv.URL+path, "ZZLOGPRINCIPAL", key, body, creds...)
		return s, b
	}
	body := func(mode string) string { return fmt.Sprintf(`{"mode":%q,"secret":"ZZLOGBODY-%s"}`, mode, mode) }
	results := map[string]int{}
	results["first"], _ = post("/things/ZZPATHID", "zzlogkey-ok", body("ok"))
	results["mismatch"], _ = post("/things/ZZPATHID", "zzlogkey-ok", body("other"))
	results["malformed"], _ = post("/things/ZZPATHID", "zzlogkey-bad", `{"mode":"ok","secret":"ZZLOGBODY-malformed",}`)
	results["invalid key"], _ = post("/things/ZZPATHID", "zzlogkey invalid", body("ok"))
	results["panic"], _ = post("/things/ZZPATHID", "zzlogkey-panic", body("panic"))
	results["divide"], _ = post("/things/ZZPATHID", "zzlogkey-divide", body("divide"))
	results["kill"], _ = post("/things/ZZPATHID", "zzlogkey-kill", body("kill"))
	results["lease 503"], _ = post("/leases/ZZPATHID", "zzlogkey-lease-fail", body("fail"))
	// A duplicate told 409 while the first holds the key (a lease route, held by the handler).
	first := make(chan int, 1)
	go func() {
		s, _, _ := secretsSend(t, srv.URL+"/leases/ZZPATHID", "ZZLOGPRINCIPAL", "zzlogkey-held", body("hold"), creds...)
		first <- s
	}()
	<-holding
	results["busy"], _ = post("/leases/ZZPATHID", "zzlogkey-held", body("hold"))
	close(hold)
	results["held"] = <-first
	t.Logf("answers: %v", results)
	if results["mismatch"] != 422 || results["busy"] != 409 || results["malformed"] != 400 {
		t.Fatalf("the failures did not happen as planned: %v", results)
	}
	out := log.String()
	if !strings.Contains(out, "key_hash") {
		t.Fatalf("nothing was logged with a key hash; the test shows nothing:\n%s", out)
	}
	secrets := append([]string{"ZZLOGAUTH", "ZZLOGCOOKIE", "ZZLOGBODY"}, keys...)
	if found := secretsHolds(out, secrets...); len(found) > 0 {
		t.Errorf("the log holds %v:\n%s", found, out)
	}
	obs.mu.Lock()
	defer obs.mu.Unlock()
	for a := range obs.actions {
		if found := secretsHolds(a, append(secrets, "ZZPATHID", "ZZLOGPRINCIPAL")...); len(found) > 0 {
			t.Errorf("a metric label (action %q) holds %v", a, found)
		}
	}
	t.Logf("actions: %v", obs.actions)
}

// TestSecretsHandlerSQLErrorLogsNoBodyValue: docs/http.md: "Logs carry the state, the
// action, the request id and key_hash ...: never a raw key, never a body". A handler that hands
// a body member to PostgreSQL which refuses it (class 22, answered 500 internal_error and
// logged by the middleware at error level) must not get the member's value into the log.
// (Borderline: the value reaches the log through PostgreSQL's message, which quotes it.)
func TestSecretsHandlerSQLErrorLogsNoBodyValue(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	var log secretsLog
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: secretsPrincipal, Logger: log.logger()})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /pins", m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var in struct {
			Pin string `json:"pin"`
		}
		if !idem.DecodeJSON(w, r, &in) {
			return
		}
		var n int
		if err := idem.TxFrom(r.Context()).QueryRow(r.Context(), `SELECT $1::text::integer`, in.Pin).Scan(&n); err != nil {
			http.Error(w, "bad pin", http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	s, _, b := secretsSend(t, srv.URL+"/pins", "alice", "zz-pin", `{"pin":"ZZPINSECRET"}`)
	t.Logf("answer: %d %s", s, b)
	if out := log.String(); strings.Contains(out, "ZZPINSECRET") {
		t.Errorf("the log holds a value of the request's body:\n%s", out)
	}
}
