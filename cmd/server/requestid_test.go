package main

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestRequestLogStatus: the request line logs the status that was sent, and 499 for a
// request whose client went away before anything was answered (a duplicate that gave up
// while it waited), never net/http's default 200, nor the 409 the middleware writes to a
// duplicate whose client is gone. An outer deadline ends the request's context with the client
// still there: what was written is logged.
func TestRequestLogStatus(t *testing.T) {
	for _, tc := range []struct {
		name    string
		handler func(leave func()) http.HandlerFunc
		gone    bool // the client left before the handler ran
		timeout bool // an outer deadline ended the request's context before the handler ran
		want    float64
	}{
		{"answered", func(func()) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }
		}, false, false, 201},
		{"answered, then the client left", func(leave func()) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("ok")); leave() }
		}, false, false, 200},
		{"nothing written, client present", func(func()) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) {}
		}, false, false, 200},
		{"the client left while it waited", func(func()) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }
		}, true, false, 499},
		{"the client left, then 409 was written to it", func(func()) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done(); w.WriteHeader(http.StatusConflict) }
		}, true, false, 499},
		{"an outer deadline passed, then 409 was written", func(func()) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done(); w.WriteHeader(http.StatusConflict) }
		}, false, true, 409},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var buf bytes.Buffer
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			h := correlate(slog.New(slog.NewJSONHandler(&buf, nil)), tc.handler(cancel))
			if tc.gone {
				cancel()
			}
			if tc.timeout {
				var stop context.CancelFunc
				ctx, stop = context.WithTimeout(ctx, 0)
				defer stop()
			}
			h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("POST", "/v1/transfers", nil).WithContext(ctx))
			var line map[string]any
			if err := json.Unmarshal(buf.Bytes(), &line); err != nil {
				t.Fatalf("log line %q: %v", buf.String(), err)
			}
			if line["status"] != tc.want {
				t.Fatalf("logged status %v, want %v", line["status"], tc.want)
			}
		})
	}
}

// TestDuplicateWhoseClientLeftLogs499: since D183 the middleware writes 409 to a duplicate whose
// request context ended while it waited (an outer deadline's client is still there), and the
// request line logged that 409 for a client that had disconnected: the operator could not
// tell clients that gave up from clients told "in progress". Through the middleware, on a
// database: the first request holds the key, its duplicate's client disconnects.
func TestDuplicateWhoseClientLeftLogs499(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	logs := &logBuffer{}
	log := slog.New(slog.NewJSONHandler(logs, nil))
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true },
		Logger: log, DuplicateWait: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	h := correlate(log, m.Route(idem.Route{Action: "POST /v1/transfers"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case started <- struct{}{}:
		default:
		}
		<-release
		w.WriteHeader(http.StatusCreated)
	})))
	send := func(ctx context.Context, id string) int {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest("POST", "/v1/transfers", strings.NewReader(`{}`)).WithContext(ctx)
		req.Header.Set("Idempotency-Key", "gone-1")
		req.Header.Set("X-Request-Id", id)
		h.ServeHTTP(rec, req)
		return rec.Code
	}
	first := make(chan int, 1)
	go func() { first <- send(context.Background(), "first") }()
	<-started
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	time.AfterFunc(300*time.Millisecond, cancel) // the duplicate's client disconnects while it waits
	if code := send(ctx, "duplicate"); code != http.StatusConflict {
		t.Fatalf("the duplicate was written %d, want 409 (to a client that is gone)", code)
	}
	close(release)
	if c := <-first; c != http.StatusCreated {
		t.Fatalf("the first request: %d", c)
	}
	var status any
	for _, s := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		var line map[string]any
		if err := json.Unmarshal([]byte(s), &line); err != nil {
			t.Fatalf("log line %q: %v", s, err)
		}
		if line["msg"] == "request" && line["request_id"] == "duplicate" {
			status = line["status"]
		}
	}
	if status != float64(statusClientGone) {
		t.Fatalf("the duplicate whose client left is logged with status %v, want %d; the log:\n%s", status, statusClientGone, logs.String())
	}
}
