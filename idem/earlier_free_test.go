package idem_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// earlyHook runs fn once, synchronously, when its connection is about to send sql: a barrier in
// the gap between two statements of the middleware's unit of work.
type earlyHook struct {
	sql  string
	once sync.Once
	fn   func()
}

func (h *earlyHook) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if data.SQL == h.sql {
		h.once.Do(h.fn)
	}
	return ctx
}

func (h *earlyHook) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestEarlierReleaseFallbackNeverClaimsAFreeKey: a text/plain body is hashed as its bytes
// (canon.ComputeRaw); after a mismatch, the middleware asks the key again with the fingerprint
// of the releases before D178 (canon.ComputeBefore178: the canonical JSON form), for a key an
// earlier release stored. When the key became free between the two calls (here the holder of
// the mismatching lease gave it up, held open by a hook at the savepoint), the second call
// claimed the key, on a lease route, under the canonical-JSON fingerprint, for a body whose
// handler reads its bytes; the key then answered any body with that canonical form: a
// text/plain 1.1 after 1.10 replayed 1.10's answer, and so did an application/json 1.1. Only the
// takeover of a lease stored under the earlier fingerprint is claimed now.
//
// docs/http.md, "The fingerprint": "A `text/plain` `1.10` and `1.1` are two requests." and "a
// key first used for a body of another type never answers a JSON body".
func TestEarlierReleaseFallbackNeverClaimsAFreeKey(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	other, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(other.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	const key = "note-1"
	// A: another text/plain note holds the key under a lease (its process works on it).
	first := canon.ComputeRaw("POST", "/notes", []byte("hello"))
	d, err := idem.Begin(ctx, other, idem.Claim{Principal: "alice", Key: key, Action: "POST /notes",
		Fingerprint: first.Sum, Lease: time.Minute})
	if err != nil || d.Outcome != idem.Claimed {
		t.Fatalf("A's claim: %+v %v", d, err)
	}
	// A gives its lease up (its handler failed: idem_yield / idem_release) exactly between B's
	// mismatch and the middleware's second call with the earlier release's fingerprint.
	hook := &earlyHook{sql: "SAVEPOINT idem_earlier_release", fn: func() {
		if ok, err := idem.Release(ctx, other, "alice", key, d.Attempt); err != nil || !ok {
			t.Errorf("A's release: %v %v", ok, err)
		}
	}}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 8
	cfg.ConnConfig.Tracer = hook
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: alice, Logger: auditQuiet})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	mux := http.NewServeMux()
	mux.Handle("POST /notes", m.Route(idem.Route{Required: true, Lease: 10 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		b, _ := io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "stored note %q", b)
	})))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	// B: text/plain 1.10 under the key A holds: a mismatch, then the key is free.
	if st, _, got := pgtest.Send(t, ctx, "POST", srv.URL+"/notes", "1.10", "Idempotency-Key", key, "Content-Type", "text/plain"); st != http.StatusUnprocessableEntity {
		t.Errorf("B (text/plain 1.10) against A's lease, given up after B's mismatch was read: %d %s, want the mismatch", st, got)
	}
	var stored []byte
	if err := other.QueryRow(ctx, `SELECT request_sha256 FROM idem.idempotency_keys WHERE principal_id = 'alice' AND key = $1`, key).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if json := canon.Compute("POST", "/notes", []byte("1.10")).Sum; string(stored) == string(json[:]) {
		t.Errorf("the key's row holds the canonical-JSON fingerprint of 1.10: the fallback for earlier releases claimed a free key under it")
	}
	// C: text/plain 1.1 and D: application/json 1.1, other requests: never 1.10's answer.
	for _, ct := range []string{"text/plain", "application/json"} {
		st, h, got := pgtest.Send(t, ctx, "POST", srv.URL+"/notes", "1.1", "Idempotency-Key", key, "Content-Type", ct)
		if h.Get("Idempotent-Replayed") == "true" || strings.Contains(got, "1.10") {
			t.Errorf("%s 1.1 after text/plain 1.10 under one key: %d %s (Idempotent-Replayed %q): another request's answer", ct, st, got, h.Get("Idempotent-Replayed"))
		}
	}
}
