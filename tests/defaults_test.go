package tests

import (
	"context"
	"os"
	"regexp"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestDocumentedDefaultsAreTheSQLDefaults reads the SQL API's defaults where they live, in
// pg_catalog (the DEFAULT of idem_begin's p_ttl and of the cleanup functions' p_batch_size, the
// lock_timeout SET clause of every function), checks that idem.idem_defaults() reports the
// same, and then finds every place the documentation states a default and compares it.
func TestDocumentedDefaultsAreTheSQLDefaults(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	conn := pgtest.Connect(t, pgtest.NewDB(t))
	seconds := func(expr string) float64 {
		t.Helper()
		var s float64
		if err := conn.QueryRow(ctx, `SELECT extract(epoch FROM $1::interval)`, expr).Scan(&s); err != nil {
			t.Fatalf("%q as an interval: %v", expr, err)
		}
		return s
	}
	argDefault := func(fn, arg string) string {
		t.Helper()
		var args string
		if err := conn.QueryRow(ctx, `SELECT pg_get_function_arguments(p.oid) FROM pg_proc p
			JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'idem' AND p.proname = $1`, fn).Scan(&args); err != nil {
			t.Fatalf("%s: %v", fn, err)
		}
		m := regexp.MustCompile(`\b` + arg + ` \w+ DEFAULT ([^,]+)`).FindStringSubmatch(args)
		if m == nil {
			t.Fatalf("%s(%s): no DEFAULT for %s", fn, args, arg)
		}
		return m[1]
	}

	// The homes.
	var ttl float64
	if err := conn.QueryRow(ctx, `SELECT extract(epoch FROM `+argDefault("idem_begin", "p_ttl")+`)`).Scan(&ttl); err != nil {
		t.Fatal(err)
	}
	batch := argDefault("idem_cleanup", "p_batch_size")
	for _, fn := range []string{"idem_cleanup_all", "idem_cleanup_workers"} {
		if b := argDefault(fn, "p_batch_size"); b != batch {
			t.Fatalf("idem_cleanup's batch size defaults to %s, %s's to %s", batch, fn, b)
		}
	}
	rows, err := conn.Query(ctx, `SELECT p.proname, substr(c, length('lock_timeout=') + 1) FROM pg_proc p
		JOIN pg_namespace n ON n.oid = p.pronamespace, unnest(p.proconfig) AS c
		WHERE n.nspname = 'idem' AND c LIKE 'lock_timeout=%'`)
	if err != nil {
		t.Fatal(err)
	}
	lockTimeouts := map[string]string{}
	for rows.Next() {
		var fn, v string
		if err := rows.Scan(&fn, &v); err != nil {
			t.Fatal(err)
		}
		lockTimeouts[fn] = v
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	lock := lockTimeouts["idem_begin"]
	for _, fn := range []string{"idem_begin", "idem_complete", "idem_save_final", "idem_release", "idem_cleanup"} {
		if lockTimeouts[fn] == "" || lockTimeouts[fn] != lock {
			t.Fatalf("lock_timeout of every function: %v", lockTimeouts)
		}
	}
	lockSeconds := seconds(lock)

	// idem_defaults() reports them.
	var dTTL, dLock float64
	var dBatch string
	if err := conn.QueryRow(ctx, `SELECT extract(epoch FROM ttl), extract(epoch FROM lock_timeout), batch_size::text
		FROM idem.idem_defaults()`).Scan(&dTTL, &dLock, &dBatch); err != nil {
		t.Fatal(err)
	}
	if dTTL != ttl || dLock != lockSeconds || dBatch != batch {
		t.Fatalf("idem_defaults() = %v s, %v s, %s; pg_catalog has %v s, %v s, %s", dTTL, dLock, dBatch, ttl, lockSeconds, batch)
	}
	t.Logf("the SQL defaults: TTL %v s, lock timeout %v s, batch size %s", ttl, lockSeconds, batch)

	// Every place the docs state one: a file, a pattern whose group is the value, and which
	// default it states. Each must be found.
	for _, c := range []struct {
		file, pattern, what string
	}{
		{"docs/sql-api.md", `p_ttl interval DEFAULT '([^']+)'`, "ttl"},
		{"docs/sql-api.md", `NULL: the default, ([0-9]+ \w+)`, "ttl"},
		{"docs/sql-api.md", `p_ttl. NULL means the default \(([0-9]+ \w+)\)`, "ttl"},
		{"docs/sql-api.md", `sets its own .lock_timeout. \(([0-9]+ \w+);`, "lock"},
		{"docs/sql-api.md", `holder of the same key; NULL: ([0-9]+ \w+)`, "lock"},
		{"docs/sql-api.md", `idem_cleanup\(p_batch_size integer DEFAULT ([0-9]+)\)`, "batch"},
		{"docs/sql-api.md", `idem_cleanup_all\(p_batch_size integer DEFAULT ([0-9]+),`, "batch"},
		{"docs/sql-api.md", `for an argument omitted: ([0-9]+ \w+) \(.p_ttl.`, "ttl"},
		{"docs/sql-api.md", `also when NULL\),\n([0-9]+ \w+) \(.p_lock_timeout.`, "lock"},
		{"docs/sql-api.md", `also when NULL\), ([0-9]+) \(.p_batch_size.`, "batch"},
		{"docs/operations.md", "`IDEMPOTENCY_TTL` \\| the SQL default, `([^`]+)`", "ttl"},
		{"docs/operations.md", "`IDEMPOTENCY_LOCK_TIMEOUT` \\| the SQL default, `([^`]+)`", "lock"},
		{"docs/operations.md", "`CLEANUP_BATCH_SIZE` \\| the SQL default, `([^`]+)`", "batch"},
		{"docs/http.md", `each wait of the lock timeout \(default ([0-9]+ ?\w+)\)`, "lock"},
		{"docs/DECISIONS.md", `The TTL \(([0-9]+ \w+)\), the lock timeout`, "ttl"},
		{"docs/DECISIONS.md", `the lock timeout \(([0-9]+ \w+)\) and the cleanup batch size`, "lock"},
		{"docs/DECISIONS.md", `the cleanup batch size \(([0-9]+)\) are defined`, "batch"},
	} {
		raw, err := os.ReadFile("../" + c.file)
		if err != nil {
			t.Fatal(err)
		}
		m := regexp.MustCompile(c.pattern).FindSubmatch(raw)
		if m == nil {
			t.Errorf("%s: no %q (the statement of a default moved or changed; update this test)", c.file, c.pattern)
			continue
		}
		v := string(m[1])
		switch c.what {
		case "ttl":
			if seconds(v) != ttl {
				t.Errorf("%s says the TTL defaults to %q; the SQL default is %v s", c.file, v, ttl)
			}
		case "lock":
			if seconds(v) != lockSeconds {
				t.Errorf("%s says the lock timeout defaults to %q; the SQL default is %v s", c.file, v, lockSeconds)
			}
		case "batch":
			if v != batch {
				t.Errorf("%s says the batch size defaults to %q; the SQL default is %s", c.file, v, batch)
			}
		}
	}
}
