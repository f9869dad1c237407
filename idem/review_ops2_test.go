package idem_test

// Adversarial review (operations, round 2): an Observer that panics.

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// panicky is an Observer whose LeaseExtended panics (a bug in an application's metrics: a
// label it builds from the action, a nil map).
type panicky struct{ recorder }

func (*panicky) LeaseExtended(string) { panic("observer bug in LeaseExtended") }

// TestReviewOpsObserverPanicDoesNotKillTheProcess: a handler's panic is answered 500 and
// nothing is kept (CONTRACT §4); a panic of the Observer in Count or Done, on the request's
// goroutine, is recovered by net/http (the connection is cut). But LeaseExtended runs on the
// lease's heartbeat goroutine (dbidem.KeepAlive's beat, OnExtend), where nothing recovers:
// one panic there ends the whole process, with every request in flight. The Observer's
// documentation says only that it must not block. The test runs the server in a child
// process and fails when the child dies.
func TestReviewOpsObserverPanicDoesNotKillTheProcess(t *testing.T) {
	if url := os.Getenv("ZZ_OPS2_CHILD_DB"); url != "" {
		ctx := context.Background()
		pool, err := pgxpool.New(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		m, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice, Metrics: &panicky{}})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /pay", Lease: time.Second})(http.HandlerFunc(
			func(w http.ResponseWriter, r *http.Request) {
				time.Sleep(1500 * time.Millisecond) // the heartbeat extends the lease every third of it
				w.WriteHeader(201)
			})))
		defer srv.Close()
		st, _, body := pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", "k1")
		t.Logf("answer %d %s", st, body)
		return
	}
	t.Parallel()
	db := pgtest.NewDB(t)
	cmd := exec.Command(os.Args[0], "-test.run=^TestReviewOpsObserverPanicDoesNotKillTheProcess$", "-test.v")
	cmd.Env = append(os.Environ(), "ZZ_OPS2_CHILD_DB="+db)
	out, err := cmd.CombinedOutput()
	if err != nil {
		s := string(out)
		if i := strings.Index(s, "goroutine "); i > 0 {
			s = s[:i]
		}
		t.Fatalf("the process running the middleware died: %v\n%s", err, s)
	}
}
