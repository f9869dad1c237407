package idemhttp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/gorilla/mux"

	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/dbidem"
)

// Middleware makes declared routes idempotent. Build one with New and wrap routes with
// Route, or declare them with Declare and install Handler on the router.
type Middleware struct {
	o        Options
	gate     *dbidem.Gate
	declared map[string]Route // "METHOD template"
}

// defaultMiddleware writes problems outside a declared route.
var defaultMiddleware = func() *Middleware {
	var o Options
	o.defaults()
	return &Middleware{o: o}
}()

// New checks the options and fills in their defaults.
func New(o Options) (*Middleware, error) {
	if o.DB == nil {
		return nil, errors.New("idemhttp: Options.DB is required")
	}
	if o.Principal == nil {
		return nil, errors.New("idemhttp: Options.Principal is required")
	}
	if o.TTL < 0 || o.LockTimeout < 0 || o.MaxBodyBytes < 0 || o.MaxStoredBodyBytes < 0 || o.MaxWaitingClaims < 0 {
		return nil, errors.New("idemhttp: TTL, LockTimeout, MaxBodyBytes, MaxStoredBodyBytes and MaxWaitingClaims must not be negative")
	}
	o.defaults()
	waiting := o.MaxWaitingClaims
	if waiting == 0 {
		waiting = max(1, int(o.DB.Config().MaxConns)/4)
	}
	return &Middleware{o: o, gate: dbidem.NewGate(waiting), declared: map[string]Route{}}, nil
}

// Options returns the options in effect, defaults filled in (a zero TTL or LockTimeout
// stays zero: the SQL API's default applies).
func (m *Middleware) Options() Options { return m.o }

// Route returns a middleware for one route with this declaration; it is both a
// mux.MiddlewareFunc and a plain func(http.Handler) http.Handler.
//
//	r.Handle("/v1/transfers", m.Route(idemhttp.Route{Required: true})(transfers)).Methods("POST")
func (m *Middleware) Route(rt Route) mux.MiddlewareFunc {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { m.serve(w, r, rt, next) })
	}
}

// Declare declares the route with this method and gorilla/mux path template for Handler.
// Not safe to call once requests are being served.
func (m *Middleware) Declare(method, pathTemplate string, rt Route) {
	m.declared[strings.ToUpper(method)+" "+pathTemplate] = rt
}

// Declared returns the routes declared with Declare, by "METHOD template".
func (m *Middleware) Declared() map[string]Route {
	out := make(map[string]Route, len(m.declared))
	for k, v := range m.declared {
		out[k] = v
	}
	return out
}

// Handler is a router-wide mux.MiddlewareFunc (r.Use(m.Handler)): requests to routes
// declared with Declare take part; all others pass through untouched, header or not.
func (m *Middleware) Handler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if rt, ok := m.declared[r.Method+" "+template(r)]; ok {
			m.serve(w, r, rt, next)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func template(r *http.Request) string {
	if route := mux.CurrentRoute(r); route != nil {
		if t, err := route.GetPathTemplate(); err == nil {
			return t
		}
	}
	return r.URL.Path
}

// request is one request to a declared route on its way through the middleware.
type request struct {
	m      *Middleware
	w      http.ResponseWriter
	r      *http.Request
	rt     Route
	next   http.Handler
	body   []byte
	action string
}

func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, rt Route, next http.Handler) {
	start := time.Now()
	q := &request{m: m, w: w, r: r, rt: rt, next: next, action: rt.Action}
	if q.action == "" {
		q.action = r.Method + " " + template(r)
	}
	principal, authenticated := m.o.Principal(r)
	key, present, valid := parseKey(r.Header.Values(m.o.KeyHeader))
	keyed := authenticated && present
	switch {
	case keyed && !valid:
		m.problem(w, r, CodeKeyInvalid, m.o.KeyHeader+" must be 1 to 255 visible ASCII characters, as a bare value or a quoted string", nil)
		return
	case authenticated && !present && rt.Required:
		m.problem(w, r, CodeKeyMissing, "this request needs an "+m.o.KeyHeader+" header", nil)
		return
	case r.ContentLength > m.o.MaxBodyBytes:
		m.tooLarge(w, r)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, m.o.MaxBodyBytes+1))
	if err != nil {
		m.problem(w, r, CodeBodyUnreadable, "the request body could not be read", nil)
		return
	}
	if int64(len(body)) > m.o.MaxBodyBytes {
		m.tooLarge(w, r)
		return
	}
	q.body = body
	if !keyed {
		q.unkeyed()
		return
	}
	var fp canon.Fingerprint
	if rt.Fingerprint != nil {
		fp = rt.Fingerprint(r, body)
	} else {
		fp = canon.Compute(r.Method, r.URL.EscapedPath(), body)
	}
	switch {
	case fp.Ambiguous != "":
		// Refused before any claim: a handler could not be sure to act on what was hashed.
		m.problem(w, r, CodeMalformedBody, "the body is ambiguous: "+fp.Ambiguous, nil)
		return
	case !fp.JSON && len(body) > 0 && jsonContent(r):
		// Sent as JSON but not strictly valid JSON (duplicate members, data after the value,
		// invalid UTF-8...): no handler may act on it, so nothing is claimed or stored.
		m.problem(w, r, CodeMalformedBody, "the body is not strictly valid JSON (one value, no duplicate member names, valid UTF-8)", nil)
		return
	}
	claim := dbidem.Claim{Principal: principal, Key: key, Action: q.action, Fingerprint: fp.Sum, Fields: fp.Fields,
		TTL: m.o.TTL, Lease: rt.Lease, LockTimeout: m.o.LockTimeout}
	st := q.keyed(claim)
	m.o.Metrics.Done(st, time.Since(start))
	if st != StateAcquired && st != StateReplayed {
		m.o.Logger.Info("idem", "state", string(st), "action", q.action, "key_hash", keyHash(principal, key),
			"request_id", r.Header.Get(m.o.CorrelationHeader))
	}
}

func (m *Middleware) tooLarge(w http.ResponseWriter, r *http.Request) {
	m.problem(w, r, CodeRequestTooLarge, fmt.Sprintf("the request body is larger than %d bytes", m.o.MaxBodyBytes), nil)
}

// verdict is what the handler's response means for its transaction.
type verdict int

const (
	commit   verdict = iota // 2xx: commit the work (and the key's response)
	final                   // a final error: roll the work back, store the answer
	rollBack                // anything else, or a panic: roll back, store nothing
)

// run calls the handler with a fresh recorder, body reader and state; a panic is recovered
// and reported as rollBack.
func (q *request) run(tx *dbidem.Tx, keyed bool) (rec *recorder, st *state, v verdict) {
	st = &state{m: q.m, body: q.body}
	if tx != nil {
		st.tx = tx
	}
	rec = newRecorder()
	r2 := q.r.WithContext(context.WithValue(q.r.Context(), stateKey{}, st))
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
	q.next.ServeHTTP(rec, r2)
	switch code := rec.code(); {
	case code >= 200 && code < 300:
		return rec, st, commit
	case keyed && q.m.o.FinalStatus(code):
		return rec, st, final
	}
	return rec, st, rollBack
}

// errRollBack ends a unit of work without committing.
var errRollBack = errors.New("idemhttp: roll back")

// unkeyed runs a declared route without idempotency: the same transaction for the handler,
// committed only for a 2xx.
func (q *request) unkeyed() {
	if q.rt.Lease > 0 {
		rec, _, _ := q.run(nil, false)
		q.answer(rec)
		return
	}
	var rec *recorder
	err := dbidem.RunTx(q.r.Context(), q.m.o.DB, q.txOptions(), func(tx *dbidem.Tx) error {
		var v verdict
		rec, _, v = q.run(tx, false)
		if v != commit {
			return errRollBack
		}
		return nil
	})
	if err != nil && !errors.Is(err, errRollBack) {
		q.storeError(err)
		return
	}
	q.answer(rec)
}

func (q *request) txOptions() dbidem.TxOptions {
	return dbidem.TxOptions{MaxAttempts: q.m.o.MaxAttempts}
}

// answer sends the handler's response, or 500 for a panic.
func (q *request) answer(rec *recorder) {
	if rec == nil {
		q.m.problem(q.w, q.r, CodeInternalError, "the request failed; nothing was changed; retrying with the same key is safe", nil)
		return
	}
	rec.sendTo(q.w)
}

// storeError answers a failure of the unit of work (not of the handler).
func (q *request) storeError(err error) State {
	if q.r.Context().Err() != nil && !errors.Is(err, dbidem.ErrCommitUnknown) {
		return StateStoreError // the client is gone; the transaction rolled back
	}
	code, detail := errorProblem(err)
	switch code {
	case CodeInProgress:
		q.inProgress(0)
		return StateBusy
	case CodePrincipalUnknown:
		q.m.problem(q.w, q.r, code, detail, nil)
		return StateStoreError
	case CodeStoreUnavailable, CodeOutcomeUnknown:
		q.w.Header().Set("Retry-After", "1")
	}
	q.m.o.Logger.Error("idem: unit of work failed", "error", err, "problem", code, "request_id", q.r.Header.Get(q.m.o.CorrelationHeader))
	q.m.problem(q.w, q.r, code, detail, nil)
	return StateStoreError
}

// stored turns the handler's response into what is stored.
func (q *request) stored(rec *recorder, st *state) (dbidem.Response, bool) {
	h := http.Header{}
	for _, name := range q.m.o.StoredHeaders {
		if v := rec.header.Values(name); len(v) > 0 {
			h[http.CanonicalHeaderKey(name)] = v
		}
	}
	resp := dbidem.Response{Status: rec.code(), Header: h, Body: bytes.Clone(rec.body.Bytes()), ResourceID: st.resourceID}
	switch {
	case st.secret:
		resp.Body, resp.Withheld = nil, dbidem.WithheldOneTimeSecret
	case rec.body.Len() > q.m.o.MaxStoredBodyBytes:
		resp.Body, resp.Withheld = nil, dbidem.WithheldTooLarge
		return resp, true
	}
	return resp, false
}

// keyed runs a keyed request: claim, then the handler in the same transaction, then the
// completion (2xx) or the final answer (a final error) with COMMIT. It returns the
// request's main state.
func (q *request) keyed(claim dbidem.Claim) State {
	ctx := q.r.Context()
	var (
		d        dbidem.Decision
		rec      *recorder
		v        verdict
		acquired bool
		oversize bool
	)
	err := q.m.gate.Run(ctx, q.m.o.DB, q.txOptions(), claim, func(tx *dbidem.Tx, dec dbidem.Decision) error {
		d, rec, oversize = dec, nil, false
		if d.Outcome != dbidem.Claimed {
			return nil // replay, mismatch, in progress: nothing was written
		}
		if !acquired {
			acquired = true
			q.m.o.Metrics.Count(q.action, StateAcquired)
		}
		if q.rt.Lease > 0 {
			return nil // a lease claim commits on its own; the handler runs after
		}
		var st *state
		rec, st, v = q.run(tx, true)
		if v == rollBack {
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
	switch {
	case errors.Is(err, errRollBack):
		q.answer(rec)
		return StateAcquired
	case err != nil:
		st := q.storeError(err)
		q.m.o.Metrics.Count(q.action, st)
		return st
	}
	if d.Outcome == dbidem.Claimed {
		if q.rt.Lease > 0 {
			return q.lease(claim, d.Attempt)
		}
		if oversize {
			q.m.o.Metrics.Count(q.action, StateOversize)
		}
		rec.sendTo(q.w)
		return StateAcquired
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
	default:
		q.inProgress(d.RetryAfter)
	}
	return st
}

// lease runs the handler of a committed lease claim and stores (a 2xx or a final error) or
// releases (anything else) its response, fenced by the attempt.
func (q *request) lease(claim dbidem.Claim, attempt int64) State {
	rec, st, v := q.run(nil, true)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(q.r.Context()), 5*time.Second)
	defer cancel()
	if v == rollBack {
		if _, err := dbidem.Release(ctx, q.m.o.DB, claim.Principal, claim.Key, attempt); err != nil {
			q.m.o.Logger.Error("idem: lease not released; the key stays busy until the lease runs out", "error", err,
				"key_hash", keyHash(claim.Principal, claim.Key))
		}
		q.answer(rec)
		return StateAcquired
	}
	resp, big := q.stored(rec, st)
	if big {
		q.m.o.Metrics.Count(q.action, StateOversize)
	}
	if err := dbidem.Complete(ctx, q.m.o.DB, claim.Principal, claim.Key, attempt, resp); err != nil {
		q.m.o.Logger.Error("idem: lease response not recorded; a retry will run the work again once the lease runs out",
			"error", err, "key_hash", keyHash(claim.Principal, claim.Key))
	}
	rec.sendTo(q.w)
	return StateAcquired
}

// inProgress answers 409 request_in_progress with Retry-After: after, or the lock timeout.
func (q *request) inProgress(after time.Duration) {
	if after <= 0 {
		after, _ = q.m.gate.LockTimeout(q.r.Context(), q.m.o.DB, dbidem.Claim{LockTimeout: q.m.o.LockTimeout})
	}
	secs := max(int(math.Ceil(after.Seconds())), 1)
	q.w.Header().Set("Retry-After", strconv.Itoa(secs))
	q.m.problem(q.w, q.r, CodeInProgress, "a request with this "+q.m.o.KeyHeader+" is still running; retry later with the same key", nil)
}

// replay sends a stored response, or the 409 that stands for a withheld body. Both carry
// the replay header; a replay carries the current request's correlation id, a stored
// problem its own.
func (q *request) replay(resp dbidem.Response) {
	q.w.Header().Set(q.m.o.ReplayHeader, "true")
	switch resp.Withheld {
	case dbidem.WithheldOneTimeSecret:
		q.m.problem(q.w, q.r, CodeOneTimeSecret, "the response to this request was a one-time secret and was sent once", nil)
		return
	case dbidem.WithheldTooLarge:
		id := resp.ResourceID
		if id == "" {
			id = resp.Header.Get("Location")
		}
		q.m.problem(q.w, q.r, CodeNotReplayable, "the response to this request was too large to store",
			func(p *Problem) { p.ResourceID = id })
		return
	}
	for k, v := range resp.Header {
		q.w.Header()[k] = v
	}
	if id := q.r.Header.Get(q.m.o.CorrelationHeader); id != "" && q.w.Header().Get(q.m.o.CorrelationHeader) == "" {
		q.w.Header().Set(q.m.o.CorrelationHeader, id)
	}
	q.w.WriteHeader(resp.Status)
	_, _ = q.w.Write(resp.Body)
}
