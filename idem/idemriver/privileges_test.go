package idemriver_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemriver"
	"github.com/pgidem/pgidem/idem/idemtest"
)

// riverGrants is the SQL block of docs/http.md ("River as the service's role") between its
// markers, with its role name.
func riverGrants(t *testing.T) (sql, role string) {
	t.Helper()
	raw, err := os.ReadFile("../../docs/http.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(raw)
	begin := strings.Index(doc, "<!-- river-grants:begin")
	end := strings.Index(doc, "<!-- river-grants:end -->")
	if begin < 0 || end < begin {
		t.Fatal("docs/http.md has no river-grants block")
	}
	block := doc[begin:end]
	open := strings.Index(block, "```sql\n")
	closing := strings.LastIndex(block, "```")
	if open < 0 || closing <= open {
		t.Fatal("the river-grants block holds no sql")
	}
	return block[open+len("```sql\n") : closing], "shop_app"
}

// TestRiverAsTheServicesRole: River migrated by the database's owner, then run, its jobs
// inserted in a route's transaction and worked under idemriver.Work, by a login role that is a
// member of idem_app and has only the grants docs/http.md lists (the example runs everything as
// the owner; a reader of the manual had to guess them). The job runs, once in effect, and
// River's client reports no error of privileges.
func TestRiverAsTheServicesRole(t *testing.T) {
	ctx := context.Background()
	owner := newPool(t) // schema idem and River's tables, as the owner
	grants, role := riverGrants(t)
	app := idemtest.AppPool(t, owner)
	login := app.Config().ConnConfig.User
	if _, err := owner.Exec(ctx, strings.ReplaceAll(grants, role, pgx.Identifier{login}.Sanitize())); err != nil {
		t.Fatalf("the doc's grants: %v", err)
	}
	p := newProvider()
	workers := river.NewWorkers()
	river.AddWorker(workers, river.WorkFunc(func(ctx context.Context, job *river.Job[ReceiptArgs]) error {
		return idemriver.Work(ctx, job.JobRow, idemriver.Options{DB: app}, func(ctx context.Context, claim idem.LeaseClaim) error {
			p.send(claim.ProviderKey)
			return nil
		})
	}))
	var errs strings.Builder
	logs := &lockedBuffer{}
	client, err := river.NewClient(riverpgxv5.New(app), &river.Config{Workers: workers, RetryPolicy: fastRetry{},
		Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn})),
		Queues: map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 2}}, FetchCooldown: 5 * time.Millisecond,
		FetchPollInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := client.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = client.StopAndCancel(ctx)
	}()
	failed, stop := client.Subscribe(river.EventKindJobFailed)
	defer stop()
	var m *idem.Middleware
	m, err = idem.New(ctx, idem.Options{DB: app, Principal: func(*http.Request) (string, bool) { return "alice", true }})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", m.Route(idem.Route{Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := idemriver.Insert(r.Context(), client, ReceiptArgs{Order: 7}, nil); err != nil {
			fmt.Fprint(&errs, err)
			http.Error(w, "try again", http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	for range 2 { // the second is a replay: no second job
		req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(`{}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "order-7")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		if res.StatusCode != 201 {
			t.Fatalf("the order as the service's role: %d (%s)", res.StatusCode, errs.String())
		}
	}
	waitFor(t, owner, `SELECT count(*) FROM river_job WHERE state = 'completed'`)
	select {
	case ev := <-failed:
		t.Fatalf("a job failed as the service's role: %v", ev.Job.Errors)
	case <-time.After(100 * time.Millisecond):
	}
	if n := count(t, owner, `SELECT count(*) FROM river_job`); n != 1 {
		t.Fatalf("%d jobs, want 1", n)
	}
	if effects, _ := p.figures(); effects != 1 {
		t.Fatalf("%d effects, want 1", effects)
	}
	// The leader's maintenance (elected, then its services started) runs as the role too.
	waitFor(t, owner, `SELECT count(*) FROM river_leader`)
	time.Sleep(time.Second)
	if l := logs.String(); strings.Contains(l, "42501") || strings.Contains(l, "permission denied") {
		t.Fatalf("River as the service's role:\n%s", l)
	}
}

// lockedBuffer is a log destination safe for River's goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
