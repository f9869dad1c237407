package main

import (
	"io"
	"net/http"
	"os"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

func TestParseFlagsRejectsBadValues(t *testing.T) {
	for _, tc := range []struct{ name, value string }{
		{"LISTEN_ADDR", "nonsense"},
		{"IDEM_DATA_PORT", "70000"},
		{"SHUTDOWN_TIMEOUT", "-1s"},
		{"DATABASE_URL", "postgres://%zz"},
	} {
		m := NewMain(io.Discard, io.Discard)
		err := m.ParseFlags(nil, func(k string) string {
			if k == tc.name {
				return tc.value
			}
			return ""
		})
		if err == nil || !strings.Contains(err.Error(), tc.name) {
			t.Errorf("%s=%q: error %v, want one naming %s", tc.name, tc.value, err, tc.name)
		}
	}
	if err := NewMain(io.Discard, io.Discard).ParseFlags([]string{"frobnicate"}, func(string) string { return "" }); err == nil {
		t.Error("an unknown command was accepted")
	}
}

// TestServeHealthz runs the real program: migrate, then serve health and version.
func TestServeHealthz(t *testing.T) {
	s := startServer(t, nil)
	for _, path := range []string{"/healthz", "/version", "/metrics", "/openapi.json"} {
		if r := s.call("GET", path, "", "", ""); r.status != http.StatusOK {
			t.Errorf("GET %s: %d %s", path, r.status, r.body)
		}
	}
	if n := s.count(`SELECT count(*) FROM pg_proc WHERE pronamespace = 'idem'::regnamespace AND proname LIKE 'idem\_%'`); n != 7 {
		t.Fatalf("%d API functions in schema idem, want 7", n)
	}
}
