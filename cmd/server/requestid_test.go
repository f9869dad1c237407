package main

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
)

// TestRequestLogStatus: the request line logs the status that was sent, and 499 for a
// request whose client went away before anything was answered (a duplicate that gave up
// while it waited), never net/http's default 200.
func TestRequestLogStatus(t *testing.T) {
	for _, tc := range []struct {
		name    string
		handler http.HandlerFunc
		gone    bool
		want    float64
	}{
		{"answered", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }, false, 201},
		{"answered, then the client left", func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("ok")) }, true, 200},
		{"nothing written, client present", func(w http.ResponseWriter, r *http.Request) {}, false, 200},
		{"the client left while it waited", func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }, true, 499},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var buf bytes.Buffer
			h := correlate(slog.New(slog.NewJSONHandler(&buf, nil)), tc.handler)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if tc.gone {
				cancel()
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
