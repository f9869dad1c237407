package main

// Configuration values and command-line arguments, hostile ones first.

import (
	"bytes"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// parseWith parses args with env (and a DATABASE_URL) as the server's start does.
func parseWith(args []string, env map[string]string) error {
	m := NewMain(&bytes.Buffer{}, &bytes.Buffer{})
	vars := map[string]string{"DATABASE_URL": "postgres://u@127.0.0.1:1/db"}
	for k, v := range env {
		vars[k] = v
	}
	return m.ParseFlags(args, func(k string) string { return vars[k] })
}

// TestConfigBadValuesStopTheStart: docs/operations.md "Configuration": "A bad value stops
// the start with a message that names the variable". Every variable, garbage, negatives,
// zero where zero means nothing documented, huge values and unit mistakes.
func TestConfigBadValuesStopTheStart(t *testing.T) {
	t.Parallel()
	durations := []string{"-1s", "abc", "10", "1h30", "5 minutes", "1e3s", "87601h", "NaN", "1d"}
	ints := []string{"-1", "abc", "1.5", "1e3", "99999999999999999999", "4KB", "0x10"}
	bad := map[string][]string{
		"DATABASE_POOL_SIZE":             append([]string{"0", "1", "10001"}, ints...),
		"IDEM_DATA_PORT":                 append([]string{"0", "65536"}, ints...),
		"IDEMPOTENCY_TTL":                append([]string{"0", "500ms"}, durations...),
		"IDEMPOTENCY_LOCK_TIMEOUT":       append([]string{"0", "100us", "600h"}, durations...),
		"IDEMPOTENCY_WORK_TIMEOUT":       append([]string{"0"}, durations...),
		"IDEMPOTENCY_DUPLICATE_WAIT":     append([]string{"0", "11m"}, durations...),
		"IDEMPOTENCY_MAX_WAITING_CLAIMS": append([]string{"0"}, ints...),
		"IDEMPOTENCY_MAX_WAITING_BYTES":  append([]string{"0", "1000"}, ints...),
		"MAX_BODY_BYTES":                 append([]string{"0", "1073741825"}, ints...),
		"MAX_STORED_RESPONSE_BYTES":      append([]string{"0", "1073741825"}, ints...),
		"CLEANUP_INTERVAL":               append([]string{"500ms"}, durations...),
		"CLEANUP_BATCH_SIZE":             append([]string{"0", "1000001"}, ints...),
		"CLEANUP_DUTY":                   {"0", "0.001", "1.5", "-0.4", "abc", "NaN", "Inf", "40%"},
		"CLEANUP_VACUUM":                 {"yes", "no", "on", "2", "abc"},
		"SHUTDOWN_TIMEOUT":               append([]string{"0"}, durations...),
		"PAYOUTS_LEASE":                  append([]string{"0", "500ms"}, durations...),
		"PAYOUT_PROVIDER_DELAY":          durations,
		"RECEIPT_URL":                    {"ftp://x/y", "localhost:9000", "http://", "/receipts", "abc"},
		"RECEIPT_LEASE":                  append([]string{"0", "500ms"}, durations...),
		"RECEIPT_TIMEOUT":                append([]string{"0"}, durations...),
		"RECEIPT_RESCUE_AFTER":           append([]string{"0", "30s", "10s"}, durations...),
		"PAYOUT_STEP_PAUSE":              durations,
		"TRANSFERS_REQUIRE_KEY":          {"yes", "no", "abc"},
		"LOG_LEVEL":                      {"verbose", "info+2", "warning", "0", "trace"},
		"LISTEN_ADDR":                    {"8080", "localhost", "127.0.0.1:99999", "127.0.0.1:-1", "127.0.0.1:abc"},
		"IDEM_APP_ROLE":                  {"Idem", "pg_monitor", "public", "a-b", "a b", strings.Repeat("a", 64)},
		"DATABASE_URL":                   {"postgres://u@h:notaport/db", "host=h port=abc", "postgres://u@h/db?pool_max_conns=5", "postgres://u@h/db?connect_timeout=abc"},
	}
	for name, values := range bad {
		for _, v := range values {
			err := parseWith(nil, map[string]string{name: v})
			if err == nil {
				t.Errorf("%s=%q: the start went on; want it stopped with a message naming %s", name, v, name)
				continue
			}
			if !strings.Contains(err.Error(), name) {
				t.Errorf("%s=%q: %v; the message does not name the variable", name, v, err)
			}
		}
	}
	// and every bad value at once is reported, not only the first
	all := map[string]string{}
	for name, values := range bad {
		if name != "DATABASE_URL" {
			all[name] = values[len(values)-1]
		}
	}
	if err := parseWith(nil, all); err == nil {
		t.Error("all bad at once: no error")
	} else {
		for name := range all {
			if !strings.Contains(err.Error(), name) {
				t.Errorf("all bad at once: %s not named in %v", name, err)
			}
		}
	}
}

// TestCommandArgs: bad arguments to the subcommands stop before any database work with a
// message that says what is wanted.
func TestCommandArgs(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"principal"}, "principal create NAME"},
		{[]string{"principal", "create"}, "principal create NAME"},
		{[]string{"principal", "delete", "x"}, "principal create NAME"},
		{[]string{"principal", "create", "a", "b"}, "principal create NAME"},
		{[]string{"principal", "create", ""}, "1 to 100"},
		{[]string{"principal", "create", strings.Repeat("x", 101)}, "1 to 100"},
		{[]string{"principal", "create", "a\nb"}, "control"},
		{[]string{"principal", "create", "a\xffb"}, "UTF-8"},
		{[]string{"principal", "create", "-x"}, "must not start with -"},
		{[]string{"cleanup", "now"}, "takes no arguments"},
		{[]string{"cleanup", "--all"}, "takes no arguments"},
		{[]string{"migrate", "up"}, "takes no arguments"},
		{[]string{"serve", "x"}, "takes no arguments"},
		{[]string{"keys", "a", "b", "c"}, "keys: want"},
		{[]string{"keys", "stuck", "5m", "x"}, "keys: want"},
		{[]string{"keys", "release", "p", "k"}, "keys: want"},
		{[]string{"keys", "x"}, "keys: want"},
		{[]string{"frobnicate"}, "unknown command"},
	} {
		err := parseWith(c.args, nil)
		if err == nil {
			t.Errorf("server %q: accepted; want a usage error before any database work (%q)", c.args, c.want)
			continue
		}
		if !strings.Contains(err.Error(), c.want) {
			t.Errorf("server %q: %v; want it to say %q", c.args, err, c.want)
		}
	}
}

// TestListenAddrWithoutPort: LISTEN_ADDR="127.0.0.1:" (what `LISTEN_ADDR=127.0.0.1:$PORT`
// gives when PORT is unset) and ":" were accepted: the server started and served on a port the
// kernel picked at random (":" on every interface), which no client or load balancer knows.
// They stop the start with a message naming LISTEN_ADDR; port 0 written out stays allowed.
func TestListenAddrWithoutPort(t *testing.T) {
	t.Parallel()
	for _, v := range []string{"127.0.0.1:", ":", "[::1]:", "localhost:"} {
		if err := parseWith(nil, map[string]string{"LISTEN_ADDR": v}); err == nil {
			t.Errorf("LISTEN_ADDR=%q: accepted; want the start stopped with a message naming LISTEN_ADDR (no port)", v)
		}
	}
	if err := parseWith(nil, map[string]string{"LISTEN_ADDR": "127.0.0.1:0"}); err != nil {
		t.Errorf("LISTEN_ADDR=127.0.0.1:0: %v; want port 0 written out accepted", err)
	}
}

// TestKeysArgsCheckedEarly: `server keys` arguments that cannot be right were not refused
// with the usage like every other command's (before any database work, exit 2), but only
// after connecting (exit 1), and `keys by-principal x` was read as `keys PRINCIPAL KEY` for a
// principal named "by-principal": the operator got "no key "x" of principal "by-principal""
// instead of the usage.
func TestKeysArgsCheckedEarly(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"keys", "by-principal", "x"},
		{"keys", "stuck", "abc"},
		{"keys", "stuck", "-5m"},
		{"keys", "stuck", "100000h"}, // past the SQL API's 10 years: refused here, not by idem_stuck
		{"keys", "release", "p", "k", "notanumber"},
	} {
		if err := parseWith(args, nil); err == nil {
			t.Errorf("server %q: passed the argument check; want the usage error before any database work", args)
		}
	}
	db := pgtest.NewDB(t)
	_, _, err := runMain(t, []string{"keys", "by-principal", "x"}, func(k string) string {
		return map[string]string{"DATABASE_URL": db}[k]
	})
	if err == nil || !strings.Contains(err.Error(), "keys: want") {
		t.Errorf("server keys by-principal x: %v; want the usage", err)
	}
}

// TestConfigZeroSpelledAsDuration: CLEANUP_INTERVAL "`0` disables", PAYOUT_PROVIDER_DELAY
// "`0` answers at once", PAYOUT_STEP_PAUSE "`0`: none". The same zero written as a duration (0s,
// the form every other value of these variables takes) or with a space (every other variable
// is trimmed) stopped the start with "want a duration from 1s" (1ms), a message that never
// said 0 turns it off. They are taken as 0, and a bad value's message names 0.
func TestConfigZeroSpelledAsDuration(t *testing.T) {
	t.Parallel()
	for name, values := range map[string][]string{
		"CLEANUP_INTERVAL":      {"0", " 0", "0s"},
		"PAYOUT_PROVIDER_DELAY": {"0", " 0", "0s"},
		"PAYOUT_STEP_PAUSE":     {"0", " 0", "0s"},
	} {
		for _, v := range values {
			if err := parseWith(nil, map[string]string{name: v}); err != nil {
				t.Errorf("%s=%q: %v", name, v, err)
			}
		}
	}
}

// TestConfigBoundsInTheMessageAreTheVariables: a bad value's message states the variable's own
// range. IDEMPOTENCY_DUPLICATE_WAIT=0 and IDEMPOTENCY_LOCK_TIMEOUT=-1s said "from 1ms to
// 87600h0m0s" (every duration's 10 years), where the largest each takes is 10 minutes and
// PostgreSQL's largest lock_timeout; a value over those got the right one.
func TestConfigBoundsInTheMessageAreTheVariables(t *testing.T) {
	t.Parallel()
	for name, want := range map[string]string{
		"IDEMPOTENCY_DUPLICATE_WAIT": "to 10m0s",
		"IDEMPOTENCY_LOCK_TIMEOUT":   "to 596h31m23.647s",
	} {
		for _, v := range []string{"0", "-1s", "abc", "9999h"} {
			err := parseWith(nil, map[string]string{name: v})
			if err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("%s=%s: %v; want the message to say %q", name, v, err, want)
			}
		}
	}
}
