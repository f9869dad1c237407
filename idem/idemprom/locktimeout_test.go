package idemprom_test

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemprom"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestStatementLockTimeoutIsTheWorksToo: the same wait on the same row, met by one of the
// handler's statements instead of its COMMIT's deferred check, ran the unit 3 times too and was
// then answered as the store's failure, counted store_error (IdemStoreErrors fired, the
// database fine). Both are the work's own lock timeouts now, answered and counted alike.
func TestStatementLockTimeoutIsTheWorksToo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := parentAndChildren(t)
	type result struct {
		st       int
		retry    string
		body     string
		runs     int32
		acq, err float64
	}
	run := func(name string, handler func(r *http.Request) error) result {
		reg := prometheus.NewRegistry()
		m, err := idem.New(ctx, idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true },
			Metrics: idemprom.NewObserver(reg), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		if err != nil {
			t.Fatal(err)
		}
		var runs atomic.Int32
		srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /" + name})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			if _, err := idem.TxFrom(r.Context()).Exec(r.Context(), `SET LOCAL lock_timeout = '100ms'`); err != nil {
				t.Errorf("set: %v", err)
			}
			if err := handler(r); err != nil {
				// What a handler does with a failed statement: a 500 (the unit runs again all the same).
				w.WriteHeader(http.StatusInternalServerError)
				return
			}
			w.WriteHeader(http.StatusCreated)
		})))
		defer srv.Close()
		defer holdRow(t, url, `SELECT * FROM parents WHERE id = 1 FOR UPDATE`)()
		st, hdr, body := pgtest.Send(t, ctx, "POST", srv.URL+"/"+name, `{"n":1}`, "Idempotency-Key", name)
		return result{st, hdr.Get("Retry-After"), body, runs.Load(),
			value(t, reg, "idempotency_requests_total", "state", "acquired"),
			value(t, reg, "idempotency_requests_total", "state", "store_error")}
	}
	commit := run("commit", func(r *http.Request) error {
		_, err := idem.TxFrom(r.Context()).Exec(r.Context(), `INSERT INTO children (parent) VALUES (1)`)
		return err
	})
	stmt := run("statement", func(r *http.Request) error {
		_, err := idem.TxFrom(r.Context()).Exec(r.Context(), `SELECT * FROM parents WHERE id = 1 FOR UPDATE`)
		return err
	})
	t.Logf("COMMIT's lock timeout:    %d Retry-After %q runs %d acquired %v store_error %v %s", commit.st, commit.retry, commit.runs, commit.acq, commit.err, commit.body)
	t.Logf("statement's lock timeout: %d Retry-After %q runs %d acquired %v store_error %v %s", stmt.st, stmt.retry, stmt.runs, stmt.acq, stmt.err, stmt.body)
	if stmt.err != 0 || stmt.err != commit.err || stmt.st != commit.st || stmt.retry != commit.retry {
		t.Fatalf("the work's lock timeout on one row, at a statement vs at COMMIT: %d/%q counted store_error %v vs %d/%q counted "+
			"store_error %v; D186 answers the COMMIT's \"as a statement's lock timeout\", \"the store did not fail\"",
			stmt.st, stmt.retry, stmt.err, commit.st, commit.retry, commit.err)
	}
}

// TestRequestWithoutAKeyIsNotToldOfOne: a declared route's request without a key whose work
// failed was told to "retry with the same key": it sent none.
func TestRequestWithoutAKeyIsNotToldOfOne(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := parentAndChildren(t)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true },
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /u"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		tx := idem.TxFrom(r.Context())
		if tx == nil {
			t.Errorf("no transaction on a declared route without a key")
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		_, _ = tx.Exec(r.Context(), `SET LOCAL lock_timeout = '100ms'`)
		_, _ = tx.Exec(r.Context(), `INSERT INTO children (parent) VALUES (1)`)
		w.WriteHeader(http.StatusCreated)
	})))
	defer srv.Close()
	defer holdRow(t, url, `SELECT * FROM parents WHERE id = 1 FOR UPDATE`)()
	st, hdr, body := pgtest.Send(t, ctx, "POST", srv.URL+"/u", `{"n":1}`)
	t.Logf("no key: %d Retry-After %q runs %d: %s", st, hdr.Get("Retry-After"), runs.Load(), body)
	if st != http.StatusServiceUnavailable || strings.Contains(body, "same key") {
		t.Fatalf("a request sent without a key is told to %q: %s", "retry with the same key", body)
	}
}

// TestLeaseClaimCommitLockTimeoutIsABusyStore: an application's deferred foreign key on the
// key table (docs/ledger.md's pattern, made DEFERRABLE) is checked at a lease claim's own
// COMMIT; with the principal's row held and a role's lock_timeout, that COMMIT meets 55P03. It
// was taken for a key in progress, so the middleware claimed again and again (99 claims counted
// acquired in 11 s), and then, with the first mend, for the work's (no work ran). It is read as
// a claim's INSERT that meets such a lock is (D151): a busy store, 503 at once.
func TestLeaseClaimCommitLockTimeoutIsABusyStore(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin, url := pgtest.NewPool(t, 2)
	pgtest.Exec(t, admin, `CREATE TABLE app_principals (id text PRIMARY KEY)`)
	pgtest.Exec(t, admin, `INSERT INTO app_principals VALUES ('alice')`)
	pgtest.Exec(t, admin, `ALTER TABLE idem.idempotency_keys ADD CONSTRAINT app_principal_fkey
		FOREIGN KEY (principal_id) REFERENCES app_principals (id) DEFERRABLE INITIALLY DEFERRED NOT VALID`)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 8
	cfg.ConnConfig.RuntimeParams["lock_timeout"] = "100ms" // the role's guard rail
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	reg := prometheus.NewRegistry()
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true },
		Metrics: idemprom.NewObserver(reg), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /l", Lease: 2 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	})))
	defer srv.Close()
	defer holdRow(t, url, `SELECT * FROM app_principals WHERE id = 'alice' FOR UPDATE`)()
	st, hdr, body := pgtest.Send(t, ctx, "POST", srv.URL+"/l", `{"n":1}`, "Idempotency-Key", "lease-fk")
	acq := value(t, reg, "idempotency_requests_total", "state", "acquired")
	storeErr := value(t, reg, "idempotency_requests_total", "state", "store_error")
	t.Logf("lease claim: %d Retry-After %q handler runs %d acquired %v store_error %v: %s", st, hdr.Get("Retry-After"), runs.Load(), acq, storeErr, body)
	if st != http.StatusServiceUnavailable || hdr.Get("Retry-After") == "" || !strings.Contains(body, "locked") ||
		runs.Load() != 0 || acq != 1 || storeErr != 1 {
		t.Fatalf("a lease claim whose own COMMIT met a lock timeout (no work ran): %d %s after %d handler runs, "+
			"counted acquired %v store_error %v; want 503 for a busy store, one claim counted", st, body, runs.Load(), acq, storeErr)
	}
}

// TestNoKeyIsNotToldOfOneElsewhere: the first mend of "retry with the same key" for a request
// without a key covered the store's failures only; the same request was told of a key it never
// sent when its handler panicked and when its body was cut short.
func TestNoKeyIsNotToldOfOneElsewhere(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true },
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /p"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = idem.TxFrom(r.Context()).Exec(r.Context(), `SELECT 1`)
		panic("boom")
	})))
	defer srv.Close()
	st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/p", `{"n":1}`)
	t.Logf("panic, no key: %d %s", st, body)
	if st != http.StatusInternalServerError || strings.Contains(body, "same key") {
		t.Errorf("a request sent without a key whose handler panicked: %d %s", st, body)
	}

	// A body cut short: Content-Length 100, 10 bytes sent, the write side closed.
	c, err := net.Dial("tcp", strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, _ = io.WriteString(c, "POST /p HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"n\":1,   ")
	_ = c.(*net.TCPConn).CloseWrite()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("read: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	t.Logf("cut body, no key: %d %s", resp.StatusCode, b)
	if resp.StatusCode != http.StatusRequestTimeout || strings.Contains(string(b), "same key") {
		t.Errorf("a request sent without a key whose body was cut short: %d %s", resp.StatusCode, b)
	}
}

// parentAndChildren is a pool on a fresh database with a table of parents (one row, id 1) and
// one of children whose foreign key to them is checked at COMMIT (deferred).
func parentAndChildren(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	pool, url := pgtest.NewPool(t, 8)
	pgtest.Exec(t, pool, `CREATE TABLE parents (id int PRIMARY KEY)`)
	pgtest.Exec(t, pool, `CREATE TABLE children (id serial PRIMARY KEY,
		parent int REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED)`)
	pgtest.Exec(t, pool, `INSERT INTO parents VALUES (1)`)
	return pool, url
}

// holdRow runs lock (a SELECT ... FOR UPDATE) in a transaction of another session of url, and
// returns the function that ends it.
func holdRow(t *testing.T, url, lock string) (release func()) {
	t.Helper()
	ctx := context.Background()
	tx, err := pgtest.Connect(t, url).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, lock); err != nil {
		t.Fatal(err)
	}
	return func() { _ = tx.Rollback(ctx) }
}
