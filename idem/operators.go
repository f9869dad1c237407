package idem

import (
	"context"
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
)

// The operators' view of the keys and their lever, for a monitor, a support tool or a command
// of your own (the reference server's `server keys`). docs/operations.md ("Operators") says
// which role may call which: the application role (idem_app) reads the summary, the health
// and one key's story; the operator role (idem_operator) also lists the stuck claims and
// releases them.

// Health is the cheap part of the keys' summary (idem_health) and the database server's
// replication (idem_replication), for monitoring.
type Health struct {
	// InProgress is how many lease claims are in progress; LeasesRunOut how many of them have
	// a lease that ran out (their work is dead, or a retry will take them over).
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

// ReadHealth reads idem.idem_health() and idem.idem_replication() in one statement: through
// indexes and the server's own views, cheap enough for a monitor that asks every few seconds.
// The application role (idem_app) may, as the operator role may. Behind a lock on the key
// table (VACUUM FULL, LOCK TABLE) it gives up after 2 s with ErrStoreBusy.
func ReadHealth(ctx context.Context, q Querier) (Health, error) {
	h, err := dbidem.ReadHealth(ctx, q)
	return Health(h), err
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
// the whole table (seconds on tens of millions of keys): for people, not for a monitor. The
// application role (idem_app) may, as the operator role may. Behind a lock on the key table
// (VACUUM FULL, LOCK TABLE) it gives up after 2 s with ErrStoreBusy.
func ReadSummary(ctx context.Context, q Querier, byPrincipal bool) ([]Summary, error) {
	rows, err := dbidem.ReadSummary(ctx, q, byPrincipal)
	out := make([]Summary, len(rows))
	for i, r := range rows {
		out[i] = Summary(r)
	}
	return out, err
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
	// Attempt is the key's fencing token (the one ReleaseStuck takes).
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

// ReadKey reads one key's story; false when the key does not exist. The application role
// (idem_app) may, as the operator role may. Behind a lock on the key table it gives up after
// 2 s with ErrStoreBusy.
func ReadKey(ctx context.Context, q Querier, principal, key string) (KeyStory, bool, error) {
	k, ok, err := dbidem.ReadKey(ctx, q, principal, key)
	return KeyStory(k), ok, err
}

// StuckClaim is one lease claim in progress (idem.idem_stuck), with what ReleaseStuck takes.
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
	// ProviderKey is the provider key of the claim's request: what an outside provider saw.
	ProviderKey string
}

// ReadStuck lists the lease claims in progress made at least olderThan ago, oldest first, at
// most limit of them (0: 100; at most 10,000): where the release of a stuck claim starts.
// Only the operator role may (ErrPermissionDenied otherwise). Behind a lock on the key table
// it gives up after 2 s with ErrStoreBusy.
func ReadStuck(ctx context.Context, q Querier, olderThan time.Duration, limit int) ([]StuckClaim, error) {
	rows, err := dbidem.ReadStuck(ctx, q, olderThan, limit)
	out := make([]StuckClaim, len(rows))
	for i, r := range rows {
		out[i] = StuckClaim(r)
	}
	return out, err
}

// ReleaseStuck releases the in-progress lease claim of (principal, key) with this token, whose
// work is known to be dead, so that the client's retry runs again; reason goes into the
// database's NOTICE. The retry takes the key over in the same generation, with the same
// provider key (as after Yield, unlike Release), so that a provider that saw the dead attempt's
// call answers from its record; the stuck holder, should it wake, is fenced off. ErrClaimLost
// when there is no such claim (completed, released, taken over, absent). Only the operator role
// may (ErrPermissionDenied otherwise).
func ReleaseStuck(ctx context.Context, q Querier, principal, key string, attempt int64, reason string) error {
	return dbidem.ReleaseStuck(ctx, q, principal, key, attempt, reason)
}

// Defaults are the SQL API's defaults, which a zero TTL, LockTimeout or batch size stands
// for. They have one home, the functions (idem.idem_defaults()).
type Defaults struct {
	// TTL is how long a key's answer stays replayable after it was given.
	TTL time.Duration
	// LockTimeout is how long a function waits for a concurrent holder of a key.
	LockTimeout time.Duration
	// BatchSize is idem_cleanup's batch size.
	BatchSize int
}

// ReadDefaults reads the SQL API's defaults from the database.
func ReadDefaults(ctx context.Context, q Querier) (Defaults, error) {
	d, err := dbidem.ReadDefaults(ctx, q)
	return Defaults(d), err
}

// MaxDuration is the longest TTL or lease the SQL API takes: interval '10 years', which
// PostgreSQL counts as 120 months of 30 days.
const MaxDuration = 120 * 30 * 24 * time.Hour

// MaxLockTimeout is the longest Options.LockTimeout: PostgreSQL's largest lock_timeout
// (INT_MAX milliseconds, about 24 days).
const MaxLockTimeout = (1<<31 - 1) * time.Millisecond

// IsUnavailable tells whether err says the database could not be reached or dropped the
// connection (refused or failed connections, network errors, a connection pgx had closed
// already, class 08, shutdown, too many connections): a retry may succeed once it is back, so an HTTP server answers 503 with
// Retry-After, not 500. A context that ended is not unavailability: false.
func IsUnavailable(err error) bool { return dbidem.IsUnavailable(err) }
