package dbidem

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// The operators' view of the keys (idem_summary, idem_health, idem_key) and their lever
// (idem_release_stuck). docs/operations.md ("Operators") says who may call which.

// Health is the cheap part of the keys' summary (idem.idem_health) and the server's
// replication (idem.idem_replication), for monitoring.
type Health struct {
	// InProgress is how many (lease) claims are in progress; LeasesRunOut how many of them
	// have a lease that ran out (their work is dead, or a retry will take them over).
	InProgress, LeasesRunOut int64
	// OldestInProgress is when the oldest claim in progress was made (zero when none), and
	// OldestAge its age.
	OldestInProgress time.Time
	OldestAge        time.Duration
	// CleanupBacklog is how many expired keys wait for cleanup (counted up to a million).
	CleanupBacklog int64
	// TableBytes is the key table's size, indexes and TOAST included; EstimatedKeys its rows
	// as the planner estimates them.
	TableBytes, EstimatedKeys int64
	// Replication is the replication of the database server: "none", "synchronous" (a
	// commit waits for a standby), "asynchronous" (standbys stream from it, no commit waits
	// for one: an answered key can be lost on a failover) or "standby" (in recovery).
	Replication string
	// Standbys is how many standbys stream from the server.
	Standbys int
	// ReplicationWarning says in plain words when an answered key could be lost on a failover
	// (asynchronous), or when commits wait for a synchronous standby that is not connected;
	// "" when none.
	ReplicationWarning string
}

// The operators' reads; every time and duration in whole microseconds (microsSQL).
var (
	readHealthSQL = `SELECT in_progress, leases_run_out, ` + fmt.Sprintf(microsSQL, "oldest_in_progress_at") + `,
		` + fmt.Sprintf(microsSQL, "oldest_in_progress_age") + `, cleanup_backlog, table_bytes, estimated_keys,
		r.replication, r.standbys, r.replication_warning
		FROM idem.idem_health() AS h, idem.idem_replication() AS r`
	readSummarySQL = `SELECT coalesce(principal_id, ''), keys, in_progress, completed, released, expired,
		leases_run_out, ` + fmt.Sprintf(microsSQL, "oldest_in_progress_at") + `, coalesce(table_bytes, 0) FROM idem.idem_summary($1)`
	readKeySQL = `SELECT state, expired, ` + fmt.Sprintf(microsSQL, "claimed_at") + `, ` + fmt.Sprintf(microsSQL, "expires_at") + `,
		` + fmt.Sprintf(microsSQL, "kept_until") + `, ` + fmt.Sprintf(microsSQL, "lease_expires_at") + `, attempt,
		action_hash, field_names, response_status, response_headers, resource_id, withheld, body_bytes
		FROM idem.idem_key($1, $2)`
	readStuckSQL = `SELECT principal_id, key, attempt, ` + fmt.Sprintf(microsSQL, "claimed_at") + `,
		` + fmt.Sprintf(microsSQL, "lease_expires_at") + `, lease_run_out, ` + fmt.Sprintf(microsSQL, "age") + `, provider_key
		FROM idem.idem_stuck($1::interval, $2::integer)`
)

// ReadHealth reads idem.idem_health() and idem.idem_replication() in one statement.
func ReadHealth(ctx context.Context, q Querier) (Health, error) {
	var h Health
	var oldest, age *int64
	var warning *string
	err := q.QueryRow(ctx, readHealthSQL).Scan(&h.InProgress, &h.LeasesRunOut, &oldest, &age, &h.CleanupBacklog, &h.TableBytes, &h.EstimatedKeys,
		&h.Replication, &h.Standbys, &warning)
	if err != nil {
		return Health{}, classifyRead(err)
	}
	h.OldestInProgress = microsTime(oldest)
	h.OldestAge = microsDuration(age)
	if warning != nil {
		h.ReplicationWarning = *warning
	}
	return h, nil
}

// Summary is one row of idem.idem_summary(): the keys of one principal, or of all.
type Summary struct {
	// Principal is the row's principal ("" for all).
	Principal string
	// Keys by state: all of them, in progress, completed, released; Expired are waiting for
	// cleanup, LeasesRunOut are in progress with a lease that ran out.
	Keys, InProgress, Completed, Released, Expired, LeasesRunOut int64
	// OldestInProgress is when the oldest claim in progress was made (zero when none).
	OldestInProgress time.Time
	// TableBytes is the key table's size (the row for all principals only).
	TableBytes int64
}

// ReadSummary reads idem.idem_summary(): one row for all keys, or one per principal. It reads
// the whole table.
func ReadSummary(ctx context.Context, q interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}, byPrincipal bool) ([]Summary, error) {
	rows, err := q.Query(ctx, readSummarySQL, byPrincipal)
	if err != nil {
		return nil, classifyRead(err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Summary, error) {
		var s Summary
		var oldest *int64
		err := r.Scan(&s.Principal, &s.Keys, &s.InProgress, &s.Completed, &s.Released, &s.Expired, &s.LeasesRunOut, &oldest, &s.TableBytes)
		s.OldestInProgress = microsTime(oldest)
		return s, err
	})
	return out, classifyRead(err)
}

// KeyStory is one key's story (idem.idem_key): never its body.
type KeyStory struct {
	// State is in_progress, completed or released; Expired tells whether the key expired: it
	// is absent to the API (its next request claims it anew) and waits for cleanup, which
	// deletes a lease claim's answer once its claim's TTL has passed too.
	State   string
	Expired bool
	// ClaimedAt is when a lease claim was made (zero for a transactional claim).
	ClaimedAt time.Time
	// ExpiresAt is the claim's expiry; KeptUntil, for a completed key, until when its answer
	// is kept; LeaseExpiresAt, for a claim in progress, its lease's end.
	ExpiresAt, KeptUntil, LeaseExpiresAt time.Time
	// Attempt is the key's fencing token (the one idem_release_stuck takes).
	Attempt int64
	// ActionHash is the hash of the action the key was claimed for.
	ActionHash int64
	// FieldNames are the names of the request's stored top-level fields, sorted by code point.
	FieldNames []string
	// Status, Header, ResourceID and Withheld are the stored answer's; BodyBytes its body's
	// size (0 when none).
	Status     int
	Header     map[string]string
	ResourceID string
	Withheld   string
	BodyBytes  int
}

// ReadKey reads one key's story; false when the key does not exist.
func ReadKey(ctx context.Context, q Querier, principal, key string) (KeyStory, bool, error) {
	var k KeyStory
	var claimed, expires, kept, lease *int64
	var status, body *int32
	var resource, withheld *string
	err := q.QueryRow(ctx, readKeySQL, principal, key).Scan(&k.State, &k.Expired, &claimed, &expires, &kept, &lease,
		&k.Attempt, &k.ActionHash, &k.FieldNames, &status, &k.Header, &resource, &withheld, &body)
	switch {
	case err == pgx.ErrNoRows:
		return KeyStory{}, false, nil
	case err != nil:
		return KeyStory{}, false, classifyRead(err)
	}
	k.ClaimedAt, k.ExpiresAt, k.KeptUntil, k.LeaseExpiresAt = microsTime(claimed), microsTime(expires), microsTime(kept), microsTime(lease)
	if status != nil {
		k.Status = int(*status)
	}
	if body != nil {
		k.BodyBytes = int(*body)
	}
	if resource != nil {
		k.ResourceID = *resource
	}
	if withheld != nil {
		k.Withheld = *withheld
	}
	return k, true, nil
}

// ReleaseStuck releases the in-progress lease claim of (principal, key) with this token, whose
// work is known to be dead, so that the client's retry runs again; reason goes into the
// database's NOTICE. ErrClaimLost when there is no such claim (completed, released, taken
// over, absent). Only the operator role may (42501 otherwise).
func ReleaseStuck(ctx context.Context, q Querier, principal, key string, attempt int64, reason string) error {
	_, err := q.Exec(ctx, `SELECT idem.idem_release_stuck($1, $2, $3, $4)`, principal, key, attempt, nullable(reason))
	return classify(err)
}

// StuckClaim is one row of idem.idem_stuck(): a lease claim in progress, with what
// ReleaseStuck takes.
type StuckClaim struct {
	// Principal and Key name the key.
	Principal, Key string
	// Attempt is the claim's token.
	Attempt int64
	// ClaimedAt is when the claim was made (or last taken over); LeaseExpiresAt when its lease
	// ends, by the database's clock; LeaseRunOut whether it ran out (the work is dead, or a
	// retry will take it over).
	ClaimedAt, LeaseExpiresAt time.Time
	LeaseRunOut               bool
	// Age is how long ago the claim was made.
	Age time.Duration
	// ProviderKey is the provider key of the claim's request (Decision.ProviderKey).
	ProviderKey string
}

// ReadStuck reads idem.idem_stuck(): the lease claims in progress made at least olderThan
// ago, oldest first, at most limit of them (0: 100). Only the operator role may (42501
// otherwise).
func ReadStuck(ctx context.Context, q interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}, olderThan time.Duration, limit int) ([]StuckClaim, error) {
	if limit == 0 {
		limit = 100
	}
	// Whole microseconds, rounded up: "at least olderThan ago" never takes in a younger claim.
	us := olderThan.Microseconds()
	if olderThan%time.Microsecond > 0 {
		us++
	}
	rows, err := q.Query(ctx, readStuckSQL, fmt.Sprintf("%d microseconds", us), limit)
	if err != nil {
		return nil, classifyRead(err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (StuckClaim, error) {
		var s StuckClaim
		var claimed, lease, age *int64
		err := r.Scan(&s.Principal, &s.Key, &s.Attempt, &claimed, &lease, &s.LeaseRunOut, &age, &s.ProviderKey)
		s.ClaimedAt, s.LeaseExpiresAt, s.Age = microsTime(claimed), microsTime(lease), microsDuration(age)
		return s, err
	})
	return out, classifyRead(err)
}

// classifyRead is classify for the operators' reads and the cleanup: their lock_timeout (2 s)
// runs out only behind a lock on the key table itself (a VACUUM FULL, a LOCK TABLE), never
// behind a claim in progress (the cleanup skips locked rows), so a 55P03 is ErrStoreBusy
// (D246).
func classifyRead(err error) error {
	if isLockTimeout(err) {
		return fmt.Errorf("%w: %w", ErrStoreBusy, err)
	}
	return classify(err)
}
