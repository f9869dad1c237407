package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestBodyReadTimeoutLogs408: a request whose body stops arriving is answered 408 when the
// server's read timeout passes, and the client, still connected, reads that 408; net/http ends
// the request's context at the timeout as it does when a client leaves, and the request line
// logged 499 ("the client went away, nothing was sent"). It now logs the 408 that was sent; a
// client that really left mid-body is still logged 499. D257.
func TestBodyReadTimeoutLogs408(t *testing.T) {
	t.Parallel()
	for _, leave := range []bool{false, true} {
		buf := &lockedWriter{w: &strings.Builder{}}
		log := slog.New(slog.NewJSONHandler(buf, nil))
		handled := make(chan struct{})
		h := correlate(log, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			defer close(handled)
			if _, err := io.ReadAll(r.Body); err != nil {
				w.WriteHeader(http.StatusRequestTimeout) // as the middleware's request_body_incomplete
				return
			}
			w.WriteHeader(http.StatusCreated)
		}))
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: h, ReadTimeout: 500 * time.Millisecond}
		go func() { _ = srv.Serve(ln) }()
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		_, _ = c.Write([]byte("POST /v1/transfers HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\n\r\n{"))
		status := 0
		if leave {
			time.Sleep(100 * time.Millisecond)
			c.Close()
		} else {
			_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				t.Fatalf("the client's answer: %v", err)
			}
			status = resp.StatusCode
			c.Close()
		}
		select {
		case <-handled:
		case <-time.After(10 * time.Second):
			t.Fatal("the handler did not end")
		}
		_ = srv.Close()
		var line map[string]any
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			raw := strings.TrimSpace(buf.String())
			if raw != "" {
				if err := json.Unmarshal([]byte(raw), &line); err != nil {
					t.Fatalf("log line %q: %v", raw, err)
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("no request line was logged")
			}
		}
		want := float64(http.StatusRequestTimeout)
		if leave {
			want = statusClientGone
		} else if status != http.StatusRequestTimeout {
			t.Fatalf("the client read %d, want 408", status)
		}
		if line["status"] != want {
			t.Errorf("client left %v: the request line logged %v, want %v (the client read %d)", leave, line["status"], want, status)
		}
	}
}

// TestServeSaysAPortInUseFirst: serve on a LISTEN_ADDR another program holds failed on it only
// after opening the database (starting and migrating a private cluster, with DATABASE_URL
// unset). It now says so before touching the database: here a DATABASE_URL that nothing
// answers is never reached. D257.
func TestServeSaysAPortInUseFirst(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	m := NewMain(io.Discard, io.Discard)
	env := map[string]string{"DATABASE_URL": "host=127.0.0.1 port=1 user=postgres dbname=none connect_timeout=5",
		"LISTEN_ADDR": ln.Addr().String(), "CLEANUP_INTERVAL": "0"}
	if err := m.ParseFlags(nil, func(k string) string { return env[k] }); err != nil {
		t.Fatal(err)
	}
	err = m.Run(t.Context())
	_ = m.Close()
	if err == nil || !strings.Contains(err.Error(), "LISTEN_ADDR="+ln.Addr().String()) || !strings.Contains(err.Error(), "in use") {
		t.Fatalf("serve on a port in use: %v; want LISTEN_ADDR's error, before the database", err)
	}
}

// TestHealthz503SaysWhenToAskAgain: /healthz's 503 (the database does not answer) carries
// Retry-After, as the API's own 503s do.
func TestHealthz503SaysWhenToAskAgain(t *testing.T) {
	t.Parallel()
	probe, err := pgxpool.New(t.Context(), "host=127.0.0.1 port=1 user=postgres dbname=none connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	defer probe.Close()
	rec := httptest.NewRecorder()
	(&ledger{probe: probe}).healthz(rec, httptest.NewRequest(http.MethodGet, "/healthz", nil))
	if rec.Code != http.StatusServiceUnavailable || rec.Header().Get("Retry-After") != "1" {
		t.Fatalf("/healthz with no database: %d, Retry-After %q; want 503 with Retry-After 1", rec.Code, rec.Header().Get("Retry-After"))
	}
}

// TestExpectContinueRefusedAtOnceThroughTheLog: a request that sends Expect: 100-continue and
// is refused before its body is read (413 by its Content-Length, 400 for a bad key) is answered
// at once, without its body (D184). The request log's body watch, put on net/http's own
// request in the first build of D257, made net/http read the body first, which the client never
// sends before 100 Continue: the answer waited for the server's read timeout. D258.
func TestExpectContinueRefusedAtOnceThroughTheLog(t *testing.T) {
	t.Parallel()
	h := correlate(slog.New(slog.NewJSONHandler(io.Discard, nil)), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusRequestEntityTooLarge) // refused by its Content-Length, unread
	}))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h, ReadTimeout: 3 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	start := time.Now()
	_, _ = c.Write([]byte("POST /v1/transfers HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2000000\r\n\r\n"))
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("the answer: %v", err)
	}
	took := time.Since(start)
	if resp.StatusCode != http.StatusRequestEntityTooLarge || took > time.Second {
		t.Fatalf("an Expect: 100-continue request refused unread: %d after %s; want 413 at once (the read timeout is 3 s)",
			resp.StatusCode, took.Round(time.Millisecond))
	}
}

// TestPoolerCacheFailureIs503: pgx's statement cache through a pooler that keeps no prepared
// statements fails the ledger's own statements with 26000 or 42P05; they were answered 500
// internal_error ("nothing was changed", without Retry-After), where docs/operations.md says
// 503, as the middleware answers the same failure of its own statements. And a payout the
// provider made whose row could not be written no longer says "nothing was changed". D259.
func TestPoolerCacheFailureIs503(t *testing.T) {
	t.Parallel()
	s := &ledger{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	for _, code := range []string{"26000", "42P05"} {
		rec := httptest.NewRecorder()
		err := &pgconn.PgError{Code: code, Message: `prepared statement "stmtcache_0123" does not exist`}
		s.serverError(rec, httptest.NewRequest(http.MethodPost, "/v1/transfers", nil), err)
		if rec.Code != http.StatusServiceUnavailable || rec.Header().Get("Retry-After") != "1" || !strings.Contains(rec.Body.String(), "service_unavailable") {
			t.Errorf("%s from pgx's statement cache: %d, Retry-After %q, %s; want 503 service_unavailable with Retry-After 1",
				code, rec.Code, rec.Header().Get("Retry-After"), rec.Body.String())
		}
	}
	rec := httptest.NewRecorder()
	s.unrecordedPayout(rec, httptest.NewRequest(http.MethodPost, "/v1/payouts", nil), &pgconn.PgError{Code: "23505", Message: "duplicate key"})
	if rec.Code != http.StatusInternalServerError || strings.Contains(rec.Body.String(), "nothing was changed") || !strings.Contains(rec.Body.String(), "provider") {
		t.Errorf("a payout made but not recorded: %d %s; want 500 that says the provider was paid", rec.Code, rec.Body.String())
	}
}

// TestMigrateRefusesANewerLedgerBeforeIdem: docs/sql-api.md: "A database at a later schema
// version than the release is refused before anything is changed". With only the ledger ahead
// (a newer release that added a ledger migration), `server migrate` committed idem's whole
// transaction first (this release's functions over the newer release's) and failed on the
// ledger after, with tern's message. It now refuses first, saying so, and idem is untouched.
// D259.
func TestMigrateRefusesANewerLedgerBeforeIdem(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewEmptyDB(t)
	run := func() error {
		m := NewMain(io.Discard, io.Discard)
		if err := m.ParseFlags([]string{"migrate"}, func(k string) string { return map[string]string{"DATABASE_URL": url}[k] }); err != nil {
			t.Fatal(err)
		}
		err := m.Run(ctx)
		_ = m.Close()
		return err
	}
	if err := run(); err != nil {
		t.Fatal(err)
	}
	conn := pgtest.Connect(t, url)
	pgtest.Exec(t, conn, `UPDATE ledger.schema_version SET version = version + 1`)
	// Stands for the newer release's function bodies.
	pgtest.Exec(t, conn, `COMMENT ON FUNCTION idem.idem_defaults() IS 'the newer release''s'`)
	err := run()
	var comment string
	if qerr := conn.QueryRow(ctx, `SELECT obj_description('idem.idem_defaults()'::regprocedure, 'pg_proc')`).Scan(&comment); qerr != nil {
		t.Fatal(qerr)
	}
	if err == nil || !strings.Contains(err.Error(), "newer than this release's") || !strings.Contains(err.Error(), "nothing was changed") ||
		comment != "the newer release's" {
		t.Fatalf("server migrate over a newer ledger: %v; idem_defaults' comment %q; want refused first, idem untouched", err, comment)
	}
}
