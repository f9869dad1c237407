package idemhttp

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
)

// A duplicate of a request that is still running waits for its answer, up to
// Options.DuplicateWait, without holding a connection, and then answers as the first did:
//
//   - on a transactional route the key's claim is uncommitted: the duplicate claims again,
//     which waits in Go on a holder of this process (the Gate) or on the row lock of another
//     process's holder (with a wait slot), and is answered the moment the holder commits;
//   - on a lease route the claim is committed and the holder works outside the database: the
//     duplicate waits on the key's watch, which the holder wakes when it records its answer
//     (a holder in this process) or which a look at the key every DefaultAnswerPoll wakes
//     (a holder elsewhere: one statement per round for every key waited on, paced), and
//     then claims again (a replay, or a takeover of a lease that ran out).
//
// Past the wait, 409 request_in_progress with a Retry-After that estimates the rest of the
// work (busy.retryAfter).

// busy is what a claim that found the key in progress knows.
type busy struct {
	lease      bool          // the holder is a lease claim (committed; the watch applies)
	leaseEnd   time.Time     // when the holder's lease ends by this process's clock, when known
	err        error         // the ErrInProgress of a transactional claim
	claimedAt  time.Time     // when the holder claimed, when the watch saw it
	arrived    time.Time     // when this request first claimed: the holder claimed before
	quick      bool          // the claim came back without waiting: pause before the next
	refused    bool          // the wait could not start: no wait slot, or the duplicates waiting here hold MaxWaitingBytes
	retryAfter time.Duration // set by the wait: the Retry-After of the final 409
}

// watchKey names one key.
type watchKey struct{ principal, key string }

// watches let the duplicates of lease requests wait for an answer together. One poller per
// Middleware looks at every key waited on in one statement per round (not one statement per
// key), and paces its rounds so that they take at most a tenth of its time: however many keys
// are waited on, the looks cost one connection a tenth of the time at most, and leave the lease
// slots to the heartbeats and answers of this process's own lease work.
type watches struct {
	mu      sync.Mutex
	keys    map[watchKey]*watch
	polling bool
}

// watch is one key's: changed is closed when the key may have an answer (its holder recorded
// one or gave its lease up, in this process; or a look at the key found it no longer held).
type watch struct {
	changed   chan struct{}
	waiters   int
	claimedAt time.Time // the holder's claim time, from the last look
}

func newWatches() *watches { return &watches{keys: map[watchKey]*watch{}} }

// signal wakes the duplicates of this process that wait on the key.
func (ws *watches) signal(id watchKey) {
	ws.mu.Lock()
	w := ws.keys[id]
	if w != nil {
		delete(ws.keys, id)
		close(w.changed)
	}
	ws.mu.Unlock()
}

// lookResult is what a look found of one key: whether it may have an answer now (it is no
// longer a lease in progress whose lease runs), and the holder's claim time when it is held.
type lookResult struct {
	changed   bool
	claimedAt time.Time
}

// look looks at keys at once.
type look func(ctx context.Context, ids []watchKey) (map[watchKey]lookResult, error)

// wait waits until the key's watch is woken or ctx ends; the first waiter of any key starts
// the poller, which ends when nobody waits any more.
func (ws *watches) wait(ctx context.Context, id watchKey, every time.Duration, lookAt look) (claimedAt time.Time, err error) {
	ws.mu.Lock()
	w := ws.keys[id]
	if w == nil {
		w = &watch{changed: make(chan struct{})}
		ws.keys[id] = w
	}
	w.waiters++
	if !ws.polling {
		ws.polling = true
		go ws.poll(every, lookAt)
	}
	ws.mu.Unlock()
	defer func() {
		ws.mu.Lock()
		w.waiters--
		claimedAt = w.claimedAt
		ws.mu.Unlock()
	}()
	select {
	case <-w.changed:
		return claimedAt, nil
	case <-ctx.Done():
		return claimedAt, ctx.Err()
	}
}

// maxLookBatch bounds the keys of one look statement.
const maxLookBatch = 1000

// poll looks at the waited keys round after round: a round every `every` at most, and after a
// round that took d, not before 9 d more have passed (up to four rounds' time).
func (ws *watches) poll(every time.Duration, lookAt look) {
	for {
		began := time.Now()
		ws.mu.Lock()
		var ids []watchKey
		for id, w := range ws.keys {
			if w.waiters == 0 {
				delete(ws.keys, id) // nobody waits: no look, no entry
				close(w.changed)
				continue
			}
			ids = append(ids, id)
		}
		if len(ids) == 0 {
			ws.polling = false
			ws.mu.Unlock()
			return
		}
		ws.mu.Unlock()
		for len(ids) > 0 {
			batch := ids[:min(len(ids), maxLookBatch)]
			ids = ids[len(batch):]
			ctx, cancel := context.WithTimeout(context.Background(), max(every, time.Second))
			found, err := lookSafely(ctx, lookAt, batch)
			cancel()
			if err != nil {
				continue // the next round looks again; each waiter has its own deadline
			}
			ws.mu.Lock()
			for id, r := range found {
				w := ws.keys[id]
				if w == nil {
					continue
				}
				w.claimedAt = r.claimedAt
				if r.changed {
					delete(ws.keys, id)
					close(w.changed)
				}
			}
			ws.mu.Unlock()
		}
		// Paced to a tenth of the time, but never so slow that a duplicate learns of an
		// answer later than four rounds after it.
		took := time.Since(began)
		time.Sleep(min(max(every-took, 9*took), 4*every))
	}
}

// lookAtKeys is the look of a Middleware: idem_key (granted to the application role) tells each
// key's state and lease without its body, all keys in one statement, which takes one of the
// lease slots, so that looks cannot hold the pool while the key table is locked.
func (m *Middleware) lookAtKeys(ctx context.Context, ids []watchKey) (map[watchKey]lookResult, error) {
	principals, keys := make([]string, len(ids)), make([]string, len(ids))
	for i, id := range ids {
		principals[i], keys[i] = id.principal, id.key
	}
	release, err := m.leaseSlots.take(ctx)
	if err != nil {
		return nil, err
	}
	defer release()
	rows, err := m.o.DB.Query(ctx, `SELECT w.p, w.k,
		coalesce(bool_or(k.state = 'in_progress' AND k.lease_expires_at > clock_timestamp()), false),
		(extract(epoch FROM max(k.claimed_at)) * 1000000)::bigint
		  FROM unnest($1::text[], $2::text[]) AS w(p, k)
		  LEFT JOIN LATERAL idem.idem_key(w.p, w.k) AS k ON true
		 GROUP BY w.p, w.k`, principals, keys)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	found := make(map[watchKey]lookResult, len(ids))
	for rows.Next() {
		var id watchKey
		var held bool
		// the claim's time in microseconds: no timestamp is read as text (D231)
		var claimedAt *int64
		if err := rows.Scan(&id.principal, &id.key, &held, &claimedAt); err != nil {
			return nil, err
		}
		r := lookResult{changed: !held}
		if claimedAt != nil {
			r.claimedAt = time.UnixMicro(*claimedAt)
		}
		found[id] = r
	}
	return found, rows.Err()
}

// awaitAnswer waits for the answer of the request that holds the key, up to until, and tells
// whether to claim again (true) or answer 409 (false, with b.retryAfter set).
func (q *request) awaitAnswer(ctx context.Context, claim dbidem.Claim, b *busy, until time.Time) bool {
	b.retryAfter = q.estimate(b)
	left := time.Until(until)
	if b.refused || left <= 0 || ctx.Err() != nil || q.m.work.draining.Err() != nil {
		return false
	}
	// The wait ends at until, when the client goes away, and when Shutdown starts.
	wctx, cancel := context.WithDeadline(ctx, until)
	defer cancel()
	defer context.AfterFunc(q.m.work.draining, cancel)()
	if !b.lease {
		if !b.quick {
			return true // the claim itself waited (in Go, or on the row lock): claim again
		}
		// No wait slot: pause before the next try, without a connection.
		return sleep(wctx, DefaultAnswerPoll)
	}
	if !q.m.gate.Hold(int64(len(q.body))) {
		b.refused = true
		return false // the duplicates waiting here hold enough already
	}
	defer q.m.gate.Unhold(int64(len(q.body)))
	claimedAt, err := q.m.watches.wait(wctx, watchKey{claim.Principal, claim.Key}, DefaultAnswerPoll, q.m.lookAtKeys)
	if !claimedAt.IsZero() {
		b.claimedAt = claimedAt
	}
	if err != nil {
		b.retryAfter = q.estimate(b)
		return false
	}
	q.changed = true
	return true
}

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

// estimate is the Retry-After of a 409 request_in_progress: the rest of the work, as this
// process knows it (the typical length of this action's work here, less how long the holder
// has worked), at least a second, at most the rest of the holder's lease. How long the holder
// has worked: since its claim, when a look at a lease's row saw it; else (a transactional
// holder, whose claim no other transaction can see) at least since this request came, which
// makes the estimate a little late, never early. Without a figure, a second: the retry waits
// for the answer again (DuplicateWait), which costs no connection.
func (q *request) estimate(b *busy) time.Duration {
	est := time.Second
	start := b.claimedAt
	if start.IsZero() {
		start = b.arrived
	}
	if typical := q.m.typical.get(q.action); typical > 0 && !start.IsZero() {
		est = max(typical-time.Since(start), time.Second)
	}
	if !b.leaseEnd.IsZero() {
		// What is left of the lease now: the 409 goes out after the wait, not when the
		// claim came back.
		est = min(est, max(time.Until(b.leaseEnd), time.Second))
	}
	return est
}

// typicals keeps, per action, a moving average of how long its work takes in this process: a
// lease's handler, a transactional unit of work from its claim to its commit.
type typicals struct {
	mu sync.Mutex
	m  map[string]time.Duration
}

func (t *typicals) add(action string, d time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m == nil {
		t.m = map[string]time.Duration{}
	}
	if old, ok := t.m[action]; ok {
		d = (old*7 + d) / 8
	} else if len(t.m) >= 1024 {
		return // actions are the routes: a bounded set; never grow without bound
	}
	t.m[action] = d
}

func (t *typicals) get(action string) time.Duration {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.m[action]
}

// waitable tells whether a failed claim found the key busy in a way that waiting may end: an
// ErrInProgress of the key (not a locked table, whose 503 comes at once, and not a full
// waiting room).
func waitable(err error) bool {
	return errors.Is(err, dbidem.ErrInProgress) && !errors.Is(err, dbidem.ErrStoreBusy) && !dbidem.IsFull(err)
}

// lookSafely is lookAt with a panic of the code it runs (the application's pool: a pgx tracer,
// a hook, a wrapper of its own) taken as a failed look: the poller is one goroutine of the
// middleware's, where a panic would end the process, and the next round looks again (D225).
func lookSafely(ctx context.Context, lookAt look, batch []watchKey) (found map[watchKey]lookResult, err error) {
	defer func() {
		if p := recover(); p != nil {
			found, err = nil, fmt.Errorf("idem: the look at waited keys panicked: %v", p)
		}
	}()
	return lookAt(ctx, batch)
}
