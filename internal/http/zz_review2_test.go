package idemhttp_test

import (
	"context"
	"fmt"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorilla/mux"

	"github.com/pgidem/pgidem/internal/canon"
	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestReview2KeyWithUnicodeSpaceIsInvalid: a key is 1 to 255 visible ASCII characters; a
// header value that ends in a non-ASCII space (U+00A0, U+0085, U+3000: bytes Go's server
// passes through as obs-text) is malformed and must get 400 idempotency_key_invalid, not be
// taken as another key.
func TestReview2KeyWithUnicodeSpaceIsInvalid(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	for _, key := range []string{"k1\u00a0", "\u0085k1", `"k1"` + "\u3000"} {
		r := a.do("POST", "/transfers", "alice", key, `{"amount":1}`)
		if r.status != 400 {
			t.Errorf("key %q: %d %s %v, want 400 idempotency_key_invalid", key, r.status, r.body, r.header.Get("Idempotent-Replayed"))
		}
	}
	if n := a.keys(); n != 0 {
		t.Errorf("%d keys stored from malformed keys", n)
	}
	r := a.do("POST", "/transfers", "alice", "k1", `{"amount":1}`)
	if r.header.Get("Idempotent-Replayed") == "true" {
		t.Errorf("the key k1 replays an answer given to the malformed key k1<U+00A0>: %d %s", r.status, r.body)
	}
}

// TestReview2CustomFingerprintDoesNotJudgeTheBody: with Route.Fingerprint, the middleware
// takes the custom fingerprint's JSON flag as the verdict on the body: a strictly valid JSON
// body is refused 400 malformed_body ("not strictly valid JSON") when the route fingerprints a
// projection that is not JSON, and an ambiguous body (names that differ only in case) is
// claimed (not refused before the claim) when the projection is JSON.
func TestReview2CustomFingerprintDoesNotJudgeTheBody(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idemhttp.New(idemhttp.Options{DB: pool, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Principal: func(*http.Request) (string, bool) { return "alice", true }})
	if err != nil {
		t.Fatal(err)
	}
	textual := func(r *http.Request, body []byte) canon.Fingerprint {
		return canon.Compute(r.Method, r.URL.EscapedPath(), []byte("amount-only:"+string(body[:min(len(body), 14)])))
	}
	jsonish := func(r *http.Request, body []byte) canon.Fingerprint {
		return canon.Compute(r.Method, r.URL.EscapedPath(), []byte(`"const"`))
	}
	runs := 0
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		var v struct {
			Amount int `json:"amount"`
		}
		if !idemhttp.DecodeJSON(w, r, &v) {
			return
		}
		w.WriteHeader(201)
	})
	r := mux.NewRouter()
	r.Handle("/textual", m.Route(idemhttp.Route{Fingerprint: textual})(h)).Methods("POST")
	r.Handle("/jsonish", m.Route(idemhttp.Route{Fingerprint: jsonish})(h)).Methods("POST")
	srv := httptest.NewServer(r)
	defer srv.Close()
	post := func(path, key, body string) (int, string) {
		s, _, b := pgtest.Send(t, t.Context(), "POST", srv.URL+path, body, "Idempotency-Key", key, "Content-Type", "application/json")
		return s, b
	}
	if s, b := post("/textual", "t1", `{"amount":5}`); s != 201 {
		t.Errorf("a strictly valid JSON body on a route with a custom fingerprint: %d %s, want 201", s, b)
	}
	if s, b := post("/jsonish", "j1", `{"amount":1,"Amount":500}`); s != 400 || runs > 1 {
		t.Errorf("an ambiguous body: %d %s, handler ran %d times", s, b, runs)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'j1'`); n != 0 {
		t.Errorf("an ambiguous body was claimed and its refusal stored under the key (%d rows); the contract refuses it before any claim", n)
	}
}

// TestReview2DecodeJSONRefusesCaseVariantNames: DecodeJSON, the one strict decoder, refuses
// member names that differ only in case, whatever the target.
func TestReview2DecodeJSONRefusesCaseVariantNames(t *testing.T) {
	req := httptest.NewRequest("POST", "/x", strings.NewReader(`{"amount":1,"Amount":500}`))
	req.Header.Set("Content-Type", "application/json")
	w := httptest.NewRecorder()
	var v map[string]any
	if idemhttp.DecodeJSON(w, req, &v) {
		t.Fatalf("DecodeJSON accepted names that differ only in case: %v", v)
	}
}

// TestReview2PrincipalRowLockIsNotATableLock: an application that ties keys to its principals
// (the pattern of docs/ledger.md: a foreign key from the key table to its principals) and
// serializes a principal's work with SELECT ... FOR UPDATE of the principal's row (a balance on
// the users row). A keyed request of that principal that comes while another transaction holds
// the row a little (300 ms) must wait for it, as a plain transaction does; it gets 503
// store_unavailable ("locked for maintenance") after about 50 ms: the claim's probe times out on
// the foreign key's KEY SHARE lock of the principal's row, which IsKeyWait does not take for a
// key wait, so the Gate answers as for a locked table.
func TestReview2PrincipalRowLockIsNotATableLock(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	pgtest.Exec(t, a.pool, `CREATE TABLE principals (id text PRIMARY KEY, balance int NOT NULL DEFAULT 0);
		INSERT INTO principals (id) VALUES ('alice');
		ALTER TABLE idem.idempotency_keys ADD CONSTRAINT review2_principal_fkey
			FOREIGN KEY (principal_id) REFERENCES principals (id) NOT VALID`)
	tx, err := a.pool.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(t.Context(), `SELECT balance FROM principals WHERE id = 'alice' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(300 * time.Millisecond)
		_ = tx.Rollback(context.Background())
	}()
	start := time.Now()
	r := a.do("POST", "/transfers", "alice", "fk1", `{"amount":1}`)
	if r.status != 201 {
		t.Fatalf("after %v: %d %s, want 201 once the principal's row is free (300 ms)", time.Since(start).Round(time.Millisecond), r.status, r.body)
	}
}

// TestReview2OneTimeSecretIsNotStored: CONTRACT §4, a response marked as a one-time secret is
// "sent once; stored without the body ... status only". The middleware stores its allowlisted
// headers and, when the handler named no resource, the body's top-level "id" as resource_id,
// and a repeat's 409 one_time_secret sends that id again: a token whose response is
// {"id":"<secret>"} (or whose Location names it) is kept in the key table and sent twice.
func TestReview2OneTimeSecretIsNotStored(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idemhttp.New(idemhttp.Options{DB: pool, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Principal: func(*http.Request) (string, bool) { return "alice", true }})
	if err != nil {
		t.Fatal(err)
	}
	const secret = "sk_live_5f0c1b2d9e"
	mux := http.NewServeMux()
	mux.Handle("POST /tokens", m.Route(idemhttp.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		idemhttp.MarkOneTimeSecret(r.Context())
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/tokens/"+secret)
		w.WriteHeader(201)
		fmt.Fprintf(w, `{"id":%q}`, secret)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	s1, _, b1 := pgtest.Send(t, t.Context(), "POST", srv.URL+"/tokens", `{}`, "Idempotency-Key", "t1")
	s2, _, b2 := pgtest.Send(t, t.Context(), "POST", srv.URL+"/tokens", `{}`, "Idempotency-Key", "t1")
	if s1 != 201 || !strings.Contains(b1, secret) || s2 != 409 {
		t.Fatalf("first %d %s, repeat %d %s", s1, b1, s2, b2)
	}
	if strings.Contains(b2, secret) {
		t.Errorf("the repeat of a one-time secret sends the secret again: %s", b2)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys
		WHERE key = 't1' AND (response_headers::text LIKE '%'||$1||'%' OR resource_id = $1)`, secret); n != 0 {
		t.Errorf("the one-time secret is stored in the key's row (headers or resource_id)")
	}
}

// TestReview2FinalAnswerAfterAFailedStatementIsStored: CONTRACT §4, "handler ... 409 ... its
// effect rolled back to a savepoint taken after the claim, the response stored by
// idem_save_final in the same transaction". The classic final error is a 409 answered after an
// INSERT failed on a unique constraint: the transaction is aborted (25P02) until the middleware's
// ROLLBACK TO SAVEPOINT. In pgx's default mode (QueryExecModeCacheStatement, the mode of a pool
// made from a plain URL, and the reference server's without a pooler) the commit batch first
// prepares idem_save_final's statement, on a connection that has not prepared it yet, while the
// transaction is still aborted: "error preprocessing batch (prepare): ... 25P02". The client gets
// 503 store_unavailable, nothing is stored, and every retry runs the handler again (here 3 runs,
// 3 × 503). With QueryExecModeExec the same handler's 409 is stored (the control).
func TestReview2FinalAnswerAfterAFailedStatementIsStored(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec} {
		t.Run(mode.String(), func(t *testing.T) {
			_, url := pgtest.NewPool(t, 1)
			cfg, err := pgxpool.ParseConfig(url)
			if err != nil {
				t.Fatal(err)
			}
			cfg.MaxConns = 8
			cfg.ConnConfig.DefaultQueryExecMode = mode
			pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			pgtest.Exec(t, pool, `CREATE TABLE u (id int PRIMARY KEY); INSERT INTO u VALUES (1)`)
			var logs strings.Builder
			var mu sync.Mutex
			m, err := idemhttp.New(idemhttp.Options{DB: pool, Logger: slog.New(slog.NewTextHandler(review2Writer{&mu, &logs}, nil)),
				Principal: func(*http.Request) (string, bool) { return "alice", true }})
			if err != nil {
				t.Fatal(err)
			}
			var runs atomic.Int32
			mux := http.NewServeMux()
			mux.Handle("POST /u", m.Route(idemhttp.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				tx := idemhttp.Tx(r.Context())
				_, _ = tx.Exec(r.Context(), `INSERT INTO u VALUES (2)`)
				if _, err := tx.Exec(r.Context(), `INSERT INTO u VALUES (1)`); err != nil {
					w.WriteHeader(409) // already exists: final
					return
				}
				w.WriteHeader(201)
			})))
			srv := httptest.NewServer(mux)
			defer srv.Close()
			var got []int
			for range 3 {
				s, _, _ := pgtest.Send(t, t.Context(), "POST", srv.URL+"/u", `{"a":1}`, "Idempotency-Key", "f1")
				got = append(got, s)
			}
			if got[0] != 409 || got[1] != 409 || got[2] != 409 || runs.Load() != 1 {
				mu.Lock()
				defer mu.Unlock()
				t.Fatalf("statuses %v after %d runs of the handler, want [409 409 409] after 1 (the 409 stored and replayed); log:\n%s", got, runs.Load(), logs.String())
			}
			if n := pgtest.Count(t, pool, `SELECT count(*) FROM u`); n != 1 {
				t.Fatalf("%d rows, want 1", n)
			}
		})
	}
}

type review2Writer struct {
	mu *sync.Mutex
	b  *strings.Builder
}

func (w review2Writer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}
