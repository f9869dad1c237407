package idemhttp_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/gorilla/mux"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestAbandonedRecordingDoesNotStarveItsOwnCheck (review finding, D229): when the answer
// deadline comes while a try's outcome is unknown (abandoned, its reply lost), PersistAnswer
// reads once more, a second past the deadline, whether the answer is stored, and an answer
// found counts as stored (D168; docs/http.md: the middleware "sends it as stored"). With the
// second build of D229 that read went through the lease slots, and the abandoned recording kept
// its slot until PostgreSQL answered it, which a black-holed connection never does: with one
// slot (a pool of 2 or 3) the read waited for the slot its own try held, and the client got 503
// outcome_unknown for an answer that was stored. A recording keeps its slot while it may wait
// on a lock (its function's 2 s lock_timeout, plus a second) now. The pool of 4 (two slots) is
// the control.
func TestAbandonedRecordingDoesNotStarveItsOwnCheck(t *testing.T) {
	t.Parallel()
	for _, conns := range []int32{2, 4} {
		t.Run(fmt.Sprintf("pool%d", conns), func(t *testing.T) {
			t.Parallel()
			blackholedRecording(t, conns, 3*time.Second, 0)
		})
	}
}

// TestAbandonedTryDoesNotStarveTheNextTry (review finding, D229): each try of an answer's
// recording gets a third of the time left, at least 7 s; a try cut so is abandoned and the next
// goes on another connection, where PersistAnswer finds an answer that landed (D168). With one
// lease slot (pool of 2) the next try, and then the read past the deadline, waited for the slot
// the abandoned try held: the client waited the whole lease and got 503 outcome_unknown for an
// answer stored at once. The pool of 4 is the control.
func TestAbandonedTryDoesNotStarveTheNextTry(t *testing.T) {
	t.Parallel()
	for _, conns := range []int32{2, 4} {
		t.Run(fmt.Sprintf("pool%d", conns), func(t *testing.T) {
			t.Parallel()
			const lease = 12 * time.Second
			blackholedRecording(t, conns, lease, 9*time.Second)
		})
	}
}

// blackholedRecording runs one lease request on a pool of conns through a proxy that
// black-holes its answer's recording after sending it (it lands; no reply, nothing closed),
// and wants 201 (within within, when set).
func blackholedRecording(t *testing.T, conns int32, lease, within time.Duration) {
	{
		{
			direct, _ := pgtest.NewPool(t, 4)
			proxy := newGapProxy(t, pgtest.TCPAddr(t))
			cfg, err := pgxpool.ParseConfig(pgtest.Via(t, pgtest.URLOf(t, direct), proxy.addr))
			if err != nil {
				t.Fatal(err)
			}
			cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
			cfg.MaxConns = conns
			pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			m, err := idemhttp.New(idemhttp.Options{DB: pool,
				Principal: func(r *http.Request) (string, bool) { return "alice", true },
				Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)), RouteTemplate: muxTemplate})
			if err != nil {
				t.Fatal(err)
			}
			r := mux.NewRouter()
			r.Handle("/jobs", m.Route(idemhttp.Route{Lease: lease, Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusCreated)
				_, _ = io.WriteString(w, `{"done":true}`)
			}))).Methods("POST")
			srv := httptest.NewServer(r)
			t.Cleanup(func() {
				proxy.stop()
				srv.CloseClientConnections()
				srv.Close()
				go pool.Close() // a connection stuck in the black hole would hold Close
			})
			// The recording's statement runs (it lands); its reply never comes, nothing closes.
			complete := proxy.rule("idem_complete", gapBlackhole)
			complete.arm(1)
			began := time.Now()
			status, _, body := pgtest.Send(t, context.Background(), "POST", srv.URL+"/jobs", `{}`, "Idempotency-Key", "black-holed",
				"Content-Type", "application/json")
			took := time.Since(began)
			stored := pgtest.Count(t, direct, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'black-holed' AND state = 'c'`)
			t.Logf("pool %d: %d %s after %v; stored %d", conns, status, body, took.Round(time.Millisecond), stored)
			if stored != 1 {
				t.Fatalf("setup: the black-holed recording did not land (stored %d)", stored)
			}
			if within > 0 && took > within {
				t.Errorf("pool of %d: the reply came after %v, want within %v (an abandoned try, then the next on another connection)",
					conns, took.Round(time.Millisecond), within)
			}
			if status != http.StatusCreated {
				t.Errorf("pool of %d: the answer landed but the client got %d %s after %v; want 201 (D168: a read a second "+
					"past the deadline finds the answer stored; the read waited for the lease slot its own abandoned recording holds)",
					conns, status, body, took.Round(time.Millisecond))
			}
		}
	}
}
