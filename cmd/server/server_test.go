package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// testServer is the real program serving on a free port against a fresh database.
type testServer struct {
	t    testing.TB
	url  string
	db   string
	pool *pgxpool.Pool
	main *Main
	// shutdown cancels the server's context and returns what Run returned; once.
	shutdown func() error
}

func startServer(t testing.TB, env map[string]string) *testServer {
	t.Helper()
	return serveOn(t, migratedDB(t, env), env)
}

// migratedDB is a fresh database that the server's migrate (with env) has migrated.
func migratedDB(t testing.TB, env map[string]string) string {
	t.Helper()
	db := pgtest.NewEmptyDB(t)
	mig := NewMain(io.Discard, io.Discard)
	if err := mig.ParseFlags([]string{"migrate"}, serverEnv(db, env)); err != nil {
		t.Fatal(err)
	}
	if err := mig.Run(context.Background()); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	_ = mig.Close()
	return db
}

// serverEnv is the environment of a test server on db: a free port, no scheduled cleanup,
// and env on top.
func serverEnv(db string, env map[string]string) func(string) string {
	vars := map[string]string{"DATABASE_URL": db, "LISTEN_ADDR": "127.0.0.1:0", "CLEANUP_INTERVAL": "0"}
	for k, v := range env {
		vars[k] = v
	}
	return func(k string) string { return vars[k] }
}

// serveOn starts the real program serving the (migrated) database db: a second process of
// the same service when db is another test server's.
func serveOn(t testing.TB, db string, env map[string]string) *testServer {
	t.Helper()
	return serveWith(t, db, db, env, io.Discard)
}

// serveWith is serveOn with the server's log written to log, and the test's own pool
// (principals, counts) on poolURL.
func serveWith(t testing.TB, db, poolURL string, env map[string]string, log io.Writer) *testServer {
	t.Helper()
	m := NewMain(io.Discard, log)
	if err := m.ParseFlags(nil, serverEnv(db, env)); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	var addr string
	select {
	case addr = <-m.Addr:
	case err := <-done:
		cancel()
		t.Fatalf("serve: %v\n%s", err, log)
	}
	var once sync.Once
	var runErr error
	shutdown := func() error {
		once.Do(func() {
			cancel()
			runErr = <-done
			_ = m.Close()
		})
		return runErr
	}
	t.Cleanup(func() {
		if err := shutdown(); err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	pool, err := pgxpool.New(context.Background(), poolURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return &testServer{t: t, url: "http://" + addr, db: db, pool: pool, main: m, shutdown: shutdown}
}

func (s *testServer) principal(name string) (id, token string) {
	s.t.Helper()
	id, token, err := createPrincipal(context.Background(), s.pool, name)
	if err != nil {
		s.t.Fatal(err)
	}
	return id, token
}

type resp struct {
	status int
	header http.Header
	body   string
}

func (r resp) json(t *testing.T) map[string]any {
	t.Helper()
	var v map[string]any
	if err := json.Unmarshal([]byte(r.body), &v); err != nil {
		t.Fatalf("not JSON: %d %q", r.status, r.body)
	}
	return v
}

func (s *testServer) call(method, path, token, key, body string, headers ...string) resp {
	s.t.Helper()
	auth := ""
	if token != "" {
		auth = "Bearer " + token
	}
	status, header, b := pgtest.Send(s.t, context.Background(), method, s.url+path, body,
		append([]string{"Authorization", auth, "Idempotency-Key", key}, headers...)...)
	return resp{status, header, b}
}

func (s *testServer) count(sql string, args ...any) int {
	s.t.Helper()
	return pgtest.Count(s.t, s.pool, sql, args...)
}

func sleepBriefly() { time.Sleep(25 * time.Millisecond) }

// TestGracefulShutdown: a request in flight when the shutdown starts still finishes and
// commits; new connections are refused; Run returns without error.
func TestGracefulShutdown(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("g")
	id := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))

	// Hold the account's row so that the deposit waits inside its handler.
	ctx := context.Background()
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Exec(ctx, `SELECT 1 FROM ledger.accounts WHERE id = $1 FOR UPDATE`, id); err != nil {
		t.Fatal(err)
	}
	inflight := make(chan resp, 1)
	go func() {
		inflight <- s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "dep-1", `{"amount":5}`)
	}()
	for i := 0; i < 500 && s.count(`SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()`) == 0; i++ {
		time.Sleep(10 * time.Millisecond)
	}
	stopped := make(chan error, 1)
	go func() { stopped <- s.shutdown() }()
	for i := 0; i < 200; i++ { // the listener closes first
		if _, err := http.Get(s.url + "/healthz"); err != nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := http.Get(s.url + "/healthz"); err == nil {
		t.Fatal("the server still accepts connections while shutting down")
	}
	_ = holder.Rollback(ctx)
	if r := <-inflight; r.status != 201 {
		t.Fatalf("the in-flight deposit: %+v", r)
	}
	if err := <-stopped; err != nil {
		t.Fatalf("shutdown: %v", err)
	}
	if n := s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, id); n != 5 {
		t.Fatalf("balance %d, want 5: the in-flight deposit did not commit", n)
	}
	if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = 'dep-1' AND state = 'c'`); n != 1 {
		t.Fatal("the in-flight deposit's key was not stored")
	}
}
