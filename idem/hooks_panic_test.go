package idem_test

// The application's hooks that the library calls besides the Logger (D220) and the Observer
// (TestReviewOpsObserverPanicDoesNotKillTheProcess): the TracerProvider's spans and
// LeaseOptions.OnExtend. A hook that panics costs its observation, never an answer, a key's
// release or the process (D221).

import (
	"context"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// panickySpans is a span processor whose OnStart and OnEnd panic while armed: every span the
// middleware starts or ends panics.
type panickySpans struct{ armed atomic.Bool }

func (p *panickySpans) OnStart(context.Context, sdktrace.ReadWriteSpan) {
	if p.armed.Load() {
		panic("the application's tracer panics at a span's start")
	}
}
func (p *panickySpans) OnEnd(sdktrace.ReadOnlySpan) {
	if p.armed.Load() {
		panic("the application's tracer panics at a span's end")
	}
}
func (p *panickySpans) Shutdown(context.Context) error   { return nil }
func (p *panickySpans) ForceFlush(context.Context) error { return nil }

// countingHandler counts the records whose message starts with msg.
type countingHandler struct {
	msg string
	n   *atomic.Int32
}

func (h countingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h countingHandler) Handle(_ context.Context, r slog.Record) error {
	if strings.HasPrefix(r.Message, h.msg) {
		h.n.Add(1)
	}
	return nil
}
func (h countingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h countingHandler) WithGroup(string) slog.Handler      { return h }

// TestHooksPanickingSpans: a TracerProvider whose every span panics at its start and its end.
// docs/http.md: "handler panic | 500 internal_error; its effect rolled back", then the retry
// runs; a completed request replays. The span's end ran inside the middleware's recovery, and
// its panic dropped the client's connection instead of the 500.
func TestHooksPanickingSpans(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	pgtest.Exec(t, pool, `CREATE TABLE hook_effects (id serial PRIMARY KEY)`)
	spans := &panickySpans{}
	spans.armed.Store(true)
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	var logged atomic.Int32
	logger := slog.New(countingHandler{msg: "idem: the TracerProvider's tracer panicked", n: &logged})
	var runs atomic.Int32
	srv, m := prServe(t, idem.Options{DB: pool, TracerProvider: tp, Logger: logger}, idem.Route{Required: true},
		func(w http.ResponseWriter, r *http.Request) {
			if _, err := idem.TxFrom(r.Context()).Exec(r.Context(), `INSERT INTO hook_effects DEFAULT VALUES`); err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
			if runs.Add(1) == 1 {
				panic("handler bug")
			}
			w.WriteHeader(201)
		})
	code1, body1 := prSend(t, srv.URL, "/things", "k-span", `{"a":1}`)
	code2, body2 := prSend(t, srv.URL, "/things", "k-span", `{"a":1}`)
	code3, body3 := prSend(t, srv.URL, "/things", "k-span", `{"a":1}`)
	if code1 != 500 || auditCode(body1) != "internal_error" {
		t.Errorf("a panicking handler (with panicking spans) was answered %d %q; want 500 internal_error", code1, body1)
	}
	if code2 != 201 || code3 != 201 || runs.Load() != 2 {
		t.Errorf("the retry got %d %q and its repeat %d %q (runs %d); want 201 twice from one run after the panic", code2, body2, code3, body3, runs.Load())
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM hook_effects`); n != 1 {
		t.Errorf("effects %d, want 1 (the panicking run rolled back)", n)
	}
	if n := logged.Load(); n != 1 {
		t.Errorf("the tracer's panics were logged %d times; want the first only", n)
	}
	spans.armed.Store(false)
	prSettled(t, pool, m)
}

// TestHooksPanickingOnExtend: LeaseOptions.OnExtend (for metrics) that panics. It runs on the
// heartbeat's goroutine, where the panic ended the process, every request in flight with it;
// the heartbeat now goes on extending the lease. The test runs the heartbeat in a child process
// and fails when the child dies.
func TestHooksPanickingOnExtend(t *testing.T) {
	if url := os.Getenv("HOOKS_ONEXTEND_CHILD_DB"); url != "" {
		ctx := context.Background()
		pool, err := pgxpool.New(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		start := time.Now()
		var attempt int64
		if err := pool.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin('p', 'k', 'a', sha256(''), p_lease => '1 second')`).Scan(&attempt); err != nil {
			t.Fatal(err)
		}
		var calls atomic.Int32
		l := idem.KeepAlive(ctx, pool, "p", "k", attempt, idem.LeaseOptions{Start: start, Lease: time.Second,
			OnExtend: func() { calls.Add(1); panic("the application's OnExtend panics") }})
		time.Sleep(1500 * time.Millisecond) // a third of the lease between beats: four extensions
		lost := l.Stop()
		if n := l.Extensions(); lost || n < 2 || calls.Load() != int32(n) {
			t.Fatalf("after 1.5 s of a 1 s lease: lost %v, %d extensions, OnExtend called %d times; want the lease held, at least 2 extensions, each observed",
				lost, n, calls.Load())
		}
		return
	}
	t.Parallel()
	db := pgtest.NewDB(t)
	cmd := exec.Command(os.Args[0], "-test.run=^TestHooksPanickingOnExtend$", "-test.v")
	cmd.Env = append(os.Environ(), "HOOKS_ONEXTEND_CHILD_DB="+db)
	if out, err := cmd.CombinedOutput(); err != nil {
		s := string(out)
		if i := strings.Index(s, "goroutine "); i > 0 {
			s = s[:i]
		}
		t.Fatalf("the process running the heartbeat: %v\n%s", err, s)
	}
}
