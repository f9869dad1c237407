package dbidem

import (
	"context"
	"errors"
	"fmt"
	"net"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Probe is the lock timeout of a claim's first try. A request of this process never waits
// on a key that another request of this process holds (the Gate makes it wait in Go); a
// claim that finds the key's row held longer than Probe (by another process) gives up,
// takes one of the Gate's wait slots and claims again with the rest of its lock timeout.
const Probe = 5 * time.Millisecond

// ClaimReplyMargin bounds how long a claim's statement may take beyond the lock timeout it
// waits on (its round trip, the server's execution), and a lease claim's COMMIT: past it the
// connection is taken for lost (black-holed: nothing comes back, nothing closes) and closed,
// and the claim fails (a lease claim's COMMIT: ErrCommitUnknown). Without it a request whose
// connection stopped answering waited until the kernel gave the connection up, holding the
// key's place in this process all along (D168). A claim's reply that is arriving when its
// bound passes (a large answer) has until no byte of it has come for ClaimReplyMargin
// (replyBound, D213).
const ClaimReplyMargin = 5 * time.Second

// leaseClaimIdle is the idle_in_transaction_session_timeout of a lease claim's own short
// transaction (D168): a client that lost its connection between the claim and its COMMIT
// (the claim's reply or the COMMIT black-holed) leaves the server a transaction holding the
// key's row; the server ends it, and the row, after this long idle, not when its TCP stack
// finally notices. A lease claim's client sends COMMIT as soon as the claim's reply is in.
const leaseClaimIdle = ClaimReplyMargin

// errNoReply is why a claim statement or a lease claim's COMMIT was given up: past
// ClaimReplyMargin beyond its lock timeout, nothing had come back.
var errNoReply = errors.New("idem: no reply from the database in time; the connection was taken for lost and closed")

// errNoConnection is why a lease claim's unit was given up while it waited for a connection
// from the pool: nothing was claimed, no connection was closed. IsNoReply reports it too: the
// store did not serve the claim within its bound, as for errNoReply.
var errNoConnection error = noConnectionError{}

type noConnectionError struct{}

func (noConnectionError) Error() string {
	return "idem: no connection from the pool within the lease claim's bound; nothing was claimed (a pool too small for its load?)"
}

func (noConnectionError) Is(target error) bool { return target == errNoReply }

// acquireCounter is an Acquirer that counts the calls of Acquire under way: a lease claim's
// unit tells by it whether its bound passed while it waited for the pool.
type acquireCounter struct {
	Acquirer
	n *atomic.Int32
}

func (a acquireCounter) Acquire(ctx context.Context) (*pgxpool.Conn, error) {
	a.n.Add(1)
	defer a.n.Add(-1)
	return a.Acquirer.Acquire(ctx)
}

var leaseClaimIdleSQL = fmt.Sprintf("SELECT pg_catalog.set_config('idle_in_transaction_session_timeout', '%d', true)",
	leaseClaimIdle.Milliseconds())

// The defaults of GateOptions.
const (
	// DefaultMaxWaitingClaims is how many claims may wait on a key's row lock at once.
	DefaultMaxWaitingClaims = 4
	// DefaultMaxWaitingBytes is how many bytes duplicates waiting in Go may hold at once.
	DefaultMaxWaitingBytes = 64 << 20
	// WaitOverhead is what a waiting duplicate counts beyond the bytes it holds: its
	// goroutine, its request and its connection's buffers.
	WaitOverhead = 4 << 10
)

// GateOptions configure a Gate. The zero value has the defaults.
type GateOptions struct {
	// MaxWaitingClaims bounds the claims that wait on a key's row lock (held by another
	// process) at once. 0: DefaultMaxWaitingClaims.
	MaxWaitingClaims int
	// MaxWaitingBytes bounds what the duplicates waiting in Go hold at once: each counts the
	// bytes it holds (RunHolding's held, its request body) plus WaitOverhead. A duplicate
	// that would take the total past it gets ErrInProgress at once, so a storm of large
	// duplicates cannot make the process hold more. 0: DefaultMaxWaitingBytes.
	MaxWaitingBytes int64
}

// Gate keeps a retry storm on one key from holding the connection pool:
//
//   - duplicates wait without a connection: a request whose (principal, key) another request
//     of this process is working on waits in Go until that one is done, and only then claims
//     (and replays, as a rule); past its lock timeout it gets ErrInProgress without touching
//     the database. So at most one connection per key and process waits on the key's row;
//   - waiting on a key's row lock (held by another process) takes one of a fixed number of
//     slots; a claim that finds them all taken gets ErrInProgress at once.
//
// The database stays the arbiter across processes. A Gate is safe for concurrent use. Its
// requests are lined up per pool and key: a Gate shared by pools of several databases (Do's
// default) keeps their keys apart, but its bounds (MaxWaitingClaims, MaxWaitingBytes) and the
// default lock timeout it reads once are shared; give a pool of its own settings a Gate of its
// own.
type Gate struct {
	mu      sync.Mutex
	flights map[flightKey]*flight
	// recent holds, for a moment (lineMemory), the keys whose last flight left with the
	// answer while requests waited for it: the next flight of the key starts knowing it,
	// whoever starts it (D260). swept is when recent was last swept of what is older.
	recent   map[flightKey]time.Time
	swept    time.Time
	slots    chan struct{}
	maxBytes int64
	lock     atomic.Int64 // the SQL API's default lock timeout once read, in nanoseconds

	waiting      atomic.Int64
	waitingBytes atomic.Int64
	coalesced    atomic.Uint64
	refused      atomic.Uint64
}

// flightKey names a key in one database: db is the pool the request runs on when it is a
// *pgxpool.Pool, so that a Gate shared by pools of several databases (Do's default) does not
// make a key of one wait for the same key of another. A pool of another type (a wrapper, made
// once or per call, by value or by pointer) tells nothing of its database: its keys are lined
// up with every other such pool's, as one pool's.
type flightKey struct {
	db             any
	principal, key string
}

// poolIdentity is db when it is a *pgxpool.Pool, else nil.
func poolIdentity(db any) any {
	if p, ok := db.(*pgxpool.Pool); ok && p != nil {
		return p
	}
	return nil
}

// lineMemory is how long the Gate remembers that a key's line left it with its answer (Gate.recent):
// the moment between one flight's leaving and the next one's start, however slow a loaded
// machine makes it, not the answer's life.
const lineMemory = time.Second

// flight is the one request of this process that works on a key: done is closed when it
// leaves; answered, set before, tells the requests that wait for it that the key has its
// answer (the flight read a committed key: a replay, or another request's answer, a mismatch;
// or it committed its own claim with its answer); claimed is closed when the flight's claim
// takes the key (its work runs), or finds the key's row held by a request elsewhere (in
// progress, not answered). after, set as it starts, tells that it started behind a flight that
// left the key with its answer (its request waited for that flight and saw it leave): a
// request that comes into the line later, and so never saw that flight leave, knows as much as
// the requests that did (D234). waited, guarded by the Gate's mutex, is set when a request
// waits for it.
type flight struct {
	done     chan struct{}
	answered atomic.Bool
	after    bool
	claimed  chan struct{}
	waited   bool
}

func newFlight(after bool) *flight {
	return &flight{done: make(chan struct{}), claimed: make(chan struct{}), after: after}
}

// NewGate returns a Gate with these options.
func NewGate(o GateOptions) *Gate {
	if o.MaxWaitingClaims <= 0 {
		o.MaxWaitingClaims = DefaultMaxWaitingClaims
	}
	if o.MaxWaitingBytes <= 0 {
		o.MaxWaitingBytes = DefaultMaxWaitingBytes
	}
	return &Gate{flights: map[flightKey]*flight{}, recent: map[flightKey]time.Time{}, slots: make(chan struct{}, o.MaxWaitingClaims),
		maxBytes: o.MaxWaitingBytes}
}

// Waiting is how many requests wait in Go for another request of this process with the same
// key, or (Hold) for an answer outside the Gate (a gauge).
func (g *Gate) Waiting() int64 { return g.waiting.Load() }

// WaitingBytes is what the requests counted by Waiting hold, as MaxWaitingBytes counts it (a
// gauge).
func (g *Gate) WaitingBytes() int64 { return g.waitingBytes.Load() }

// LockWaits is how many claims hold a wait slot: they wait on a key's row lock held by
// another process (a gauge).
func (g *Gate) LockWaits() int { return len(g.slots) }

// Coalesced counts the requests that found their key in flight in this process and waited.
func (g *Gate) Coalesced() uint64 { return g.coalesced.Load() }

// Refused counts the requests answered ErrInProgress without waiting on the database: their
// wait in Go ran out, the duplicates waiting in Go already held MaxWaitingBytes, or every
// wait slot was taken.
func (g *Gate) Refused() uint64 { return g.refused.Load() }

// errBusyHere and errNoSlot are the two ErrInProgress a Gate gives without the database.
var (
	errBusyHere = fmt.Errorf("%w: another request of this process holds the key", ErrInProgress)
	errFull     = fmt.Errorf("%w: the duplicates waiting in this process hold too much already", ErrInProgress)
	errNoSlot   = fmt.Errorf("%w: every wait slot is taken", ErrInProgress)
)

// IsNoSlot tells whether err is the ErrInProgress of a claim that found the key's row held by
// another process and every wait slot taken: waiting would hold a connection more.
func IsNoSlot(err error) bool { return errors.Is(err, errNoSlot) }

// IsRefusedByGate tells whether err is an ErrInProgress that a Gate gave without asking the
// database.
func IsRefusedByGate(err error) bool {
	return errors.Is(err, errBusyHere) || errors.Is(err, errFull) || errors.Is(err, errNoSlot)
}

// enter makes the caller the one request of this process that works on (principal, key),
// waiting at most bound for another to leave. While it waits it counts held + WaitOverhead
// bytes toward MaxWaitingBytes; when that would pass the bound it does not wait. Once a flight
// it waited for left the key with its answer (or the flight it found started behind one that
// did: flight.after), the bound no longer ends its wait while the request ahead of it only
// reads that answer: it reads it next (one replay after another, the last of a storm of a
// hundred ran out of its wait in that line, D211); only a request ahead that claims the key
// afresh (it expired or was released meanwhile), or finds it held by a request elsewhere
// (flight.claimed), ends the wait at the bound; so does a request ahead that has not left
// ClaimReplyMargin after the bound or after the flight before it. The end of ctx ends the wait
// alike: at once for a key with no answer yet, as the bound does for an answered one (D270).
func (g *Gate) enter(ctx context.Context, db any, principal, key string, bound time.Duration, held int64) (*pass, error) {
	id := flightKey{poolIdentity(db), principal, key}
	var deadline <-chan time.Time
	weight := held + WaitOverhead
	stopWaiting := func() {
		g.waiting.Add(-1)
		g.waitingBytes.Add(-weight)
	}
	answered, over := false, false
	ended := ctx.Done()
	for {
		g.mu.Lock()
		f, busy := g.flights[id]
		if !busy {
			// A request that starts the key's next flight, whether it waited in the line or
			// came in between two flights, knows what the line's last flight read (D260).
			after := answered
			if at, ok := g.recent[id]; ok {
				delete(g.recent, id)
				after = after || time.Since(at) < lineMemory
			}
			f = newFlight(after)
			g.flights[id] = f
		} else {
			f.waited = true
		}
		g.mu.Unlock()
		// A request that came into the line behind a flight that started after an answer
		// knows the key has one, as the requests that saw it leave do (D234).
		answered = answered || f.after
		if !busy {
			if deadline != nil || over {
				stopWaiting()
			}
			return &pass{g: g, id: id, f: f}, nil
		}
		if deadline == nil && !over {
			if g.waitingBytes.Add(weight) > g.maxBytes {
				g.waitingBytes.Add(-weight)
				g.countRefused(ctx)
				return nil, errFull
			}
			g.waiting.Add(1)
			g.countCoalesced(ctx)
			timer := time.NewTimer(bound)
			defer timer.Stop()
			deadline = timer.C
		}
		// Past the bound, the wait goes on only while the request ahead reads the answer, which
		// takes it moments: one that has not left ClaimReplyMargin after (its COMMIT
		// black-holed, a pool without a connection for it) does more than read.
		var claimed <-chan struct{}
		var stalled <-chan time.Time
		var st *time.Timer
		if over {
			claimed = f.claimed
			st = time.NewTimer(ClaimReplyMargin)
			stalled = st.C
		}
		select {
		case <-f.done:
			if st != nil {
				st.Stop()
			}
			answered = answered || f.answered.Load()
		case <-claimed:
			st.Stop() // set with claimed
			stopWaiting()
			g.countRefused(ctx)
			return nil, errBusyHere
		case <-stalled:
			stopWaiting()
			g.countRefused(ctx)
			return nil, errBusyHere
		case <-deadline:
			deadline = nil
			select {
			case <-f.claimed:
			default:
				if answered {
					over = true
					continue
				}
			}
			stopWaiting()
			g.countRefused(ctx)
			return nil, errBusyHere
		case <-ended:
			if st != nil {
				st.Stop()
			}
			if answered {
				// The key has its answer, which the request ahead reads in moments: a wait
				// that its context ended (Shutdown's start, the client gone) reads it too, as
				// one past its bound does, where it was told 409 request_in_progress for an
				// answered key (D270). The reading runs on the work's context.
				ended, over = nil, true
				continue
			}
			stopWaiting()
			return nil, fmt.Errorf("%w: %w", errWaitEnded, ctx.Err())
		}
	}
}

// pass is a request's way through the Gate: the flight of its key.
type pass struct {
	g  *Gate
	id flightKey
	f  *flight
}

// claimed is called when the request's claim took the key (a fresh claim, or a takeover), or
// found its row held by a request elsewhere: the requests that wait for it past their bound
// stop waiting (its work, or the other's, may take long).
func (p *pass) claimed() {
	select {
	case <-p.f.claimed:
	default:
		close(p.f.claimed)
	}
}

// leave ends the pass. returned: the unit of work returned (not a panic); committed: without
// an error; outcome: the decision of its last run. The key has its answer when the flight read
// a committed key (a replay, or another request's answer: a mismatch), whatever its caller made
// of it (Do returns ErrMismatch for a mismatch), or committed a transactional claim with it;
// told as the flight leaves, once its transaction has ended (a flight whose COMMIT hangs has
// told nothing, and the requests behind it keep their bound).
func (p *pass) leave(returned, committed bool, outcome Outcome, lease bool) {
	g := p.g
	answered := returned && (outcome == Replay || outcome == Mismatch || committed && outcome == Claimed && !lease)
	if answered {
		p.f.answered.Store(true)
	}
	now := time.Now()
	g.mu.Lock()
	delete(g.flights, p.id)
	// A line's flight that leaves the key answered: whoever starts the next flight, one of
	// the requests that waited or one that came in just now, starts it knowing (D260). Only
	// a line's (a flight that was waited for, or started knowing: a newcomer's in a line's
	// gap, which passes the note on): a key nobody waited for is not remembered.
	if answered && (p.f.waited || p.f.after) {
		g.recent[p.id] = now
	}
	if len(g.recent) > 0 && now.Sub(g.swept) > lineMemory {
		for id, at := range g.recent {
			if now.Sub(at) >= lineMemory {
				delete(g.recent, id)
			}
		}
		g.swept = now
	}
	g.mu.Unlock()
	close(p.f.done)
}

// Tally is what a Gate did for one request over several runs (a caller that claims again
// until it has an answer): the Gate marks it instead of counting Coalesced and Refused, and
// the caller counts the request once, with AddTally, when it knows its answer.
type Tally struct {
	// Coalesced: the request waited in Go for another request of this process with its key.
	Coalesced bool
	// Refused: the Gate refused the request without the database at least once.
	Refused bool
}

// tallyKey names the Tally of one Gate in a context: a context that carries a request's Tally
// for the middleware's Gate also reaches its handler, and another Gate there (a Job's, for an
// idem.Do the handler calls) counts in its own figures, not in the request's Tally.
type tallyKey struct{ g *Gate }

// WithTally returns ctx with t, which this Gate's Run and RunDetached mark instead of counting.
func (g *Gate) WithTally(ctx context.Context, t *Tally) context.Context {
	return context.WithValue(ctx, tallyKey{g}, t)
}

func (g *Gate) countCoalesced(ctx context.Context) {
	if t, ok := ctx.Value(tallyKey{g}).(*Tally); ok {
		t.Coalesced = true
		return
	}
	g.coalesced.Add(1)
}

func (g *Gate) countRefused(ctx context.Context) {
	if t, ok := ctx.Value(tallyKey{g}).(*Tally); ok {
		t.Refused = true
		return
	}
	g.refused.Add(1)
}

// AddTally counts one request: Coalesced if it waited in Go, Refused if its final answer was a
// refusal (answeredBusy) after the Gate refused it at least once.
func (g *Gate) AddTally(t *Tally, answeredBusy bool) {
	if t.Coalesced {
		g.coalesced.Add(1)
	}
	if t.Refused && answeredBusy {
		g.refused.Add(1)
	}
}

// Hold counts bytes held by a duplicate that waits for an answer outside the Gate (a lease
// route's duplicate, which waits without a connection for the holder's answer) toward
// MaxWaitingBytes, as a wait in Go does; false, and nothing counted, when that would pass the
// bound (the caller counts the refusal, with AddTally). Release it with Unhold.
func (g *Gate) Hold(held int64) bool {
	weight := held + WaitOverhead
	if g.waitingBytes.Add(weight) > g.maxBytes {
		g.waitingBytes.Add(-weight)
		return false
	}
	g.waiting.Add(1)
	return true
}

// Unhold ends what Hold counted.
func (g *Gate) Unhold(held int64) {
	g.waitingBytes.Add(-(held + WaitOverhead))
	g.waiting.Add(-1)
}

// IsFull tells whether err is the ErrInProgress a Gate gives when the duplicates waiting in
// this process already hold MaxWaitingBytes: waiting longer would hold more.
func IsFull(err error) bool { return errors.Is(err, errFull) }

// LockTimeout is c.LockTimeout, or the SQL API's default (read once from db, its reply within
// ClaimReplyMargin, or IsNoReply's error) when it is 0; a
// negative one, or one above MaxLockTimeout, is ErrInvalidArgument, whether or not the claim
// would wait (the SQL API refuses it only when it is sent, on a wait).
func (g *Gate) LockTimeout(ctx context.Context, db Acquirer, c Claim) (time.Duration, error) {
	if c.LockTimeout < 0 || c.LockTimeout > MaxLockTimeout { // the SQL API refuses it (22023)
		return 0, fmt.Errorf("%w: LockTimeout must be positive and at most %s, got %s", ErrInvalidArgument, MaxLockTimeout, c.LockTimeout)
	}
	if c.LockTimeout > 0 {
		return c.LockTimeout, nil
	}
	if d := g.lock.Load(); d > 0 {
		return time.Duration(d), nil
	}
	conn, err := db.Acquire(ctx)
	if err != nil {
		return 0, err
	}
	defer conn.Release()
	// The read waits on no lock: its reply has ClaimReplyMargin, as a claim statement's has (a
	// caller's context may have no deadline: a lease's work, the middleware's).
	rctx, cancel := context.WithTimeoutCause(ctx, ClaimReplyMargin, errNoReply)
	defer cancel()
	d, err := ReadDefaults(rctx, conn)
	if err != nil {
		if context.Cause(rctx) == errNoReply && ctx.Err() == nil {
			return 0, fmt.Errorf("%w (%w)", err, errNoReply)
		}
		return 0, err
	}
	g.lock.Store(int64(d.LockTimeout))
	return d.LockTimeout, nil
}

// Run runs a unit of work that starts with a claim of c: fn gets the transaction and the
// decision (fn sees only decisions, never a lock wait), as in RunTx. Requests of this
// process with the same key run one at a time (the others wait in Go, up to the lock
// timeout); a claim that finds the key held by another process waits on the database only
// with a wait slot. Past the lock timeout, or without a slot, Run returns ErrInProgress.
func (g *Gate) Run(ctx context.Context, db Acquirer, opts TxOptions, c Claim, fn func(tx *Tx, d Decision) error) error {
	return g.RunHolding(ctx, db, opts, c, 0, fn)
}

// RunHolding is Run for a caller that holds held bytes (a request body) while it waits in
// Go: they count toward GateOptions.MaxWaitingBytes.
func (g *Gate) RunHolding(ctx context.Context, db Acquirer, opts TxOptions, c Claim, held int64, fn func(tx *Tx, d Decision) error) error {
	return g.RunDetached(ctx, ctx, db, opts, c, held, fn)
}

// RunDetached is RunHolding with two contexts: wait bounds the waits for another request with
// the same key, in Go and on the key's row lock (a caller whose client went away stops
// waiting; the error then wraps wait's), and work runs the unit of work itself, the claim, fn
// and the commit (work that must outlive the client runs on a context that the client's
// leaving does not end). A claim's first try, which waits at most Probe on any lock, is not a
// wait on another holder: it runs to its end under work whatever becomes of wait (D161).
// For a lease claim (c.Lease set) fn must return at once (the lease's work runs after the
// claim commits): the unit, the claim and its COMMIT, is bounded (ClaimReplyMargin), and the
// server ends its transaction once idle that long (D168).
func (g *Gate) RunDetached(wait, work context.Context, db Acquirer, opts TxOptions, c Claim, held int64, fn func(tx *Tx, d Decision) error) (err error) {
	defer func() {
		// fn's own error goes back as fn returned it (the mark is for the decisions here).
		if w, ok := err.(workError); ok {
			err = w.err
		}
	}()
	ctx := work
	lockTimeout, err := g.LockTimeout(ctx, db, c)
	if err != nil {
		return err
	}
	entered := time.Now()
	p, err := g.enter(wait, db, c.Principal, c.Key, lockTimeout, held)
	if err != nil {
		return err
	}
	// The wait in Go counts toward the lock timeout: what is left of it bounds the wait on
	// the key's row, and a request whose wait is over (it waited on past it for an answer)
	// only probes. A duplicate waited a lock timeout in Go, then another on the row.
	lockTimeout = max(lockTimeout-time.Since(entered), Probe)
	// The decision of the last run tells the pass what became of the key (pass.leave); only a
	// unit that returned counts (one whose fn panicked answered nothing).
	var last Decision
	returned := false
	work0 := fn
	fn = func(tx *Tx, d Decision) error {
		last = d
		if d.Outcome == Claimed {
			p.claimed()
		}
		return work0(tx, d)
	}
	defer func() { p.leave(returned, err == nil, last.Outcome, c.Lease != 0) }()
	err = g.runGated(wait, work, ctx, db, opts, c, lockTimeout, p.claimed, fn)
	returned = true
	return err
}

// runGated is RunDetached's unit of work, once the request has its pass through the Gate: the
// probe, and the claim that waits on the key's row with a wait slot.
func (g *Gate) runGated(wait, work, ctx context.Context, db Acquirer, opts TxOptions, c Claim, lockTimeout time.Duration,
	keyHeld func(), fn func(tx *Tx, d Decision) error) (err error) {
	// active is the bound of the claim statement under way, if any.
	var active atomic.Pointer[replyBound]
	// claimed, for a lease claim, gives its COMMIT ClaimReplyMargin from the claim's answer.
	// ended ends the bound of a claim statement; for a lease claim whose statement kept the
	// unit's bound going past its end (its reply arriving, or the statement under way when the
	// bound passed, D237), it gives what follows (a COMMIT, the claim that waits on the key
	// after a probe, with its ROLLBACK and a connection again, a run again) the same margin.
	claimed := func() {}
	var giveUp func(error) // ends a lease claim's unit
	ended := func(b *replyBound) {
		active.CompareAndSwap(b, nil)
		b.stop()
	}
	if c.Lease != 0 {
		// A lease claim's unit is the claim and its COMMIT (fn returns at once; the work runs
		// after): all of it is bounded, its probes, its wait on the key's row, and its COMMIT,
		// which past the bound is ErrCommitUnknown (D168).
		lctx, cancel := context.WithCancelCause(work)
		var acquiring atomic.Int32
		db = acquireCounter{db, &acquiring}
		// until is the bound's end; a firing before it (the timer was moved on as it fired)
		// does nothing.
		var mu sync.Mutex
		var bound *time.Timer
		var deferredTo *replyBound // the statement the bound last waited for, under mu
		first := lockTimeout + Probe*time.Duration(len(tableBusyPauses)+1) + time.Second + ClaimReplyMargin
		until := time.Now().Add(first)
		moveTo := func(d time.Duration) { until = time.Now().Add(d); bound.Reset(d) }
		mu.Lock()
		bound = time.AfterFunc(first, func() {
			mu.Lock()
			defer mu.Unlock()
			if time.Now().Before(until) {
				return
			}
			// A claim statement under way keeps its unit while its own bound has not ended
			// (D237): the statement was sent late (after a wait for a pool connection) and
			// waits within its lock timeout, or its reply (a large answer) is arriving (D213).
			if b := active.Load(); b != nil && b.live() {
				deferredTo = b
				moveTo(replyTick)
				return
			}
			if acquiring.Load() > 0 {
				cancel(errNoConnection)
				return
			}
			cancel(errNoReply)
		})
		mu.Unlock()
		defer func() { bound.Stop(); cancel(nil) }()
		ctx = lctx
		giveUp = cancel
		claimed = func() { mu.Lock(); moveTo(ClaimReplyMargin); mu.Unlock() }
		ended = func(b *replyBound) {
			// Under mu: the bound's next look sees the statement either under way or ended
			// with the margin given.
			mu.Lock()
			defer mu.Unlock()
			extended := b.stop()
			active.CompareAndSwap(b, nil)
			if (extended || deferredTo == b) && time.Until(until) < ClaimReplyMargin {
				moveTo(ClaimReplyMargin)
			}
		}
		defer func() {
			if cause := context.Cause(ctx); err != nil && (cause == errNoReply || cause == errNoConnection) && !errors.Is(err, cause) {
				err = fmt.Errorf("%w (%w)", err, cause)
			}
		}()
	}
	// claimCtx bounds one claim statement: the lock timeout it may wait, and the margin; a
	// reply that is arriving by then has until its bytes stop coming (replyBound, D213).
	claimCtx := func(parent context.Context, tx *Tx, c Claim) (context.Context, context.CancelFunc) {
		var conn net.Conn
		if pc := tx.Conn(); pc != nil {
			conn = pc.PgConn().Conn()
		}
		bctx, b := newReplyBound(parent, conn, c.LockTimeout+ClaimReplyMargin)
		active.Store(b)
		return bctx, func() { ended(b) }
	}
	// A wait slot is held for the claim statement that waits on the key's row, not for the
	// work after it (a handler, a COMMIT): taken before RunTx (no slot, no connection), freed
	// as the claim returns, taken again by a run after a serialization failure.
	slotHeld := false
	takeSlot := func() bool {
		select {
		case g.slots <- struct{}{}:
			slotHeld = true
			return true
		default:
			return false
		}
	}
	freeSlot := func() {
		if slotHeld {
			slotHeld = false
			<-g.slots
		}
	}
	// worked: the last run claimed and ran fn, so its error (fn's, or its COMMIT's: a deferred
	// constraint's lock timeout) is the work's, never a probe's meeting a locked table.
	var worked bool
	unit := func(c Claim, waits bool) func(tx *Tx) error {
		return func(tx *Tx) error {
			worked = false
			if start, _ := ctx.Value(attemptStartKey{}).(func()); start != nil {
				start()
			}
			// A lease claim's unit is the claim and its COMMIT: fn returns at once (the
			// callers of RunDetached run a lease's work after it), so the server may end
			// the transaction once idle (Tx.leaseUnit).
			tx.leaseUnit = c.Lease != 0
			if tx.leaseUnit {
				// What fn sends before it returns (the middleware's asks under an earlier
				// release's fingerprint) is bounded as the claim statements are.
				tx.bounded = func(wait time.Duration) (context.Context, context.CancelFunc) {
					bctx, done := claimCtx(ctx, tx, Claim{LockTimeout: wait})
					return bctx, func() {
						lost := context.Cause(bctx) == errNoReply
						done()
						if lost {
							giveUp(errNoReply)
							return
						}
						// What follows (the next ask, the COMMIT) gets the margin from here,
						// as after the claim's answer: an ask that ended just inside the
						// unit's bound left the COMMIT what remained of it.
						claimed()
					}
				}
			}
			if !waits {
				// A probe: its claim statement waits at most Probe on any lock, so it runs
				// to its end whatever becomes of wait. Ending it would turn a fresh claim
				// under way into a false "in progress" (a shutdown's drain ends every wait).
				pctx, done := claimCtx(ctx, tx, c)
				d, err := tx.Claim(pctx, c)
				if err != nil && context.Cause(pctx) == errNoReply {
					err = fmt.Errorf("%w (%w)", err, errNoReply)
				}
				done()
				if err != nil {
					return err
				}
				claimed()
				worked = true
				return tx.work(fn, d)
			}
			// The claim statement waits on the key's row lock: that wait, like the one in Go,
			// ends with wait (a caller whose client went away, a shutdown); the work after
			// the claim does not.
			if !slotHeld && !takeSlot() {
				// A run again (after a serialization failure) finds every slot taken: it
				// claims as a probe does, and is refused only when it would have to wait.
				pc := c
				pc.LockTimeout = min(Probe, c.LockTimeout)
				pctx, done := claimCtx(ctx, tx, pc)
				d, err := tx.Claim(pctx, pc)
				if err != nil && context.Cause(pctx) == errNoReply {
					err = fmt.Errorf("%w (%w)", err, errNoReply)
				}
				done()
				switch {
				case err != nil && isLockTimeout(err) && IsKeyWait(err):
					g.countRefused(ctx)
					return errNoSlot
				case err != nil:
					return err
				}
				claimed()
				worked = true
				return tx.work(fn, d)
			}
			defer freeSlot()
			cctx, cancel := claimCtx(ctx, tx, c)
			sent := make(chan struct{})
			var unsent error
			stop := context.AfterFunc(wait, func() {
				defer close(sent)
				// The server learns of it by a cancel request, sent first, while the
				// connection is still whole: a backend blocked on a lock does not read its
				// socket, and would wait on for the rest of its lock timeout.
				cr, done := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
				defer done()
				unsent = tx.Conn().PgConn().CancelRequest(cr)
				if unsent == nil && cr.Err() != nil {
					// CancelRequest returns nil when the server's confirmation (its closing
					// the cancel connection) does not come before cr ends.
					unsent = cr.Err()
				}
				cancel()
			})
			d, err := tx.Claim(cctx, c)
			freeSlot() // the wait on the key's row is over: the work after it holds no slot
			if !stop() {
				// The cancel request is under way. The server acts on it whenever it
				// arrives, so the connection runs nothing more until the server has it
				// (CancelRequest returns then): a backend that is idle by then ignores it,
				// where it would otherwise cancel the work's next statement or, once the
				// connection is back in the pool, another request's.
				<-sent
				if unsent != nil {
					// Not confirmed within a second (a slow path to the server, a pooler
					// that forwards it late): it may still arrive. The connection runs
					// nothing more; closing it rolls the claim back, and the pool drops it.
					cancel()
					closing, done := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
					_ = tx.Conn().PgConn().Close(closing)
					done()
					// unsent is told, not wrapped: its DeadlineExceeded is the cancel
					// request's second, not the caller's deadline.
					return fmt.Errorf("%w: %w: the cancel request to stop the claim's wait was not confirmed (%v); the connection was closed",
						errWaitEnded, wait.Err(), unsent)
				}
			}
			if err != nil && context.Cause(cctx) == errNoReply {
				err = fmt.Errorf("%w (%w)", err, errNoReply)
			}
			cancel()
			if err != nil {
				if wait.Err() != nil && ctx.Err() == nil {
					return fmt.Errorf("%w: %w: %w", errWaitEnded, wait.Err(), err)
				}
				return err // a wait the server ended before its lock timeout is ErrInProgress (claimError)
			}
			claimed()
			worked = true
			return tx.work(fn, d)
		}
	}
	first := c
	first.LockTimeout = min(Probe, lockTimeout)
	err = RunTx(ctx, db, opts, unit(first, false))
	// A probe can also time out on a lock that is not the key's: the table's extension lock
	// under load (a blip), or a lock on the whole table (a migration's swap, VACUUM FULL,
	// pg_repack, LOCK TABLE). That says nothing about the key, so the probe runs again a few
	// times, a little later each time (tableBusyPauses).
	// Only a lock timeout (55P03) is a probe's: fn's own errors pass through as they are,
	// ErrInProgress too (Do and DoLease return it for a claim another process holds and has
	// committed, which no probe waited for), or every duplicate of running lease work was
	// claimed four times and told the table was locked.
	// These probes and their pauses (50 ms in all) are the first try's, not a wait on another
	// holder: they run under work whatever becomes of wait (D161). A fresh key whose probe met
	// a blip just as Shutdown began its drain (which ends wait) was told the table was locked,
	// 503, where the drain serves fresh keys.
	for _, pause := range tableBusyPauses {
		if !isLockTimeout(err) || IsKeyWait(err) || isWork(err) || worked {
			break
		}
		if !sleep(ctx, pause) {
			return ctx.Err()
		}
		err = RunTx(ctx, db, opts, unit(first, false))
	}
	if isLockTimeout(err) && !IsKeyWait(err) && !isWork(err) && !worked {
		// The table is locked: waiting for it would hold a connection for the whole lock
		// timeout, and every other request's with it. Answer now; the caller retries later.
		// Not counted as refused: Refused counts duplicates told the key is in progress
		// without waiting on the database (409s), and this is ErrStoreBusy (a 503), as the
		// middleware's tally already counted it.
		// The lock timeout itself is wrapped, not the ErrInProgress around it: the key was
		// never in progress, and a caller that tests for ErrInProgress first (Do's) must not
		// read a locked table as a key another process holds.
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) {
			return fmt.Errorf("%w: %w", ErrStoreBusy, pgErr)
		}
		return fmt.Errorf("%w: %w", ErrStoreBusy, err)
	}
	if IsKeyWait(err) && !isWork(err) && !worked {
		// A request elsewhere holds the key's row: the key is in progress, not answered, and
		// the requests behind this one in the Gate wait no longer than their bound.
		keyHeld()
	}
	if !IsKeyWait(err) || isWork(err) || worked || lockTimeout <= Probe {
		return err
	}
	if wait.Err() != nil {
		// The caller stopped waiting during the probe: it does not wait on the key's row.
		return fmt.Errorf("%w: %w: %w", errWaitEnded, wait.Err(), err)
	}
	rest := c
	rest.LockTimeout = lockTimeout - Probe
	if !takeSlot() {
		g.countRefused(ctx)
		return errNoSlot
	}
	defer freeSlot()
	return RunTx(ctx, db, opts, unit(rest, true))
}

// attemptStartKey marks a work context that carries a function RunDetached calls as each run
// of its unit of work starts (WithAttemptStart).
type attemptStartKey struct{}

// WithAttemptStart returns work with start, which RunDetached calls at the start of each run of
// its unit of work, before the claim: each try of the claim, and each run again after a
// serialization failure or a deadlock. A caller that keeps what a run decided (a decision, a
// count) forgets it there, so that a run whose claim fails leaves nothing of the run before.
func WithAttemptStart(work context.Context, start func()) context.Context {
	return context.WithValue(work, attemptStartKey{}, start)
}

// errWaitEnded marks the end of a wait for another holder of the key by the wait's context
// (RunDetached's wait: a client that went away, an outer deadline, Shutdown's drain).
var errWaitEnded = errors.New("idem: the wait for another holder of the key ended")

// IsWaitEnded tells whether err is a wait for another holder of the key that its wait context
// ended (in Go, or on the key's row), not a failure of the store.
func IsWaitEnded(err error) bool { return errors.Is(err, errWaitEnded) }

// IsNoReply tells whether err is a claim's or a lease's statement given up because the
// database did not answer within its bound (the connection taken for lost), or a lease claim
// given up while it still waited for a pool connection (errNoConnection): the store's
// failure, whatever context also ended meanwhile.
func IsNoReply(err error) bool { return errors.Is(err, errNoReply) }

// tableBusyPauses are the pauses before the probes that follow one that timed out on a lock
// other than the key's: about 50 ms in all, long enough for the table's extension lock under
// load, short enough that a locked table is answered at once.
var tableBusyPauses = []time.Duration{5 * time.Millisecond, 15 * time.Millisecond, 30 * time.Millisecond}

// sleep waits d or until ctx ends (false).
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// workError marks an error of the work after the claim (RunDetached's fn): a lock timeout of
// the handler's own statements says nothing of the key table, and the unit is not run again
// as a probe's would be (before, the handler ran up to five times and its client was told the
// table was locked for maintenance).
type workError struct{ err error }

func (e workError) Error() string { return e.err.Error() }
func (e workError) Unwrap() error { return e.err }

// asWork marks err (nil stays nil) as the work's.
func asWork(err error) error {
	if err == nil {
		return nil
	}
	return workError{err}
}

// work runs fn, the work after the claim, and marks its errors as the work's: its own, and a
// serialization failure, deadlock or lock timeout of its statements that RunTx runs the unit
// again for (Options.MaxAttempts), and returns once the attempts are spent.
func (tx *Tx) work(fn func(tx *Tx, d Decision) error, d Decision) error {
	err := fn(tx, d)
	if tx.retry != nil {
		tx.retry = asWork(tx.retry)
	}
	return asWork(err)
}

// isWork tells whether err came from the work after the claim.
func isWork(err error) bool {
	var w workError
	return errors.As(err, &w)
}

// IsKeyWait tells whether a lock timeout (55P03) came from waiting on a key's row: the wait
// for another transaction's claim of the key, or for its row lock. PostgreSQL names the row and
// the relation in the error's first context line ("while inserting index tuple (0,8) in
// relation "idempotency_keys"", "beim Einfügen von Indextupel (0,8) in Relation
// »idempotency_keys«" on a server with German messages); a timeout on any other lock (the
// table's, its extension's) has no such line. What decides is what no translation changes: a
// row's position, (block,offset), and the table's name.
//
// A claim that queues behind another waiter for the same row (a third request for a key whose
// holder re-claimed it after its expiry, its release or the end of its lease) waits on the
// row's tuple lock, which has no context line of its own: that timeout is recognised by its
// statement, idem_begin's locking read of the key's row (the innermost context is that
// statement's text, which no translation changes either; only the quotes around it differ).
// That read cannot wait for the table's lock: idem_begin's INSERT before it (D275) holds the
// table in ROW EXCLUSIVE mode already, so a LOCK TABLE stops the claim there, a 503.
func IsKeyWait(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "55P03" {
		return false
	}
	first, _, _ := strings.Cut(pgErr.Where, "\n")
	return rowPosition.MatchString(first) && strings.Contains(first, KeyTable) || isLockingRead(pgErr.Where)
}

// rowPosition matches a row's position in an error's context: (block,offset); with a space
// after the comma, as French messages write it ("lors de l'insertion de l'enregistrement
// (0, 3) de l'index dans la relation « idempotency_keys »"); or without parentheses at the
// line's start, as Korean ones do ("0,3 튜플 인덱스(해당 릴레이션 "idempotency_keys")를 삽입하는
// 중에 발생"). PostgreSQL 15's other translations write (block,offset).
var rowPosition = regexp.MustCompile(`\(\d+, ?\d+\)|^\d+,\d+ `)

// isLockingRead tells whether an error's context says it came from idem_begin's locking read
// of a key's row: the context lines before idem_begin's own (its statement's text, and on
// Citus the worker's line) end with that statement's FOR UPDATE and name the key table.
func isLockingRead(where string) bool {
	i := strings.Index(where, "idem_begin(")
	if i < 0 {
		return false
	}
	inner := where[:i]
	j := strings.LastIndexByte(inner, '\n')
	if j < 0 {
		return false
	}
	// The statement's closing quote, in any translation: `"`, `»` (German), ` »` (French, a
	// space inside), `”`, `」`.
	inner = strings.TrimRightFunc(inner[:j], func(r rune) bool { return unicode.IsSpace(r) || strings.ContainsRune("\"»«“”」", r) })
	return strings.HasSuffix(inner, "FOR UPDATE") && strings.Contains(inner, KeyTable)
}
