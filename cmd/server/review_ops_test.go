package main

// Findings of an adversarial review of the reference server's operations, each a test that
// failed before its fix.

import (
	"bytes"
	"context"
	"io"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestCleanupCommandWaitsForTheLock: `server cleanup` is one full pass. When another
// process's batch holds the cleanup lock (a running server's scheduled cleaner, or an operator
// pausing the cleaners), the command's batches wait for it and then delete every expired key.
// Before, the pass was skipped, and the command printed "deleted 0 expired keys" and exited 0
// with every expired key still there.
func TestCleanupCommandWaitsForTheLock(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	ctx := context.Background()
	id, _ := s.principal("expired")
	pgtest.InsertExpired(t, s.pool, id, 50)
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	// docs/operations.md's statement that pauses every cleaner, with its decimal literal.
	if _, err := holder.Exec(ctx, `SELECT pg_advisory_xact_lock(29665259344325742)`); err != nil {
		t.Fatal(err)
	}
	if strconv.FormatInt(idem.CleanupLock, 10) != "29665259344325742" {
		t.Fatalf("idem.CleanupLock is %d, docs/operations.md says 29665259344325742", idem.CleanupLock)
	}
	const hold = 400 * time.Millisecond
	go func() {
		time.Sleep(hold)
		_ = holder.Rollback(ctx)
	}()
	var out bytes.Buffer
	c := NewMain(&out, io.Discard)
	if err := c.ParseFlags([]string{"cleanup"}, serverEnv(s.db, nil)); err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	err = c.Run(ctx)
	took := time.Since(began)
	_ = c.Close()
	left := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = $1`, id)
	if err != nil || left != 0 || !strings.HasPrefix(out.String(), "deleted 50 expired keys") {
		t.Fatalf("server cleanup while the lock was held: %v, printed %q, %d expired keys left; want all 50 deleted", err, out.String(), left)
	}
	if took < hold/2 {
		t.Fatalf("server cleanup ended after %v, before the lock's holder (%v): it did not wait", took, hold)
	}
}

// TestPrincipalNameCountsCharacters: `principal create NAME` takes 1 to 100 characters, as
// the ledger's table and the API do; it counted bytes, and refused a 60-character name in a
// script of two bytes a character. Invalid UTF-8 and control characters are refused.
func TestPrincipalNameCountsCharacters(t *testing.T) {
	for name, ok := range map[string]bool{
		strings.Repeat("é", 100): true, strings.Repeat("é", 101): false, strings.Repeat("a", 100): true,
		"": false, "a\x00b": false, "a\nb": false, "\xff": false,
	} {
		m := NewMain(io.Discard, io.Discard)
		err := m.ParseFlags([]string{"principal", "create", name}, func(string) string { return "" })
		if (err == nil) != ok {
			t.Errorf("principal create %q: %v, want accepted %v", name, err, ok)
		}
	}
}

// TestStartCheckCatchesTheseToo: a bad value stops the start with a message that names the
// variable, before the database is opened. A LISTEN_ADDR whose port cannot exist was found
// only by net.Listen, after the private cluster was created and migrated; a blank
// DATABASE_URL was taken as set (pgx's defaults, not the private cluster) and a blank
// IDEM_DATA_DIR named a directory of spaces.
func TestStartCheckCatchesTheseToo(t *testing.T) {
	for _, tc := range []struct{ name, value, want string }{
		{"LISTEN_ADDR", "127.0.0.1:99999", "LISTEN_ADDR"},
		{"LISTEN_ADDR", "127.0.0.1:http-alt-nope", "LISTEN_ADDR"},
		{"LISTEN_ADDR", "127.0.0.1:-1", "LISTEN_ADDR"},
	} {
		m := NewMain(io.Discard, io.Discard)
		err := m.ParseFlags(nil, func(k string) string {
			if k == tc.name {
				return tc.value
			}
			return ""
		})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s=%q: %v, want an error naming %s", tc.name, tc.value, err, tc.want)
		}
	}
	for _, tc := range []struct{ name, value string }{{"DATABASE_URL", "   "}, {"IDEM_DATA_DIR", " \t "}, {"LISTEN_ADDR", " 127.0.0.1:0 "}} {
		m := NewMain(io.Discard, io.Discard)
		if err := m.ParseFlags(nil, func(k string) string {
			if k == tc.name {
				return tc.value
			}
			return ""
		}); err != nil {
			t.Fatalf("%s=%q: %v", tc.name, tc.value, err)
		}
		d := defaultConfig()
		switch {
		case tc.name == "DATABASE_URL" && m.Config.DatabaseURL != "":
			t.Errorf("DATABASE_URL=%q is taken as set (%q), want the private cluster", tc.value, m.Config.DatabaseURL)
		case tc.name == "IDEM_DATA_DIR" && m.Config.DataDir != d.DataDir:
			t.Errorf("IDEM_DATA_DIR=%q gives the directory %q, want the default %q", tc.value, m.Config.DataDir, d.DataDir)
		case tc.name == "LISTEN_ADDR" && m.Config.ListenAddr != "127.0.0.1:0":
			t.Errorf("LISTEN_ADDR=%q gives %q", tc.value, m.Config.ListenAddr)
		}
	}
}
