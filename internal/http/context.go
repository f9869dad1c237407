package idemhttp

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/dbidem"
)

// state travels in the request's context to the handler.
type state struct {
	m          *Middleware
	tx         pgx.Tx
	body       []byte // the request body, as read (and fingerprinted) by the middleware
	canonical  []byte // the canonical form of body when it is strictly valid JSON (nil: not yet known)
	claim      *ClaimInfo
	secret     bool
	resourceID string
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
	// this principal's key, a lease taken over included, and different for every other
	// principal or key. It is derived from both, not the client's key itself.
	ProviderKey string
}

// ErrLeaseLost is the cause (context.Cause) of a lease route's handler context when its lease
// was lost: another attempt may have taken the key over, so the handler should stop. Its
// answer is then not recorded, and not sent as if it were.
var ErrLeaseLost = dbidem.ErrLeaseLost

// ClaimOf returns the claim of the request's unit of work, or false for a request that runs
// without a key.
func ClaimOf(ctx context.Context) (ClaimInfo, bool) {
	if s := stateOf(ctx); s != nil && s.claim != nil {
		return *s.claim, true
	}
	return ClaimInfo{}, false
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
// top-level "id" member (a string or a number), else the response's Location header.
func SetResourceID(ctx context.Context, id string) {
	if s := stateOf(ctx); s != nil {
		s.resourceID = id
	}
}
