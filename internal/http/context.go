package idemhttp

import (
	"context"
	"crypto/rand"
	"encoding/hex"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/dbidem"
)

// state travels in the request's context to the handler.
type state struct {
	m         *Middleware
	tx        pgx.Tx
	body      []byte // the request body, as read (and fingerprinted) by the middleware
	canonical []byte // the canonical form of body when it is strictly valid JSON (nil: not yet known)
	claim     *ClaimInfo
	// providerKey is the provider key of a request without a key on a lease route: one of
	// its own, so that an outside provider never merges it with any other request.
	providerKey string
	secret      bool
	resourceID  string
	// inProgress: the handler answered Refuse(CodeInProgress) (a job it runs under another key
	// is still running): a 409 that is not the request's final answer, rolled back and not
	// stored, so that the client's retry runs the work again.
	inProgress bool
}

// ClaimInfo is what a handler knows about the key its request works under.
type ClaimInfo struct {
	// Principal owns the key.
	Principal string
	// Key is the client's idempotency key as the middleware read it from the header: a
	// quoted sf-string ("k1") is unquoted, so it is the key the database stores.
	Key string
	// Attempt is the fencing token of this claim: no earlier claim of the key had it.
	Attempt int64
	// ProviderKey is the key to give an outside provider that deduplicates by its own
	// idempotency key (a payment provider's Idempotency-Key): the same for every attempt of
	// this request (retries, a takeover of its lease after a crash), different for every
	// other request, a later one under the same key after this one expired or was released
	// included, and for every other principal. It comes from the database with the claim
	// (it follows the key's generation, not the client's key) and is 64 hex digits. On a
	// lease route a request without a key gets one of its own (ClaimOf's ok is false then).
	// On a transactional route the claim commits with the answer or not at all: when the
	// work rolls back (an answer that is not stored, such as a 5xx; a panic; a serialization
	// failure that runs the handler again), its claim and generation roll back with it, and
	// the next run or retry has a new ProviderKey.
	// Work outside the database, which a rollback cannot undo, belongs on a lease route.
	ProviderKey string
	// RecoveryPoint is the last step (Step) an earlier attempt of this request recorded, when
	// this attempt took the key's lease over; "" when none.
	RecoveryPoint string
}

// ErrLeaseLost is the cause (context.Cause) of a lease route's handler context when its lease
// was lost: another attempt may have taken the key over, so the handler should stop. A 2xx
// answer it still gives is recorded, fenced by the claim's token, and sent, if no other
// attempt has taken the key over (the lease ran out without an extension landing); otherwise
// it is neither recorded nor sent, and the client gets 409.
var ErrLeaseLost = dbidem.ErrLeaseLost

// ClaimOf returns the claim of the request's unit of work, or false for a request that runs
// without a key. On a lease route, a request without a key still gets a ProviderKey of its
// own (a random one, used by no other request), so a handler can hand its provider
// ClaimInfo.ProviderKey whether the client sent a key or not.
func ClaimOf(ctx context.Context) (ClaimInfo, bool) {
	s := stateOf(ctx)
	switch {
	case s == nil:
		return ClaimInfo{}, false
	case s.claim != nil:
		return *s.claim, true
	}
	return ClaimInfo{ProviderKey: s.providerKey}, false
}

type stateKey struct{}

func stateOf(ctx context.Context) *state {
	s, _ := ctx.Value(stateKey{}).(*state)
	return s
}

// Tx returns the transaction of the request's unit of work: the handler's writes through it
// commit together with the key, or not at all. Nil outside a declared transactional route.
func Tx(ctx context.Context) pgx.Tx {
	if s := stateOf(ctx); s != nil && s.tx != nil {
		return s.tx
	}
	return nil
}

// MarkOneTimeSecret marks the response as a one-time secret (a token shown once): it is
// sent, its status and headers are stored, its body is not; a repeat gets 409
// one_time_secret.
func MarkOneTimeSecret(ctx context.Context) {
	if s := stateOf(ctx); s != nil {
		s.secret = true
	}
}

// SetResourceID records the id of what the request created; a repeat of a response whose
// body is not stored (a one-time secret, a body too large) names it. Default: the body's
// top-level "id" member (a string or a number), else the response's Location header. It is
// stored as text: U+0000 and bytes that are not UTF-8 become U+FFFD.
func SetResourceID(ctx context.Context, id string) {
	if s := stateOf(ctx); s != nil {
		s.resourceID = id
	}
}

// randomProviderKey is a provider key for one request without a key: 64 random hex digits,
// the shape of the database's.
func randomProviderKey() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
