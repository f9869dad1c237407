package idemhttp

import (
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
)

// State is what happened to a keyed request, as metrics count it. The set of values is
// frozen (TestStatesAreFrozen): dashboards and alerts depend on it.
type State string

// The states of idempotency_requests_total.
const (
	// StateAcquired: the request claimed the key (counted once per fresh claim, when it is
	// made): the denominator of the other rates.
	StateAcquired State = "acquired"
	// StateReplayed: a stored response was sent again (or 409 for a stored response whose
	// body is withheld).
	StateReplayed State = "replayed"
	// StateBusy: the request was told 409 request_in_progress: another request held the key
	// (or it would have been told so: a duplicate whose client left while it waited), or (on
	// top of acquired) its own lease ran out before its work started or was lost while it ran.
	StateBusy State = "busy"
	// StateKeyReused: the key belongs to another request: 422 idempotency_key_reuse.
	StateKeyReused State = "key_reused"
	// StateStoreError: the database failed; the client got a 5xx (the middleware's own
	// statements, or a transactional handler's 5xx after the database dropped its
	// transaction's connection).
	StateStoreError State = "store_error"
	// StateOversize: counted on top of StateAcquired for a response too large to store for
	// replay, so oversize ÷ acquired is the uncacheable rate.
	StateOversize State = "oversize"
)

// States lists every State, in a fixed order.
var States = []State{StateAcquired, StateReplayed, StateBusy, StateKeyReused, StateStoreError, StateOversize}

// stateOf is the one translation of the driver's outcomes into metric states.
func stateOfOutcome(o dbidem.Outcome) State {
	switch o {
	case dbidem.Claimed:
		return StateAcquired
	case dbidem.Replay:
		return StateReplayed
	case dbidem.Mismatch:
		return StateKeyReused
	}
	return StateBusy // dbidem.InProgress
}

// Observer receives the events of keyed requests. Implementations must be safe for
// concurrent use and must not block: the middleware calls them on the request's path (never
// while it holds a transaction or a row lock).
type Observer interface {
	// Count counts one state of a keyed request of this action (a request may count
	// StateAcquired and then StateOversize).
	Count(action string, state State)
	// Done times a keyed request from its body read (the client's upload not included) to its
	// answer, by its main state.
	Done(state State, elapsed time.Duration)
	// LeaseExtended counts one extension of a lease route's lease (the heartbeat).
	LeaseExtended(action string)
	// LeaseEnded is called once the work of a lease route has ended and its answer is
	// recorded (or not), or when the lease ran out before the work could start (lost; the
	// request is counted busy too, as it is for a lease lost while its work ran and told 409);
	// not for a claim given up at a shutdown before its work
	// started. lost tells whether the lease was lost, worked is how long
	// the handler and the recording took. An answer that could not be recorded (503
	// outcome_unknown) is counted store_error on top of acquired.
	LeaseEnded(action string, lost bool, worked time.Duration)
}

// LeaseClaimObserver is an Observer that is told of each lease claim of a lease route, before
// its work would start (idem.LeaseObserver's adapter is one).
type LeaseClaimObserver interface {
	LeaseClaimed(action string)
}

type nopObserver struct{}

func (nopObserver) Count(string, State)                    {}
func (nopObserver) Done(State, time.Duration)              {}
func (nopObserver) LeaseExtended(string)                   {}
func (nopObserver) LeaseEnded(string, bool, time.Duration) {}

// GateStats are the figures of the middleware's Gate, for gauges and counters.
type GateStats struct {
	// Waiting is how many requests wait, without a connection, for a request with the same
	// key: of this process (in Go), or holding a lease (for its answer); WaitingBytes what they
	// hold (their bodies plus 4 KiB each).
	Waiting, WaitingBytes int64
	// LockWaits is how many claims wait on a key's row lock held by another process.
	LockWaits int
	// Coalesced counts the requests that found their key in flight in this process and
	// waited; Refused those answered 409 without waiting on the database.
	Coalesced, Refused uint64
}

// GateStats reads the figures of the middleware's Gate.
func (m *Middleware) GateStats() GateStats {
	g := m.gate
	return GateStats{Waiting: g.Waiting(), WaitingBytes: g.WaitingBytes(), LockWaits: g.LockWaits(),
		Coalesced: g.Coalesced(), Refused: g.Refused()}
}
