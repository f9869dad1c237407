package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

func TestMain(m *testing.M) {
	code := pgtest.Main(m)
	removeServerBinary()
	os.Exit(code)
}

func TestParseFlagsRejectsBadValues(t *testing.T) {
	for _, tc := range []struct{ name, value string }{
		{"LISTEN_ADDR", "nonsense"},
		{"IDEM_DATA_PORT", "70000"},
		{"SHUTDOWN_TIMEOUT", "-1s"},
		{"DATABASE_URL", "postgres://%zz"},
		{"DATABASE_POOL_SIZE", "1"},
		{"IDEM_APP_ROLE", "Bad-Role"},
		{"IDEMPOTENCY_TTL", "-1h"},
		{"IDEMPOTENCY_TTL", "soon"},
		{"IDEMPOTENCY_TTL", "87000h"}, // over interval '10 years' (86400h), under 365-day years
		{"IDEMPOTENCY_LOCK_TIMEOUT", "720h"},
		{"IDEMPOTENCY_LOCK_TIMEOUT", "0"},
		{"IDEMPOTENCY_WORK_TIMEOUT", "-1s"},
		{"IDEMPOTENCY_DUPLICATE_WAIT", "11m"},
		{"IDEMPOTENCY_DUPLICATE_WAIT", "soon"},
		{"IDEMPOTENCY_MAX_WAITING_CLAIMS", "0"},
		{"MAX_BODY_BYTES", "0"},
		{"MAX_STORED_RESPONSE_BYTES", "-1"},
		{"CLEANUP_INTERVAL", "10ms"},
		{"CLEANUP_BATCH_SIZE", "0"},
		{"CLEANUP_VACUUM", "sometimes"},
		{"CLEANUP_DUTY", "0"},
		{"CLEANUP_DUTY", "1.5"},
		{"CLEANUP_DUTY", "1e-12"},
		{"CLEANUP_DUTY", "NaN"},
		{"IDEMPOTENCY_MAX_WAITING_CLAIMS", "10000"},
		{"TRANSFERS_REQUIRE_KEY", "maybe"},
		{"RECEIPT_URL", "ftp://example.com/r"},
		{"RECEIPT_URL", "receipts"},
		{"RECEIPT_LEASE", "10ms"},
		{"RECEIPT_RESCUE_AFTER", "10s"}, // not more than RECEIPT_TIMEOUT's 30s
		{"LOG_LEVEL", "loud"},
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
	// Wait slots that do not fit the default pool: the error says what the default is and
	// what to set (a configuration from a larger machine, or from before the default changed).
	env := map[string]string{"IDEMPOTENCY_MAX_WAITING_CLAIMS": "5000"}
	err := NewMain(io.Discard, io.Discard).ParseFlags(nil, func(k string) string { return env[k] })
	if err == nil || !strings.Contains(err.Error(), "default") || !strings.Contains(err.Error(), "set DATABASE_POOL_SIZE above 5000") {
		t.Errorf("wait slots over the default pool: %v, want an error that names the default and the fix", err)
	}
	env["DATABASE_POOL_SIZE"] = "5000"
	err = NewMain(io.Discard, io.Discard).ParseFlags(nil, func(k string) string { return env[k] })
	if err == nil || !strings.Contains(err.Error(), "smaller than DATABASE_POOL_SIZE (5000)") {
		t.Errorf("wait slots equal to the pool: %v", err)
	}
	env["DATABASE_POOL_SIZE"] = "5001"
	if err := NewMain(io.Discard, io.Discard).ParseFlags(nil, func(k string) string { return env[k] }); err != nil {
		t.Errorf("wait slots one below the pool: %v", err)
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
	if r := s.call("HEAD", "/healthz", "", "", ""); r.status != http.StatusOK || r.body != "" {
		t.Errorf("HEAD /healthz: %d %q, want 200 without a body", r.status, r.body)
	}
	var granted int
	if err := s.pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_proc
		WHERE pronamespace = 'idem'::regnamespace AND has_function_privilege('idem_app', oid, 'EXECUTE')`).Scan(&granted); err != nil || granted != 20 {
		t.Fatalf("%d functions of schema idem granted to idem_app, want the 20 of the API (%v)", granted, err)
	}
}

// TestConfigDefaultsAndEveryVariable: with no environment every field has its documented
// default (a zero TTL and lock timeout mean the SQL API's own), and every variable is read.
func TestConfigDefaultsAndEveryVariable(t *testing.T) {
	m := NewMain(io.Discard, io.Discard)
	if err := m.ParseFlags(nil, func(string) string { return "" }); err != nil {
		t.Fatal(err)
	}
	want := Config{PoolSize: DefaultPoolSize(), ListenAddr: "127.0.0.1:8080", DataDir: ".data", DataPort: 54329, AppRole: "idem_app",
		MaxBodyBytes: 1 << 20, MaxStoredBytes: 256 << 10, CleanupInterval: time.Minute, CleanupVacuum: true,
		ShutdownTimeout: 10 * time.Second, TransfersRequireKey: true, LogLevel: slog.LevelInfo,
		PayoutsLease: 5 * time.Second, PayoutProviderDelay: 200 * time.Millisecond, CleanupDuty: 0.4,
		ReceiptLease: 10 * time.Second, ReceiptTimeout: 30 * time.Second, ReceiptRescueAfter: time.Hour}
	if m.Config != want {
		t.Fatalf("defaults:\n got %+v\nwant %+v", m.Config, want)
	}
	env := map[string]string{
		"DATABASE_URL": "postgres://u@h:5/d", "DATABASE_POOL_SIZE": "9", "LISTEN_ADDR": "0.0.0.0:9",
		"IDEM_DATA_DIR": "/x", "IDEM_DATA_PORT": "7", "IDEM_APP_ROLE": "app_x", "IDEMPOTENCY_TTL": "1h",
		"IDEMPOTENCY_LOCK_TIMEOUT": "250ms", "IDEMPOTENCY_MAX_WAITING_CLAIMS": "3", "IDEMPOTENCY_MAX_WAITING_BYTES": "5000", "MAX_BODY_BYTES": "100",
		"MAX_STORED_RESPONSE_BYTES": "50", "CLEANUP_INTERVAL": "0", "CLEANUP_BATCH_SIZE": "7", "CLEANUP_VACUUM": "false", "SHUTDOWN_TIMEOUT": "3s",
		"TRANSFERS_REQUIRE_KEY": "false", "LOG_LEVEL": "debug", "PAYOUTS_LEASE": "2s", "PAYOUT_PROVIDER_DELAY": "0", "CLEANUP_DUTY": "0.5",
		"RECEIPT_URL": "http://127.0.0.1:9/receipts", "RECEIPT_LEASE": "3s", "RECEIPT_TIMEOUT": "4s", "RECEIPT_RESCUE_AFTER": "5s",
		"PAYOUT_STEP_PAUSE": "250ms",
	}
	if err := m.ParseFlags(nil, func(k string) string { return env[k] }); err != nil {
		t.Fatal(err)
	}
	want = Config{DatabaseURL: "postgres://u@h:5/d", PoolSize: 9, ListenAddr: "0.0.0.0:9", DataDir: "/x", DataPort: 7,
		AppRole: "app_x", TTL: time.Hour, LockTimeout: 250 * time.Millisecond, MaxWaitingClaims: 3, MaxWaitingBytes: 5000, MaxBodyBytes: 100,
		MaxStoredBytes: 50, CleanupInterval: 0, CleanupBatchSize: 7, CleanupVacuum: false, ShutdownTimeout: 3 * time.Second,
		TransfersRequireKey: false, LogLevel: slog.LevelDebug, PayoutsLease: 2 * time.Second, CleanupDuty: 0.5,
		ReceiptURL: "http://127.0.0.1:9/receipts", ReceiptLease: 3 * time.Second, ReceiptTimeout: 4 * time.Second, ReceiptRescueAfter: 5 * time.Second,
		PayoutStepPause: 250 * time.Millisecond}
	if m.Config != want {
		t.Fatalf("every variable:\n got %+v\nwant %+v", m.Config, want)
	}
	ops, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	for name := range env {
		if !strings.Contains(usage, name) {
			t.Errorf("the usage text does not list %s", name)
		}
		if !strings.Contains(string(ops), "| `"+name+"` |") {
			t.Errorf("docs/operations.md's configuration table does not list %s", name)
		}
	}
}

// TestHelp: help, -h and --help print the usage (every variable) and succeed.
func TestHelp(t *testing.T) {
	for _, arg := range []string{"help", "-h", "--help"} {
		var out strings.Builder
		m := NewMain(&out, io.Discard)
		if err := m.ParseFlags([]string{arg}, func(string) string { return "" }); err != nil {
			t.Fatalf("%s: %v", arg, err)
		}
		if err := m.Run(context.Background()); err != nil || !strings.Contains(out.String(), "IDEMPOTENCY_LOCK_TIMEOUT") {
			t.Fatalf("%s: %v\n%s", arg, err, out.String())
		}
	}
}

// TestHelpStatesTheSQLDefaults: the defaults that `server help` names for the variables left
// to the SQL API are the ones the functions of a migrated database use.
func TestHelpStatesTheSQLDefaults(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	conn := pgtest.Connect(t, pgtest.NewDB(t))
	d, err := idem.ReadDefaults(ctx, conn)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	m := NewMain(&out, io.Discard)
	if err := m.ParseFlags([]string{"help"}, func(string) string { return "" }); err != nil {
		t.Fatal(err)
	}
	if err := m.Run(ctx); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]string{
		"IDEMPOTENCY_TTL":          shortDuration(d.TTL),
		"IDEMPOTENCY_LOCK_TIMEOUT": shortDuration(d.LockTimeout),
		"CLEANUP_BATCH_SIZE":       fmt.Sprint(d.BatchSize),
	} {
		line := regexp.MustCompile(`(?m)^  ` + name + ` .*\(the SQL default, ([^)]+)\)$`).FindStringSubmatch(out.String())
		if line == nil || line[1] != want {
			t.Errorf("%s: help says %v, the SQL default is %s\n%s", name, line, want, out.String())
		}
	}
}

// shortDuration writes 24h0m0s as 24h and 2s as 2s.
func shortDuration(d time.Duration) string {
	s := d.String()
	for _, z := range []string{"0s", "0m"} {
		if strings.HasSuffix(s, z) && len(s) > len(z) {
			s = strings.TrimSuffix(s, z)
		}
	}
	return s
}

// TestHelpAfterACommand (review finding): `server principal create --help` created a
// principal named --help and printed its token. -h, -help and --help after any command ask
// for the help; a principal's name may not start with -.
func TestHelpAfterACommand(t *testing.T) {
	for _, args := range [][]string{{"principal", "create", "--help"}, {"principal", "create", "-h"}, {"migrate", "-h"},
		{"keys", "--help"}, {"serve", "-help"}} {
		m := NewMain(io.Discard, io.Discard)
		if err := m.ParseFlags(args, func(string) string { return "" }); err != nil || m.Command != "help" {
			t.Errorf("%q: command %q, %v; want the help", args, m.Command, err)
		}
	}
	m := NewMain(io.Discard, io.Discard)
	if err := m.ParseFlags([]string{"principal", "create", "-x"}, func(string) string { return "" }); err == nil {
		t.Error("principal create -x: accepted as a name")
	}
	// A key may be "-h": where a key is a value, it is one.
	for _, args := range [][]string{{"keys", "alice", "-h"}, {"keys", "release", "alice", "k", "5", "--help"}} {
		m := NewMain(io.Discard, io.Discard)
		if err := m.ParseFlags(args, func(string) string { return "" }); err != nil || m.Command != "keys" {
			t.Errorf("%q: command %q, %v; want the keys command with the value", args, m.Command, err)
		}
	}
}
