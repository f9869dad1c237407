package main

import (
	"context"
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
	url := pgtest.NewEmptyDB(t)
	env := map[string]string{"DATABASE_URL": url, "LISTEN_ADDR": "127.0.0.1:0"}
	getenv := func(k string) string { return env[k] }

	mig := NewMain(io.Discard, io.Discard)
	if err := mig.ParseFlags([]string{"migrate"}, getenv); err != nil {
		t.Fatal(err)
	}
	if err := mig.Run(context.Background()); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	_ = mig.Close()
	var n int
	if err := pgtest.Connect(t, url).QueryRow(context.Background(),
		`SELECT count(*) FROM pg_proc WHERE pronamespace = 'idem'::regnamespace`).Scan(&n); err != nil || n != 5 {
		t.Fatalf("after migrate: %d functions in schema idem (%v), want 5", n, err)
	}

	m := NewMain(io.Discard, io.Discard)
	if err := m.ParseFlags(nil, getenv); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	addr := <-m.Addr
	for _, path := range []string{"/healthz", "/version"} {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Errorf("GET %s: %d %s", path, resp.StatusCode, body)
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("serve: %v", err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
}
