//go:build citus

package idem_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestCitusUnkeyedCommitRefusedOnAWorker: a request without a key on a Citus coordinator whose
// work's deferred foreign key is refused at the worker's one-phase COMMIT: Citus reports it as
// it reports a worker lost while it committed (XX000, D175), so the outcome is unknown. The
// client was told 503 outcome_unknown with Retry-After: 1 and "retry with the same key to get
// its answer", for a request that has no key; before D175, 503 store_unavailable, "nothing was
// changed". It gets 503 outcome_unknown without Retry-After now, and no advice to use a key.
func TestCitusUnkeyedCommitRefusedOnAWorker(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	db := pgtest.CitusDB(t)
	pgtest.CitusInstall(t, db)
	pgtest.CitusDistribute(t, db)
	pool, err := pgxpool.New(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	pgtest.Exec(t, pool, `CREATE TABLE public.parents (principal_id text, id int, PRIMARY KEY (principal_id, id));
		CREATE TABLE public.children (principal_id text, parent int,
			FOREIGN KEY (principal_id, parent) REFERENCES public.parents DEFERRABLE INITIALLY DEFERRED)`)
	pgtest.Exec(t, pool, `SELECT create_distributed_table('public.parents', 'principal_id', colocate_with => 'idem.idempotency_keys')`)
	pgtest.Exec(t, pool, `SELECT create_distributed_table('public.children', 'principal_id', colocate_with => 'idem.idempotency_keys')`)
	m, err := idem.New(ctx, idem.Options{DB: pool,
		Principal: func(*http.Request) (string, bool) { return "alice", true },
		Logger:    slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /children", m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		if _, err := idem.TxFrom(r.Context()).Exec(r.Context(), `INSERT INTO public.children VALUES ('alice', 42)`); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	st, h, body := pgtest.Send(t, ctx, "POST", srv.URL+"/children", `{"parent":42}`, "Content-Type", "application/json")
	if st != http.StatusServiceUnavailable || !strings.Contains(body, idem.CodeOutcomeUnknown) || h.Get("Retry-After") != "" ||
		strings.Contains(body, "same key") || !strings.Contains(body, "no Idempotency-Key") {
		t.Fatalf("a request without a key whose COMMIT a worker refused: %d (Retry-After %q) %s; want 503 %s without Retry-After",
			st, h.Get("Retry-After"), body, idem.CodeOutcomeUnknown)
	}
}
