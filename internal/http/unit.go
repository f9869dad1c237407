package idemhttp

import (
	"bytes"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"runtime/debug"
	"strings"
	"time"

	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/dbidem"
)

// The unit of work: the handler runs in a transaction that, for a keyed request, also
// holds the key's claim; its answer decides whether to commit, store a final error, or roll
// back.

// verdict is what the handler's response means for its transaction.
type verdict int

const (
	commit   verdict = iota // 2xx: commit the work (and the key's response)
	final                   // a final error: roll the work back, store the answer
	rollBack                // anything else, or a panic: roll back, store nothing
)

// run calls the handler with a fresh recorder, body reader and state, on ctx; a panic is
// recovered and reported as rollBack.
func (q *request) run(ctx context.Context, tx *dbidem.Tx, keyed bool) (rec *recorder, st *state, v verdict) {
	st = &state{m: q.m, body: q.body, canonical: q.canonical, claim: q.claim, providerKey: q.providerKey}
	if tx != nil {
		st.tx = tx
	}
	rec = newRecorder(q.r.Method == http.MethodHead)
	r2 := q.r.WithContext(context.WithValue(ctx, stateKey{}, st))
	r2.Body = io.NopCloser(bytes.NewReader(q.body))
	r2.ContentLength = int64(len(q.body))
	defer func() {
		if p := recover(); p != nil {
			if p == http.ErrAbortHandler {
				panic(p)
			}
			q.m.o.Logger.Error("idem: handler panicked; rolled back", "panic", fmt.Sprint(p), "stack", string(debug.Stack()),
				"request_id", q.r.Header.Get(q.m.o.CorrelationHeader))
			rec, v = nil, rollBack
		}
	}()
	func() {
		defer rec.close() // a panic too: what the handler's goroutines write later goes nowhere
		q.next.ServeHTTP(rec, r2)
	}()
	if st.inProgress && rec.code() == http.StatusConflict {
		// Refuse(CodeInProgress) as the answer (not after a status the handler wrote first,
		// which stands: a 2xx sent commits, as it always does).
		return rec, st, rollBack
	}
	switch code := rec.code(); {
	case code >= 200 && code < 300:
		return rec, st, commit
	case keyed && code <= 599 && q.m.o.FinalStatus(code): // the key table stores 100 to 599
		return rec, st, final
	}
	return rec, st, rollBack
}

// errRollBack ends a unit of work without committing.
var errRollBack = errors.New("idem: roll back")

// unkeyed runs a declared route without idempotency: the same transaction for the handler,
// committed only for a 2xx.
func (q *request) unkeyed() {
	q.noKey = true
	if q.rt.Lease > 0 {
		// Work outside the database without a key: no claim, no retry safety (the client
		// chose), but a provider key of its own, so that no provider merges it with another.
		q.providerKey = randomProviderKey()
		// Counted for Shutdown since serve began (its body may still have been arriving).
		working, ok := q.m.work.begin()
		if !ok {
			// Shutdown's deadline has passed: the work would be ended as it starts. It does
			// not start, as a keyed request's claim is not made (D179).
			q.w.Header().Set("Retry-After", "1")
			q.m.problem(q.w, q.r, CodeShuttingDown, "this server is shutting down; the work did not start", nil)
			return
		}
		defer working()
		ctx, done := q.m.work.context(q.r.Context())
		defer done()
		// Bounded by the route's LeaseTimeout, as a keyed request's work is.
		timeout := q.rt.LeaseTimeout
		if timeout <= 0 {
			timeout = dbidem.DefaultLeaseTimeout
		}
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		// Steps (Step) without a recovery point: transactions of their own, nothing to resume.
		ctx = dbidem.WithSteps(ctx, dbidem.NewSteps(q.m.o.DB, nil, dbidem.Decision{}, nil, q.txOptions()))
		rec, _, _ := q.run(ctx, nil, false)
		if rec != nil && rec.status == 0 && ctx.Err() != nil {
			// The work was ended (Shutdown, the LeaseTimeout) and the handler wrote nothing:
			// not net/http's empty 200, which would say the work was done (D172).
			if errors.Is(context.Cause(ctx), ErrShutdown) {
				q.w.Header().Set("Retry-After", "1")
				q.m.problem(q.w, q.r, CodeShuttingDown, "this server shut down before the work answered", nil)
			} else {
				q.m.problem(q.w, q.r, CodeInternalError, "the work did not answer within the route's lease timeout", nil)
			}
			return
		}
		q.answer(rec)
		return
	}
	var rec *recorder
	err := dbidem.RunTx(q.r.Context(), q.m.o.DB, q.txOptions(), func(tx *dbidem.Tx) error {
		var v verdict
		rec, _, v = q.run(q.r.Context(), tx, false)
		if v != commit {
			return errRollBack
		}
		return nil
	})
	if err != nil && !errors.Is(err, errRollBack) {
		if errors.Is(err, dbidem.ErrCommitUnknown) {
			// No key: no retry can learn the outcome, and a retry may do the work again, so
			// no Retry-After invites one (on Citus also a deferred constraint of the work that
			// a worker refused at its one-phase COMMIT, which Citus reports alike: D175).
			q.m.o.Logger.Error("idem: unit of work failed", "error", err, "problem", CodeOutcomeUnknown,
				"request_id", q.r.Header.Get(q.m.o.CorrelationHeader))
			q.m.problem(q.w, q.r, CodeOutcomeUnknown, "the database did not confirm the request's COMMIT: it may or may not "+
				"have taken effect; it carried no "+q.m.o.KeyHeader+", so a retry may do it again", nil)
			return
		}
		q.storeError(err)
		return
	}
	q.answer(rec)
}

func (q *request) txOptions() dbidem.TxOptions {
	return dbidem.TxOptions{MaxAttempts: q.m.o.MaxAttempts}
}

// stored turns the handler's response into what is stored.
func (q *request) stored(rec *recorder, st *state) (dbidem.Response, bool) {
	h := http.Header{}
	sent := rec.headers()
	for _, name := range q.m.o.StoredHeaders {
		name = http.CanonicalHeaderKey(name)
		if v := sent[name]; len(v) > 0 {
			h[name] = v
		} else if _, ok := sent[name]; ok && name == "Content-Type" {
			// The handler set it to no value (w.Header()["Content-Type"] = nil), which keeps
			// net/http from sniffing one: stored so, and replayed so (D265).
			h[name] = []string{}
		}
	}
	if v := sent.Values("Content-Range"); len(v) > 0 && (rec.code() == http.StatusPartialContent ||
		rec.code() == http.StatusRequestedRangeNotSatisfiable) {
		// A 206's body is the part its Content-Range names (a 416's says what the whole is):
		// without it a replay is bytes whose place nothing tells, whatever the allowlist says.
		h["Content-Range"] = v
	}
	if v := sent.Values("Content-Length"); len(v) == 1 && rec.head && rec.body.Len() == 0 && validLength(v[0]) {
		// A HEAD's Content-Length is its GET's, and it has no body to be computed from again.
		h["Content-Length"] = v
	}
	body := rec.body.Bytes()
	if rec.head && len(body) > headKept {
		// net/http sends no body for a HEAD: what the handler wrote (its GET's body) is kept
		// only as far as it decides the answer's headers (D265).
		body = body[:headKept]
	}
	resp := dbidem.Response{Status: rec.code(), Header: h, Body: bytes.Clone(body), ResourceID: st.resourceID}
	big := false
	switch {
	case st.secret:
		resp.Body, resp.Withheld = nil, dbidem.WithheldOneTimeSecret
	case len(body) > q.m.o.MaxStoredBodyBytes && !rec.head:
		resp.Body, resp.Withheld, big = nil, dbidem.WithheldTooLarge, true
	}
	if v := sent.Values("Content-Encoding"); len(v) > 0 && resp.Withheld == "" {
		// The body is stored as the handler sent it: encoded (a compressing middleware inside
		// the route). Its encoding is part of it, whatever the allowlist says, or a replay
		// would be gzip bytes with nothing to say so.
		h["Content-Encoding"] = v
	}
	if resp.Withheld != "" && resp.ResourceID == "" {
		// A repeat cannot get the body: it gets the id of what was created instead, taken
		// from the body's top-level "id" (the Location header is the fallback at replay).
		resp.ResourceID = bodyID(rec.body.Bytes(), sent.Values("Content-Encoding"))
	}
	// Stored as text: what PostgreSQL's text cannot hold (U+0000, bytes that are not UTF-8,
	// which a body's "id" or SetResourceID may carry) would make every recording of the
	// answer fail (22021), and the key never get its answer (D168).
	resp.ResourceID = storableText(resp.ResourceID)
	return resp, big
}

// headKept is how much of a HEAD's body is stored: net/http sends none, but reads the body a
// handler writes to decide the answer's headers. It sniffs a Content-Type from the first 512
// bytes, and sets a Content-Length only for a body that fits its 2048-byte buffer: a replay
// that writes the first 2049 bytes (or the whole of a shorter body, in one write as the first
// answer was written) gets from net/http, and from a middleware outside this one, the headers
// the first answer got from the whole body. A HEAD's answer is then never withheld as too
// large (its repeats got 409 response_not_replayable), and its GET's body is not stored whole.
const headKept = 2049

// storableText is s with what PostgreSQL's text cannot hold, bytes that are not UTF-8 and
// U+0000, replaced by U+FFFD.
func storableText(s string) string {
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

// maxIDScan bounds how much of a decoded body bodyID reads for its "id".
const maxIDScan = 16 << 20

// bodyID is topLevelID of a response body as the handler sent it: decoded first when its
// Content-Encoding is gzip or deflate (a compressing middleware inside the route; deflate as
// zlib, or raw DEFLATE as some servers send it), reading at most maxIDScan bytes of the
// decoded body; "" for another encoding.
func bodyID(body []byte, encoding []string) string {
	var r io.Reader
	switch strings.ToLower(strings.TrimSpace(strings.Join(encoding, ","))) {
	case "", "identity":
		return topLevelID(bytes.NewReader(body))
	case "gzip", "x-gzip":
		zr, err := gzip.NewReader(bytes.NewReader(body))
		if err != nil {
			return ""
		}
		r = zr
	case "deflate":
		if zr, err := zlib.NewReader(bytes.NewReader(body)); err == nil {
			r = zr
		} else {
			r = flate.NewReader(bytes.NewReader(body))
		}
	default:
		return ""
	}
	return topLevelID(io.LimitReader(r, maxIDScan))
}

// topLevelID is the top-level "id" member of a JSON object body, a string or a number as
// written, or "".
func topLevelID(body io.Reader) string {
	dec := jsontext.NewDecoder(body)
	if tok, err := dec.ReadToken(); err != nil || tok.Kind() != '{' {
		return ""
	}
	for dec.PeekKind() == '"' {
		name, err := dec.ReadToken()
		if err != nil {
			return ""
		}
		if name.String() != "id" {
			if err := dec.SkipValue(); err != nil {
				return ""
			}
			continue
		}
		v, err := dec.ReadValue()
		switch {
		case err != nil:
			return ""
		case v.Kind() == '"':
			var s string
			if json.Unmarshal(v, &s) != nil {
				return ""
			}
			return s
		case v.Kind() == '0':
			return string(v)
		}
		return ""
	}
	return ""
}

// keyed runs a keyed request: claim, then the handler in the same transaction, then the
// completion (2xx) or the final answer (a final error) with COMMIT. A duplicate of a request
// still running waits for that request's answer and claims again (awaitAnswer), up to
// Options.DuplicateWait. It returns the request's main state. ctx is the request's, with the
// idem.request span when tracing.
func (q *request) keyed(ctx context.Context, claim dbidem.Claim) State {
	until := time.Now().Add(q.m.o.DuplicateWait)
	// The Gate's figures count this request once, however often it claims again. A lease
	// route's duplicate is not a coalesced one, whatever the timing: it waits on the lease's
	// answer, and a wait in the Gate's line behind the first request's claim is a part of its
	// claim (D246).
	tally := &dbidem.Tally{}
	ctx = q.m.gate.WithTally(ctx, tally)
	count := func(answeredBusy bool) {
		if claim.Lease > 0 {
			tally.Coalesced = false
		}
		q.m.gate.AddTally(tally, answeredBusy)
	}
	defer func() {
		if p := recover(); p != nil {
			count(false) // an aborted handler (http.ErrAbortHandler): counted as it waited
			panic(p)
		}
	}()
	arrived := time.Now()
	for {
		st, b := q.keyedOnce(ctx, claim, until)
		if b == nil {
			count(st == StateBusy)
			return st
		}
		b.arrived = arrived
		if !q.awaitAnswer(ctx, claim, b, until) {
			// refused: its wait could not start, or (a lease's duplicate, which waits without
			// the database) it ran out, as a transactional duplicate's wait in the Gate does
			if b.refused || b.lease && !time.Now().Before(until) {
				tally.Refused = true
			}
			count(true)
			q.m.o.Metrics.Count(q.action, StateBusy)
			q.inProgress(b.retryAfter)
			return StateBusy
		}
	}
}

// workContext is the context of a keyed request's unit of work: the request's values without
// its cancellation (the work outlives a client that goes away, so that its retry gets the
// answer), ended by Shutdown; and the function that starts, on a transactional route, the
// route's WorkTimeout once the key is claimed (the waits before the claim do not count), and the
// function that stops it before a run of the unit of work again (after a deadlock), whose wait
// and claim start afresh.
func (q *request) workContext(ctx context.Context) (wctx context.Context, claimed, unclaimed func(), end func()) {
	base, done := q.m.work.context(context.WithoutCancel(ctx))
	wctx, cancel := context.WithCancelCause(base)
	var timer *time.Timer
	claimed = func() {
		if q.rt.Lease > 0 || timer != nil {
			return // a lease's work has its own deadline (LeaseTimeout)
		}
		timeout := q.rt.WorkTimeout
		if timeout <= 0 {
			timeout = q.m.o.WorkTimeout
		}
		timer = time.AfterFunc(timeout, func() { cancel(context.DeadlineExceeded) })
	}
	unclaimed = func() {
		if timer != nil && timer.Stop() {
			timer = nil // it had not fired: the next claim starts it again
		}
	}
	return wctx, claimed, unclaimed, func() {
		if timer != nil {
			timer.Stop()
		}
		cancel(context.Canceled)
		done()
	}
}

// giveUpUnknownClaim gives up a lease claim whose COMMIT may or may not have landed (the
// connection was lost while it committed; the client is told outcome_unknown): had it landed,
// the key would stay in progress under a lease that no work holds, and the client's retry
// would wait the whole lease out before it could take the key over. idem_yield, fenced by the
// claim's token, gives it up at once (the retry runs the work, in the same generation, under
// the same provider key) or finds nothing, when the COMMIT did not land; a COMMIT still on its
// way is waited for first (dbidem.GiveUpUnknown, D168). It is tried again until it gets an
// answer, for as long as the lease at most, five seconds at most (D163).
func (q *request) giveUpUnknownClaim(ctx context.Context, claim dbidem.Claim, attempt int64) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), min(q.rt.Lease, 5*time.Second))
	defer cancel()
	if _, err := dbidem.GiveUpUnknown(ctx, q.m.o.DB, claim, attempt); err != nil && !errors.Is(err, dbidem.ErrClaimLost) {
		q.m.o.Logger.Warn("idem: a lease claim whose commit was not confirmed could not be given up; the key waits for its lease to run out",
			"error", err, "key_hash", KeyHash(claim.Principal, claim.Key), "request_id", q.r.Header.Get(q.m.o.CorrelationHeader))
	}
}

// keyedOnce claims once and answers, or returns what it knows of the holder of the key when
// the key is in progress and waiting may get its answer (nothing was answered then).
func (q *request) keyedOnce(ctx context.Context, claim dbidem.Claim, until time.Time) (State, *busy) {
	var (
		d        dbidem.Decision
		rec      *recorder
		v        verdict
		acquired bool
		counted  bool // acquired was counted (a lease's handler runs after)
		oversize bool
		connLost bool       // the handler answered a 5xx on a connection the database dropped
		done     trace.Span // idem.complete, while the answer is recorded
		worked   time.Time  // the last run's claim: its work's start
	)
	wctx, claimed, unclaimed, end := q.workContext(ctx)
	defer end()
	defer func() {
		if p := recover(); p != nil {
			// The handler aborted the response (http.ErrAbortHandler, which run passes on):
			// the claim rolled back with its unit of work, and counts as any panic's does.
			if acquired && !counted {
				q.m.o.Metrics.Count(q.action, StateAcquired)
			}
			panic(p)
		}
	}()
	// The waits on the key end with the client, and when Shutdown starts; but for a lease
	// route's duplicate woken by the key's change, whose claim now reads its answer (D270).
	waitCtx, stopWaiting := context.WithCancel(ctx)
	defer stopWaiting()
	if !q.changed {
		defer context.AfterFunc(q.m.work.draining, stopWaiting)()
	}
	if left := time.Until(until); left > 0 {
		// The last wait on the key ends with the duplicate's wait, not a lock timeout later.
		if lt, err := q.m.gate.LockTimeout(wctx, q.m.o.DB, claim); err == nil && left < lt {
			claim.LockTimeout = max(left, time.Millisecond)
		}
	}
	started := time.Now()
	_, claimSpan := q.startSpan(ctx, "idem.claim")
	// Each run decides afresh: a run after a deadlock may replay what another request
	// committed meanwhile, or fail to claim, and its claim was rolled back with the run before.
	fresh := dbidem.WithAttemptStart(wctx, func() {
		d, rec, oversize, acquired = dbidem.Decision{}, nil, false, false
		q.claim, q.earlierTakeover = nil, false
		unclaimed() // the WorkTimeout counts from this run's claim, not its wait
	})
	err := q.m.gate.RunDetached(waitCtx, fresh, q.m.o.DB, q.txOptions(), claim, int64(len(q.body)), func(tx *dbidem.Tx, dec dbidem.Decision) error {
		d, rec, oversize = dec, nil, false
		if d.Outcome == dbidem.Mismatch && q.rawHashed {
			if earlier, c, ok := q.earlierReleaseDecision(wctx, tx, claim, d); ok {
				d, claim = earlier, c // the key goes on under the fingerprint it was stored with
				q.earlierTakeover = d.Outcome == dbidem.Claimed
			}
		}
		endSpan(claimSpan, string(d.Outcome), nil) // a unit of work run again keeps the first
		claimSpan = nil
		if d.Outcome != dbidem.Claimed {
			return nil // replay, mismatch, in progress: nothing was written
		}
		acquired = true // counted once the transaction ended: an observer never runs inside it
		q.claimed.Store(true)
		claimed() // the route's WorkTimeout counts from here
		worked = time.Now()
		q.claim = &ClaimInfo{Principal: claim.Principal, Key: claim.Key, Attempt: d.Attempt,
			ProviderKey: d.ProviderKey, RecoveryPoint: d.RecoveryPoint}
		if q.rt.Lease > 0 {
			return nil // a lease claim commits on its own; the handler runs after
		}
		var st *state
		hctx, handlerSpan := q.startSpan(wctx, "idem.handler")
		rec, st, v = q.run(hctx, tx, true)
		endHandlerSpan(handlerSpan, rec, v)
		endSpan(done, "run_again", nil)
		_, done = q.startSpan(wctx, "idem.complete")
		if v == rollBack {
			// A 5xx of a handler whose statements met a connection the database dropped (a
			// backend terminated, a server shutting down, the network): the database failed
			// under the work, counted store_error. Not when the work's own context ended it
			// (its WorkTimeout, Shutdown's deadline), which pgx answers by closing the
			// connection too.
			connLost = rec != nil && rec.status >= 500 && tx.ConnLost() && wctx.Err() == nil
			return errRollBack
		}
		resp, big := q.stored(rec, st)
		oversize = big
		if v == commit {
			tx.CompleteOnCommit(resp)
		} else {
			tx.FinalOnCommit(resp)
		}
		return nil
	})
	// Whether Shutdown's deadline ended the work, read once (the tracker ends wctx the moment
	// the deadline is known). A claim it ended under way is not a failure, of the claim or the
	// store; nor is a wait that the drain ended (a bare context.Canceled) as the deadline passed.
	ended := errors.Is(context.Cause(wctx), ErrShutdown)
	shutDown := err != nil && !acquired && !errors.Is(err, dbidem.ErrStoreBusy) && ended
	if shutDown {
		endSpan(claimSpan, "shutdown", nil)
	} else {
		endSpan(claimSpan, "error", err) // the claim itself failed (in progress, the store)
	}
	if acquired {
		// Once per fresh claim, however often the unit of work ran; after its transaction
		// ended, so that no observer holds a connection, a row lock or the key's claim.
		q.m.o.Metrics.Count(q.action, StateAcquired)
		counted = true
	}
	switch {
	case errors.Is(err, errRollBack):
		endSpan(done, "rolled_back", nil)
		q.answer(rec)
		if connLost {
			q.m.o.Metrics.Count(q.action, StateStoreError) // on top of acquired
			return StateStoreError, nil
		}
		return StateAcquired, nil
	case err != nil && !acquired && q.r.Context().Err() != nil && !dbidem.IsNoReply(err) &&
		(waitable(err) || dbidem.IsWaitEnded(err) || errors.Is(err, context.Canceled)):
		// The request's context ended while this request waited for another with its key:
		// nothing was done. Usually the client went away, but an outer middleware's deadline
		// ends it too, with the client still waiting: it is told to retry (written to a client
		// that is gone, the answer costs nothing). Without an answer net/http would send an
		// empty 200, which a client takes for the operation's success.
		endSpan(done, "client_gone", err)
		q.m.o.Metrics.Count(q.action, StateBusy)
		q.inProgress(time.Second)
		return StateBusy, nil
	case err != nil && !acquired && q.m.work.draining.Err() != nil && !ended && errors.Is(err, context.Canceled) &&
		!errors.Is(err, dbidem.ErrStoreBusy):
		// Shutdown started while this request waited for another with its key: it stops
		// waiting (the client retries, against another process). A request whose probes found
		// the key table locked is answered as such below.
		endSpan(done, "in_progress", err)
		q.m.o.Metrics.Count(q.action, StateBusy)
		q.inProgress(time.Second)
		return StateBusy, nil
	case shutDown:
		// Shutdown's deadline ended the claim under way (it waited for a connection, or for
		// another holder of the key): nothing was claimed. Not the store's failure.
		endSpan(done, "shutdown", nil)
		q.w.Header().Set("Retry-After", "1")
		q.m.problem(q.w, q.r, CodeShuttingDown, "this server is shutting down; nothing was changed; retry with the same key", nil)
		q.shutDown = true
		return "", nil
	case err != nil && waitable(err):
		endSpan(done, "in_progress", err)
		// Without a wait slot the duplicate is answered at once: a pause and a claim again,
		// every DefaultAnswerPoll, held a connection a twentieth of the time for each such
		// duplicate, uncounted by MaxWaitingBytes (D211).
		return "", &busy{err: err, quick: time.Since(started) < DefaultAnswerPoll, refused: dbidem.IsNoSlot(err)}
	case err != nil && acquired && ended && !errors.Is(err, dbidem.ErrCommitUnknown) &&
		!errors.Is(err, dbidem.ErrStoreBusy):
		// Shutdown ended the unit of work before it committed: it rolled back. The client
		// retries, against another process; the store did not fail.
		endSpan(done, "shutdown", err)
		q.w.Header().Set("Retry-After", "1")
		q.m.problem(q.w, q.r, CodeShuttingDown, "this server shut down before the work answered; it rolled back, nothing was changed: retry with the same key", nil)
		return StateAcquired, nil
	case err != nil && acquired && context.Cause(wctx) == context.DeadlineExceeded && !errors.Is(err, dbidem.ErrCommitUnknown) &&
		!errors.Is(err, dbidem.ErrStoreBusy):
		// The route's WorkTimeout ended the unit of work before it committed: it rolled back.
		// The work's own failure, not the store's.
		endSpan(done, "timeout", err)
		q.m.o.Logger.Warn("idem: unit of work ended at its WorkTimeout; rolled back", "error", err,
			"request_id", q.r.Header.Get(q.m.o.CorrelationHeader))
		q.m.problem(q.w, q.r, CodeInternalError, "the request's work did not finish within the server's work timeout; it rolled back, nothing was changed", nil)
		return StateAcquired, nil
	case err != nil:
		endSpan(done, "error", err)
		if acquired && d.Outcome == dbidem.Claimed && q.rt.Lease > 0 && errors.Is(err, dbidem.ErrCommitUnknown) {
			// d is the last run's decision: only its own claim's token is given up.
			q.giveUpUnknownClaim(ctx, claim, d.Attempt)
		}
		st := q.storeError(err)
		if st != StateAcquired && st != "" { // the handler's own failure is not the store's (counted acquired)
			q.m.o.Metrics.Count(q.action, st)
		}
		return st, nil
	}
	endSpan(done, [...]string{commit: "completed", final: "final", rollBack: "rolled_back"}[v], nil)
	if d.Outcome == dbidem.Claimed {
		if q.rt.Lease > 0 {
			return q.lease(ctx, claim, d), nil
		}
		if oversize {
			q.m.o.Metrics.Count(q.action, StateOversize)
		}
		// How long the work took, from its claim to its commit: a duplicate's Retry-After.
		q.m.typical.add(q.action, time.Since(worked))
		rec.sendTo(q.w)
		return StateAcquired, nil
	}
	if d.Outcome == dbidem.InProgress {
		b := &busy{lease: true}
		if d.RetryAfter > 0 {
			b.leaseEnd = time.Now().Add(d.RetryAfter)
		}
		return "", b
	}
	st := stateOfOutcome(d.Outcome)
	q.m.o.Metrics.Count(q.action, st)
	switch d.Outcome {
	case dbidem.Replay:
		q.replay(d.Response)
	case dbidem.Mismatch:
		changed := d.ChangedFields
		q.m.problem(q.w, q.r, CodeKeyReuse, "this "+q.m.o.KeyHeader+" was used for another request", func(p *Problem) {
			if changed != nil {
				p.ChangedFields = &changed
			}
		})
	}
	return st, nil
}

// earlierReleaseDecision answers a request whose body, declared as another type than JSON,
// was hashed as its bytes (request.rawHashed, canon.ComputeRaw) and found its key stored under
// another fingerprint: it may be the retry of a request that a release before D178
// fingerprinted as canon.Compute does (the canonical form of a strictly valid JSON body, the
// bytes of any other). It asks the key again with that fingerprint, in tx under a savepoint,
// and returns that answer, with the claim under that fingerprint, when it is a replay, a lease
// in progress (both read only), or, on a lease route, the takeover of a lease that ran out (a
// deploy ended its process), which commits as the route's claim does; anything else, a fresh
// claim of a key that became free since the mismatch included, is undone, and the mismatch
// stands. No fingerprint of ComputeRaw equals one of ComputeBefore178, so a key stored for a
// body hashed as its bytes never answers this way; a key this release stored for a body sent
// as JSON with the same canonical form does (the row does not say which release stored it:
// docs/http.md, D178).
func (q *request) earlierReleaseDecision(ctx context.Context, tx *dbidem.Tx, claim dbidem.Claim, mismatch dbidem.Decision) (dbidem.Decision, dbidem.Claim, bool) {
	fp := canon.ComputeBefore178(q.r.Method, q.r.URL.EscapedPath(), q.body)
	if fp.Ambiguous != "" { // refused before any claim by those releases: never stored
		return dbidem.Decision{}, claim, false
	}
	earlier := claim
	earlier.Fingerprint, earlier.Fields = fp.Sum, fp.Fields
	// On a lease route each statement is bounded as the claim's are (Tx.Bounded): the unit's
	// bound went on from the claim's answer, and the work context has no deadline. The asks
	// wait on the key's row at most its lock timeout (the Gate's, read once already).
	wait := earlier.LockTimeout
	if wait == 0 {
		wait, _ = q.m.gate.LockTimeout(ctx, q.m.o.DB, earlier)
	}
	exec := func(sql string) error {
		sctx, done := tx.Bounded(ctx, 0)
		defer done()
		_, err := tx.Exec(sctx, sql)
		return err
	}
	begin := func() (dbidem.Decision, error) {
		sctx, done := tx.Bounded(ctx, wait)
		defer done()
		return dbidem.Begin(sctx, tx, earlier)
	}
	if err := exec("SAVEPOINT idem_earlier_release"); err != nil {
		return dbidem.Decision{}, claim, false
	}
	d, err := begin()
	if err == nil && d.Outcome == dbidem.Claimed {
		// Only the takeover of a lease stored under the earlier fingerprint may be claimed. A
		// key that became free since the mismatch was read (its holder gave it up, or it
		// expired) would be claimed afresh under it, and would answer every body of that
		// canonical form until it expired (a text/plain 1.1 replaying 1.10's answer). A
		// takeover keeps its generation: the same claim made again, the first undone, hands
		// the same provider key; a fresh claim starts a new generation each time, with a new
		// provider key. On a transactional route no claim under it is taken.
		first := d.ProviderKey
		err = errFreeUnderEarlier
		if claim.Lease > 0 {
			if err = exec("ROLLBACK TO SAVEPOINT idem_earlier_release"); err == nil {
				d, err = begin()
			}
			if err == nil && d.Outcome == dbidem.Claimed && d.ProviderKey != first {
				err = errFreeUnderEarlier
			}
		}
	}
	if err == nil && (d.Outcome == dbidem.Replay || d.Outcome == dbidem.InProgress || d.Outcome == dbidem.Claimed) {
		// The decision kept is the transaction's: a replay or a lease in progress leaves it
		// nothing to commit (what a first ask claimed was rolled back to the savepoint), as
		// the mismatch did (D226); a takeover commits as the route's claim does.
		tx.Redecided(earlier, d)
		return d, earlier, true
	}
	if err := exec("ROLLBACK TO SAVEPOINT idem_earlier_release"); err == nil {
		tx.Redecided(claim, mismatch) // the mismatch stands, and nothing of the asks does
	}
	return dbidem.Decision{}, claim, false
}

// errFreeUnderEarlier is earlierReleaseDecision's refusal of a claim under the earlier
// fingerprint that is not the takeover of a lease stored under it.
var errFreeUnderEarlier = errors.New("idem: the key is free: not claimed under an earlier release's fingerprint")
