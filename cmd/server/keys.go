package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
)

// tableLocked explains a read of the keys that met a lock on the key table: the operator
// functions wait for it at most their lock_timeout (2 s), then raise 55P03.
func tableLocked(err error) error {
	if locked, ok := tableLockedFor(err, "nothing was read"); ok {
		return locked
	}
	return err
}

// tableLockedFor explains an operator's call that met a lock on the key table (55P03, which a
// read reports as idem.ErrStoreBusy), saying what was not done; false for another error.
func tableLockedFor(err error, nothing string) (error, bool) {
	var pgErr *pgconn.PgError
	if errors.Is(err, idem.ErrStoreBusy) || errors.As(err, &pgErr) && pgErr.Code == "55P03" {
		return fmt.Errorf("the key table is locked (a VACUUM FULL, CLUSTER, pg_repack, a migration's swap or a LOCK TABLE holds it); "+
			"%s: try again once it ends [%w]", nothing, err), true
	}
	return nil, false
}

// healthEvery is how often, at most, the key gauges (idemprom.HealthCollector) ask the
// database: a scrape in between gets the figures of the last read.
const healthEvery = 15 * time.Second

// keysCommand is `server keys`: the summary of the keys, per principal, the lease claims in
// progress (stuck ones among them), one key's story, or the release of a stuck lease claim,
// for operators without psql at hand.
//
// What clients chose (a principal, a key, a field name of a request's body, a resource id) is printed
// as it is when it is plain (printable, no space or comma that could be read as a separator), and
// quoted as a Go string otherwise: a name with a newline or a terminal's escape sequence cannot
// add lines to the output or drive the operator's terminal.
func keysCommand(ctx context.Context, pool *pgxpool.Pool, out io.Writer, args []string) error {
	switch {
	case len(args) == 0 || (len(args) == 1 && args[0] == "by-principal"):
		rows, err := idem.ReadSummary(ctx, pool, len(args) == 1)
		if err != nil {
			return tableLocked(err)
		}
		h, err := idem.ReadHealth(ctx, pool)
		if err != nil {
			return tableLocked(err)
		}
		fmt.Fprintf(out, "%-24s %10s %12s %10s %9s %8s %15s  %s\n", "principal", "keys", "in_progress", "completed", "released",
			"expired", "leases_run_out", "oldest_in_progress")
		for _, s := range rows {
			p := printable(s.Principal)
			if s.Principal == "" {
				p = "(all)"
			}
			oldest := "-"
			if !s.OldestInProgress.IsZero() {
				oldest = fmt.Sprintf("%s (%s ago)", s.OldestInProgress.UTC().Format(time.RFC3339), time.Since(s.OldestInProgress).Round(time.Second))
			}
			fmt.Fprintf(out, "%-24s %10d %12d %10d %9d %8d %15d  %s\n", p, s.Keys, s.InProgress, s.Completed, s.Released,
				s.Expired, s.LeasesRunOut, oldest)
		}
		fmt.Fprintf(out, "key table: %d bytes, cleanup backlog: %d\n", h.TableBytes, h.CleanupBacklog)
		fmt.Fprintf(out, "replication: %s, %d standbys\n", h.Replication, h.Standbys)
		if h.ReplicationWarning != "" {
			fmt.Fprintf(out, "warning: %s\n", h.ReplicationWarning)
		}
		return nil
	case len(args) >= 1 && args[0] == "stuck":
		var age time.Duration
		if len(args) == 2 {
			var err error
			if age, err = stuckAge(args[1]); err != nil {
				return err
			}
		}
		claims, err := idem.ReadStuck(ctx, pool, age, maxStuckListed+1)
		if err != nil {
			return tableLocked(err)
		}
		cut := len(claims) > maxStuckListed
		if cut {
			claims = claims[:maxStuckListed]
		}
		fmt.Fprintf(out, "%-24s %-36s %12s  %-20s %-20s %-9s %s\n", "principal", "key", "token", "claimed_at", "lease_expires_at",
			"run_out", "provider_key")
		for _, c := range claims {
			fmt.Fprintf(out, "%-24s %-36s %12d  %-20s %-20s %-9v %s\n", printable(c.Principal), printable(c.Key), c.Attempt,
				c.ClaimedAt.UTC().Format(time.RFC3339), c.LeaseExpiresAt.UTC().Format(time.RFC3339), c.LeaseRunOut, c.ProviderKey)
		}
		n := strconv.Itoa(len(claims))
		if cut {
			n = fmt.Sprintf("more than %d (the oldest %[1]d listed; a longer AGE lists fewer)", maxStuckListed)
		}
		fmt.Fprintf(out, "%s lease claims in progress claimed at least %s ago; release one whose work is dead with "+
			"`server keys release PRINCIPAL KEY TOKEN REASON`\n", n, age)
		return nil
	case len(args) == 2:
		k, ok, err := idem.ReadKey(ctx, pool, args[0], args[1])
		if err != nil {
			return tableLocked(err)
		}
		if !ok {
			return fmt.Errorf("no key %q of principal %q", args[1], args[0])
		}
		line := func(name string, v any) { fmt.Fprintf(out, "%-18s %v\n", name, v) }
		when := func(t time.Time) string {
			if t.IsZero() {
				return "-"
			}
			return t.UTC().Format(time.RFC3339Nano)
		}
		line("state", k.State)
		line("expired", k.Expired)
		line("claimed_at", when(k.ClaimedAt))
		line("expires_at", when(k.ExpiresAt))
		line("kept_until", when(k.KeptUntil))
		line("lease_expires_at", when(k.LeaseExpiresAt))
		line("attempt", k.Attempt)
		line("action_hash", k.ActionHash)
		names := make([]string, len(k.FieldNames))
		for i, n := range k.FieldNames {
			names[i] = printable(n) // the client's member names: quoted when not plain
		}
		line("field_names", strings.Join(names, ", "))
		orNone := func(v any, ok bool) any {
			if !ok {
				return "-"
			}
			return v
		}
		answered := k.Status != 0 // an answer's status is 100 to 599; none while in progress
		headers, err := json.Marshal(k.Header)
		if err != nil {
			return err
		}
		line("response_status", orNone(k.Status, answered))
		line("response_headers", orNone(string(headers), answered && k.Header != nil))
		line("resource_id", orNone(printable(k.ResourceID), k.ResourceID != ""))
		line("withheld", orNone(k.Withheld, k.Withheld != ""))
		line("body_bytes", orNone(k.BodyBytes, answered && k.Withheld == ""))
		return nil
	case len(args) >= 4 && args[0] == "release":
		token, err := releaseToken(args[3])
		if err != nil {
			return err
		}
		reason := strings.Join(args[4:], " ")
		if err := idem.ReleaseStuck(ctx, pool, args[1], args[2], token, reason); err != nil {
			if locked, ok := tableLockedFor(err, "nothing was released"); ok {
				return fmt.Errorf("keys release: %w", locked)
			}
			if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) {
				return fmt.Errorf("keys release: %s", pgErr.Message) // the function's own words
			}
			return err
		}
		why := ""
		if reason != "" {
			why = fmt.Sprintf(", reason %q, in PostgreSQL's log", reason)
		}
		fmt.Fprintf(out, "released the lease claim of key %q of principal %q (token %d%s): a retry runs the work again\n", args[2], args[1], token, why)
		return nil
	}
	return fmt.Errorf("keys: want `keys`, `keys by-principal`, `keys stuck [AGE]`, `keys PRINCIPAL KEY` or `keys release PRINCIPAL KEY TOKEN [REASON]`\n\n%s", usage)
}

// maxStuckListed is the most claims `keys stuck` lists; past it the count says so.
const maxStuckListed = 1000

// printable is v as it is when every character is a printable one other than a space, a comma
// or a quote, else v quoted (strconv.Quote).
func printable(v string) string {
	for _, r := range v {
		if !unicode.IsPrint(r) || r == ' ' || r == ',' || r == '"' || r == '\\' {
			return strconv.Quote(v)
		}
	}
	return v
}

// stuckAge reads the AGE of `keys stuck AGE`: a duration, not negative, at most the SQL
// API's bound (10 years).
func stuckAge(v string) (time.Duration, error) {
	age, err := time.ParseDuration(v)
	if err != nil || age < 0 {
		return 0, fmt.Errorf("keys stuck: AGE must be a duration such as 5m, got %q", v)
	}
	if age > idem.MaxDuration {
		return 0, fmt.Errorf("keys stuck: AGE must be at most 10 years (86400h, as PostgreSQL counts them), got %q", v)
	}
	return age, nil
}

// releaseToken reads the TOKEN of `keys release PRINCIPAL KEY TOKEN`: the key's attempt.
func releaseToken(v string) (int64, error) {
	token, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("keys release: TOKEN must be the key's attempt (an integer), got %q", v)
	}
	return token, nil
}
