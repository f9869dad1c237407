package idemhttp_test

// Findings of an adversarial review of the transactional route (D151), each a test that
// failed before its fix.

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestKeyWithUnicodeSpaceIsInvalid: a key is 1 to 255 visible ASCII characters; a
// header value that ends in a non-ASCII space (U+00A0, U+0085, U+3000: bytes Go's server
// passes through as obs-text) is malformed and must get 400 idempotency_key_invalid, not be
// taken as another key.
func TestKeyWithUnicodeSpaceIsInvalid(t *testing.T) {
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

// TestDecodeJSONRefusesCaseVariantNames: DecodeJSON, the one strict decoder, refuses
// member names that differ only in case, whatever the target.
func TestDecodeJSONRefusesCaseVariantNames(t *testing.T) {
	t.Parallel()
	req := httptest.NewRequest("POST", "/x", strings.NewReader(`{"amount":1,"Amount":500}`))
	req.Header.Set("Content-Type", "application/json")
	w := httptest.NewRecorder()
	var v map[string]any
	if idemhttp.DecodeJSON(w, req, &v) {
		t.Fatalf("DecodeJSON accepted names that differ only in case: %v", v)
	}
}

// TestFinalAnswerAfterAFailedStatementIsStored: CONTRACT §4, "handler ... 409 ... its
// effect rolled back to a savepoint taken after the claim, the response stored by
// idem_save_final in the same transaction". The classic final error is a 409 answered after an
// INSERT failed on a unique constraint: the transaction is aborted (25P02) until the middleware's
// ROLLBACK TO SAVEPOINT. In pgx's default mode (QueryExecModeCacheStatement, the mode of a pool
// made from a plain URL, and the reference server's without a pooler) the commit batch first
// prepares idem_save_final's statement, on a connection that has not prepared it yet, while the
// transaction is still aborted: "error preprocessing batch (prepare): ... 25P02". The client gets
// 503 store_unavailable, nothing is stored, and every retry runs the handler again (here 3 runs,
// 3 × 503). With QueryExecModeExec the same handler's 409 is stored (the control).
func TestFinalAnswerAfterAFailedStatementIsStored(t *testing.T) {
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
			m, err := idemhttp.New(idemhttp.Options{DB: pool, Logger: slog.New(slog.NewTextHandler(errLogWriter{&mu, &logs}, nil)),
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

type errLogWriter struct {
	mu *sync.Mutex
	b  *strings.Builder
}

func (w errLogWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}
