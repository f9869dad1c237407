package history

import (
	"fmt"
	"time"
)

// ClockSlack is how much earlier than the model's bound a new generation may appear without
// being called a violation. Every clock involved (the clients', the server's, PostgreSQL's) is
// the same machine's, so the slack covers only the rounding between Go's monotonic clock and
// the database's wall clock, not a skew between machines.
const ClockSlack = 50 * time.Millisecond

// Route says how a request holds its key while its work runs.
type Route uint8

const (
	// Transactional: the claim, the work and the answer commit together (a transactional
	// claim, p_lease NULL; Do; the ledger's deposits and transfers).
	Transactional Route = iota
	// Leased: the claim commits on its own and the work runs under a lease (DoLease, the
	// payouts route, idem_begin with p_lease).
	Leased
)

// String is "tx" or "lease".
func (r Route) String() string {
	if r == Leased {
		return "lease"
	}
	return "tx"
}

// Outcome is what a client learned of one operation.
type Outcome uint8

// The outcomes. Answered, Replayed, Mismatch and Busy are decisions; Failed and Unknown say
// the client does not know what happened; Held, Released and Lost are what a client that
// drives the SQL API (or DoLease) itself knows of a claim it made.
const (
	// Answered: a fresh answer, without the replay marker: this operation ran the work (or
	// refused it with a final error) and its answer was stored.
	Answered Outcome = iota + 1
	// Replayed: the stored answer, with the replay marker.
	Replayed
	// Mismatch: the key is bound to another request (HTTP 422 idempotency_key_reuse, SQL
	// outcome mismatch, ErrMismatch).
	Mismatch
	// Busy: the key is in use (HTTP 409 request_in_progress, SQL in_progress or a lock
	// timeout, ErrInProgress). On a lease route it is also what an attempt whose lease was
	// lost answers, after it did its work, and one whose store was acknowledged too late.
	Busy
	// Failed: an answer that decides nothing (a 5xx, an error from the database): the
	// operation may have taken effect or not, within its call and return.
	Failed
	// Unknown: no answer at all (a timeout, a hang-up, a cut connection, a killed server). The
	// operation may take effect at any instant after its call, even after the client gave up.
	Unknown
	// Held: a lease claim was made and deliberately left to run out without an answer.
	Held
	// Released: a lease claim was made and released without an answer.
	Released
	// Lost: a lease claim was made, then found taken over (idem_complete or idem_extend
	// raised 55000; ErrLeaseLost): another attempt of the same generation holds the key, or
	// (a store retried after its acknowledgement was lost) this one's answer is stored.
	Lost
	// Observed is not a client's operation: it is the effects found under the key once the
	// history ended (Output.Effects).
	Observed
	// NotSent: the request never left the client (no connection could be made: a refused
	// dial, a database that does not accept connections), so it did nothing.
	NotSent
)

var outcomeNames = map[Outcome]string{Answered: "answered", Replayed: "replayed", Mismatch: "mismatch", Busy: "busy",
	Failed: "failed", Unknown: "unknown", Held: "held", Released: "released", Lost: "lost", Observed: "observed",
	NotSent: "not sent"}

// String is the outcome's name, as the timelines and the counts show it.
func (o Outcome) String() string {
	if s, ok := outcomeNames[o]; ok {
		return s
	}
	return fmt.Sprintf("outcome(%d)", uint8(o))
}

// Input is what an operation sent.
type Input struct {
	// Key names the partition: the principal and the idempotency key.
	Key string
	// Client is who sent it (a goroutine, a connection), for the timeline.
	Client int
	// Request is what was sent, readable ("POST /v1/payouts amount=100").
	Request string
	// Fingerprint binds the key: two operations with the same fingerprint are the same request.
	Fingerprint string
	// Route is how the request holds the key while it works.
	Route Route
	// TTL is how long an answer is kept after it is stored (and a lease claim past its lease).
	TTL time.Duration
	// Lease is the claim's lease, for a Leased route: the lease ends at least this long after
	// the claim.
	Lease time.Duration
	// Call is when the operation was sent, since the history began.
	Call time.Duration
}

// Output is what an operation learned.
type Output struct {
	// Outcome is the kind of answer.
	Outcome Outcome
	// Status and Body are the answer (Answered, Replayed; informative otherwise).
	Status int
	Body   string
	// Headers are the answer's stored headers that a replay must send again (Location, ETag,
	// or the SQL API's response_headers), canonical, as one string: part of the answer a replay
	// is compared with. "" when the harness sees none.
	Headers string
	// Attempt is the attempt (fencing token) whose answer this is, when the harness can tell:
	// its own for a fresh answer, the one named in the body for a replay; for Lost, the
	// attempt that was told it lost. 0 when unknown.
	Attempt int64
	// Live: the store answered in_progress for a lease claim of this very request (the SQL
	// API's outcome, which only a live lease gives), live for LiveFor more (its retry_after):
	// evidence that the key was held, and until when at least.
	Live    bool
	LiveFor time.Duration
	// Fenced: a Lost attempt whose store was refused (55000) and never retried, so its answer
	// was never stored: no replay may be its answer.
	Fenced bool
	// ProviderKey is the provider key the operation reported or used ("" unknown).
	ProviderKey string
	// Steps names the step effects a stepped answer claims ("a=12,b=13": each step of the work
	// with the id of the row it wrote), sorted by step; "" for work without steps. Checked
	// beside the model (stepEffects): each must exist, in the answer's generation.
	Steps string
	// Effect names the effect the answer claims ("deposit 17", "payout po_3"); "" for an
	// answer that names none (a final error).
	Effect string
	// Return is when the answer came back, since the history began; for Unknown, the end of
	// the history (Client gave up at GaveUp).
	Return time.Duration
	// GaveUp is when a client without an answer stopped waiting (Unknown), for the timeline.
	GaveUp time.Duration
	// StoreSent is when a client that stores the answer itself (the SQL API, the work of Do
	// and DoLease) sent what stores it: the answer was stored after it. Zero when unknown.
	// End turns it into StoredAfter.
	StoreSent time.Time
	// StoredAfter is StoreSent since the history began: a better bound than the call for when
	// an Answered operation's answer was stored. Zero: the call.
	StoredAfter time.Duration
	// RetryAfter is how long the answer asked the client to wait before it retries (HTTP
	// Retry-After); 0 when it did not say. A client that retries (Session.Retry) honours it.
	RetryAfter time.Duration
	// Note is a readable detail (an error).
	Note string
	// Effects are the effects found under the key afterwards (Observed).
	Effects []string
}

func (o Output) answer() string { return fmt.Sprintf("%d %s", o.Status, o.Body) }

// full is the answer with its stored headers: what a replay must repeat exactly.
func (o Output) full() string {
	if o.Headers == "" {
		return o.answer()
	}
	return fmt.Sprintf("%d [%s] %s", o.Status, o.Headers, o.Body)
}
