package idemhttp

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
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
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/dbidem"
)

// Middleware makes declared routes idempotent. Build one with New and wrap routes with
// Route, or declare them with Declare and install Handler on the router.
type Middleware struct {
	o        Options
	declared map[string]Route // "METHOD template"
}

// New checks the options and fills in their defaults.
func New(o Options) (*Middleware, error) {
	if o.DB == nil {
		return nil, errors.New("idemhttp: Options.DB is required")
	}
	if o.Principal == nil {
		return nil, errors.New("idemhttp: Options.Principal is required")
	}
	o.defaults()
	return &Middleware{o: o, declared: map[string]Route{}}, nil
}

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

// state travels in the request's context to the handler.
type state struct {
	tx         pgx.Tx
	secret     bool
	resourceID string
	retry      error // a serialization failure or deadlock the handler's statements hit
}

// note remembers a retryable error from the handler's statements: the handler usually
// answers 500 to it, but the unit of work should run again instead.
func (s *state) note(err error) {
	if err != nil && s.retry == nil && dbidem.IsRetryable(err) {
		s.retry = err
	}
}

// trackedTx is the transaction handed to the handler: a pgx.Tx that notes retryable errors.
type trackedTx struct {
	pgx.Tx
	st *state
}

func (t trackedTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	tag, err := t.Tx.Exec(ctx, sql, args...)
	t.st.note(err)
	return tag, err
}

func (t trackedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	rows, err := t.Tx.Query(ctx, sql, args...)
	t.st.note(err)
	if err != nil {
		return rows, err
	}
	return trackedRows{rows, t.st}, nil
}

func (t trackedTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	rows, err := t.Query(ctx, sql, args...)
	return trackedRow{rows: rows, err: err, st: t.st}
}

type trackedRows struct {
	pgx.Rows
	st *state
}

func (r trackedRows) Err() error {
	err := r.Rows.Err()
	r.st.note(err)
	return err
}

func (t trackedTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return trackedBatch{t.Tx.SendBatch(ctx, b), t.st}
}

// trackedBatch notes retryable errors from a batch's results (a deadlock in one of its
// statements is as retryable as one in Exec).
type trackedBatch struct {
	pgx.BatchResults
	st *state
}

func (b trackedBatch) Exec() (pgconn.CommandTag, error) {
	tag, err := b.BatchResults.Exec()
	b.st.note(err)
	return tag, err
}

func (b trackedBatch) Query() (pgx.Rows, error) {
	rows, err := b.BatchResults.Query()
	b.st.note(err)
	if err != nil {
		return rows, err
	}
	return trackedRows{rows, b.st}, nil
}

func (b trackedBatch) QueryRow() pgx.Row { return notedRow{b.BatchResults.QueryRow(), b.st} }

func (b trackedBatch) Close() error {
	err := b.BatchResults.Close()
	b.st.note(err)
	return err
}

type notedRow struct {
	pgx.Row
	st *state
}

func (r notedRow) Scan(dest ...any) error {
	err := r.Row.Scan(dest...)
	r.st.note(err)
	return err
}

// trackedRow behaves as pgx's Row: the first row, pgx.ErrNoRows when there is none.
type trackedRow struct {
	rows pgx.Rows
	err  error
	st   *state
}

func (r trackedRow) Scan(dest ...any) error {
	if r.err != nil {
		return r.err
	}
	defer r.rows.Close()
	if !r.rows.Next() {
		if err := r.rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	if err := r.rows.Scan(dest...); err != nil {
		return err
	}
	r.rows.Close()
	return r.rows.Err()
}

type stateKey struct{}

func stateOf(ctx context.Context) *state {
	s, _ := ctx.Value(stateKey{}).(*state)
	return s
}

// Tx returns the transaction of the request's unit of work: the handler's writes through it
// commit together with the key, or not at all. Nil outside a declared transactional route.
func Tx(ctx context.Context) pgx.Tx {
	if s := stateOf(ctx); s != nil {
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

// SetResourceID records the id of what the request created; a repeat of a response that
// cannot be replayed names it. Default: the response's Location header.
func SetResourceID(ctx context.Context, id string) {
	if s := stateOf(ctx); s != nil {
		s.resourceID = id
	}
}

// recorder buffers the handler's response so that nothing reaches the client before the
// unit of work has committed or rolled back. Flush is accepted and has no effect until then.
type recorder struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func newRecorder() *recorder { return &recorder{header: http.Header{}} }

func (rec *recorder) Header() http.Header { return rec.header }

func (rec *recorder) WriteHeader(status int) {
	if rec.status == 0 && status >= 200 {
		rec.status = status
	}
}

func (rec *recorder) Write(b []byte) (int, error) {
	rec.WriteHeader(http.StatusOK)
	return rec.body.Write(b)
}

// Flush implements http.Flusher; the response is sent when the unit of work ends.
func (rec *recorder) Flush() {}

func (rec *recorder) code() int {
	if rec.status == 0 {
		return http.StatusOK
	}
	return rec.status
}

func (rec *recorder) sendTo(w http.ResponseWriter) {
	for k, v := range rec.header {
		w.Header()[k] = v
	}
	w.WriteHeader(rec.code())
	_, _ = w.Write(rec.body.Bytes())
}

// run calls the handler with a fresh recorder and body reader; a panic is recovered and
// reported (the caller rolls back).
func (m *Middleware) run(next http.Handler, r *http.Request, body []byte, st *state) (rec *recorder, panicked bool) {
	rec = newRecorder()
	r2 := r.WithContext(context.WithValue(r.Context(), stateKey{}, st))
	r2.Body = io.NopCloser(bytes.NewReader(body))
	r2.ContentLength = int64(len(body))
	defer func() {
		if v := recover(); v != nil {
			if v == http.ErrAbortHandler {
				panic(v)
			}
			panicked = true
			m.o.Logger.Error("idem: handler panicked; rolled back", "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
		}
	}()
	next.ServeHTTP(rec, r2)
	return rec, false
}

// errRollBack ends a unit of work without committing.
var errRollBack = errors.New("idemhttp: roll back")

// parseKey reads the key header: an RFC 8941 sf-string ("k1") or a bare value (k1), of 1
// to 255 visible ASCII characters. Several header lines are ambiguous, hence invalid.
func parseKey(values []string) (key string, present, valid bool) {
	if len(values) == 0 {
		return "", false, false
	}
	if len(values) > 1 {
		return "", true, false
	}
	v := strings.TrimSpace(values[0])
	if strings.HasPrefix(v, `"`) {
		if len(v) < 2 || !strings.HasSuffix(v, `"`) {
			return "", true, false
		}
		var b strings.Builder
		for i := 1; i < len(v)-1; i++ {
			c := v[i]
			switch {
			case c == '\\':
				i++
				if i >= len(v)-1 || (v[i] != '"' && v[i] != '\\') {
					return "", true, false
				}
				b.WriteByte(v[i])
			case c == '"' || c < 0x20 || c > 0x7e:
				return "", true, false
			default:
				b.WriteByte(c)
			}
		}
		v = b.String()
	}
	if len(v) < 1 || len(v) > 255 {
		return "", true, false
	}
	for i := 0; i < len(v); i++ {
		if v[i] < 0x21 || v[i] > 0x7e {
			return "", true, false
		}
	}
	return v, true, true
}

// keyTag is what logs show of a key: a short hash, never the key.
func keyTag(principal, key string) string {
	h := sha256.Sum256([]byte(principal + "\x00" + key))
	return hex.EncodeToString(h[:6])
}

func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, rt Route, next http.Handler) {
	start := time.Now()
	action := rt.Action
	if action == "" {
		action = r.Method + " " + template(r)
	}
	principal, authenticated := m.o.Principal(r)
	key, present, valid := parseKey(r.Header.Values(m.o.KeyHeader))
	keyed := authenticated && present
	if authenticated && present && !valid {
		m.problem(w, r, http.StatusBadRequest, CodeKeyInvalid,
			m.o.KeyHeader+" must be 1 to 255 visible ASCII characters, as a bare value or a quoted string", nil)
		return
	}
	if authenticated && !present && rt.Required {
		m.problem(w, r, http.StatusBadRequest, CodeKeyMissing, "this request needs an "+m.o.KeyHeader+" header", nil)
		return
	}
	if r.ContentLength > m.o.MaxBodyBytes {
		m.tooLarge(w, r)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, m.o.MaxBodyBytes+1))
	if err != nil {
		m.problem(w, r, http.StatusBadRequest, CodeBodyUnreadable, "the request body could not be read", nil)
		return
	}
	if int64(len(body)) > m.o.MaxBodyBytes {
		m.tooLarge(w, r)
		return
	}

	if !keyed {
		m.serveUnkeyed(w, r, rt, next, body)
		return
	}
	var fp canon.Fingerprint
	if rt.Fingerprint != nil {
		fp = rt.Fingerprint(r, body)
	} else {
		fp = canon.Compute(r.Method, r.URL.EscapedPath(), body)
	}
	claim := dbidem.Claim{Principal: principal, Key: key, Action: action, Fingerprint: fp.Sum, Fields: fp.Fields,
		TTL: m.o.TTL, Lease: rt.Lease, LockTimeout: m.o.LockTimeout}
	outcome := m.serveKeyed(w, r, rt, next, body, claim)
	m.o.Metrics.Observe(action, outcome, time.Since(start))
	if outcome != OutcomeAcquired && outcome != OutcomeReplayed {
		m.o.Logger.Info("idem", "outcome", string(outcome), "action", action, "key", keyTag(principal, key))
	}
}

func (m *Middleware) tooLarge(w http.ResponseWriter, r *http.Request) {
	m.problem(w, r, http.StatusRequestEntityTooLarge, CodeRequestTooLarge,
		fmt.Sprintf("the request body is larger than %d bytes", m.o.MaxBodyBytes), nil)
}

// serveUnkeyed runs a declared route without idempotency: same transaction for the
// handler, committed only for a 2xx.
func (m *Middleware) serveUnkeyed(w http.ResponseWriter, r *http.Request, rt Route, next http.Handler, body []byte) {
	if rt.Lease > 0 {
		rec, panicked := m.run(next, r, body, &state{})
		m.finish(w, r, rec, panicked)
		return
	}
	var rec *recorder
	var panicked bool
	err := dbidem.RunTx(r.Context(), m.o.DB, dbidem.TxOptions{MaxAttempts: m.o.MaxAttempts}, func(tx *dbidem.Tx) error {
		st := &state{}
		st.tx = trackedTx{tx.Tx, st}
		rec, panicked = m.run(next, r, body, st)
		if st.retry != nil && !panicked {
			return st.retry
		}
		if panicked || rec.code() >= 300 {
			return errRollBack
		}
		return nil
	})
	if err != nil && !errors.Is(err, errRollBack) {
		m.storeError(w, r, err)
		return
	}
	m.finish(w, r, rec, panicked)
}

func (m *Middleware) finish(w http.ResponseWriter, r *http.Request, rec *recorder, panicked bool) {
	if panicked {
		m.problem(w, r, http.StatusInternalServerError, CodeInternalError, "the request failed; nothing was changed", nil)
		return
	}
	rec.sendTo(w)
}

func (m *Middleware) storeError(w http.ResponseWriter, r *http.Request, err error) {
	if errors.Is(err, dbidem.ErrUnknownPrincipal) {
		m.problem(w, r, http.StatusUnauthorized, CodePrincipalUnknown, "the principal of this request is not known", nil)
		return
	}
	if r.Context().Err() != nil {
		return // the client is gone; the transaction rolled back
	}
	m.o.Logger.Error("idem: database error; nothing stored", "error", err)
	w.Header().Set("Retry-After", "1")
	m.problem(w, r, http.StatusServiceUnavailable, CodeStoreUnavailable, "the request could not be recorded; nothing was changed; retry with the same key", nil)
}

// stored turns the handler's response into what is stored.
func (m *Middleware) stored(rec *recorder, st *state) (dbidem.Response, Outcome) {
	h := http.Header{}
	for _, name := range m.o.StoredHeaders {
		if v := rec.header.Values(name); len(v) > 0 {
			h[http.CanonicalHeaderKey(name)] = v
		}
	}
	resp := dbidem.Response{Status: rec.code(), Header: h, Body: bytes.Clone(rec.body.Bytes()), ResourceID: st.resourceID}
	if resp.ResourceID == "" {
		resp.ResourceID = rec.header.Get("Location")
	}
	switch {
	case st.secret:
		resp.Body, resp.Withheld = nil, dbidem.WithheldOneTimeSecret
	case rec.body.Len() > m.o.MaxStoredBodyBytes:
		resp.Body, resp.Withheld = nil, dbidem.WithheldTooLarge
		return resp, OutcomeOversize
	}
	return resp, OutcomeAcquired
}

func is2xx(status int) bool { return status >= 200 && status < 300 }

func (m *Middleware) serveKeyed(w http.ResponseWriter, r *http.Request, rt Route, next http.Handler, body []byte, claim dbidem.Claim) Outcome {
	ctx := r.Context()
	var (
		d        dbidem.Decision
		rec      *recorder
		st       *state
		panicked bool
		outcome  Outcome
	)
	err := dbidem.RunTx(ctx, m.o.DB, dbidem.TxOptions{MaxAttempts: m.o.MaxAttempts}, func(tx *dbidem.Tx) error {
		rec, panicked = nil, false
		var err error
		if d, err = tx.Begin(ctx, claim); err != nil || d.Outcome != dbidem.Claimed || rt.Lease > 0 {
			return err // a lease claim commits on its own; other outcomes write nothing
		}
		st = &state{}
		st.tx = trackedTx{tx.Tx, st}
		rec, panicked = m.run(next, r, body, st)
		if st.retry != nil && !panicked {
			return st.retry // RunTx runs the unit again: fresh body reader, fresh recorder
		}
		if panicked || !is2xx(rec.code()) {
			return errRollBack
		}
		var resp dbidem.Response
		resp, outcome = m.stored(rec, st)
		tx.CompleteOnCommit(claim.Principal, claim.Key, d.Attempt, resp)
		return nil
	})
	switch {
	case errors.Is(err, dbidem.ErrInProgress):
		m.inProgress(w, r, m.o.LockTimeout)
		return OutcomeInProgress
	case errors.Is(err, errRollBack):
		return m.afterRollBack(w, r, claim, rec, st, panicked)
	case err != nil:
		m.storeError(w, r, err)
		return OutcomeStoreError
	}
	switch d.Outcome {
	case dbidem.Replay:
		m.replay(w, r, d.Response)
		return OutcomeReplayed
	case dbidem.Mismatch:
		m.problem(w, r, http.StatusUnprocessableEntity, CodeKeyReuse,
			"this "+m.o.KeyHeader+" was used for another request", func(p *Problem) { p.ChangedFields = d.ChangedFields })
		return OutcomeMismatch
	case dbidem.InProgress:
		m.inProgress(w, r, d.RetryAfter)
		return OutcomeInProgress
	}
	if rt.Lease > 0 {
		return m.serveLease(w, r, next, body, claim, d.Attempt)
	}
	rec.sendTo(w)
	return outcome
}

// afterRollBack answers a claimed request whose handler did not succeed: a final error is
// stored on its own (idem_save_final), anything else is not.
func (m *Middleware) afterRollBack(w http.ResponseWriter, r *http.Request, claim dbidem.Claim, rec *recorder, st *state, panicked bool) Outcome {
	if panicked {
		m.finish(w, r, rec, true)
		return OutcomeNotStored
	}
	if !m.o.FinalStatus(rec.code()) {
		rec.sendTo(w)
		return OutcomeNotStored
	}
	resp, outcome := m.stored(rec, st)
	sctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), 5*time.Second)
	defer cancel()
	if _, err := dbidem.SaveFinal(sctx, m.o.DB, claim, resp); err != nil {
		m.o.Logger.Warn("idem: final response not stored", "error", err, "key", keyTag(claim.Principal, claim.Key))
		outcome = OutcomeStoreError
	}
	rec.sendTo(w)
	return outcome
}

// serveLease runs the handler of a committed lease claim and stores (or releases) its
// response, fenced by the attempt.
func (m *Middleware) serveLease(w http.ResponseWriter, r *http.Request, next http.Handler, body []byte, claim dbidem.Claim, attempt int) Outcome {
	st := &state{}
	rec, panicked := m.run(next, r, body, st)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), 5*time.Second)
	defer cancel()
	if panicked || !(is2xx(rec.code()) || m.o.FinalStatus(rec.code())) {
		if _, err := dbidem.Release(ctx, m.o.DB, claim.Principal, claim.Key, attempt); err != nil {
			m.o.Logger.Warn("idem: lease not released", "error", err, "key", keyTag(claim.Principal, claim.Key))
		}
		m.finish(w, r, rec, panicked)
		return OutcomeNotStored
	}
	resp, outcome := m.stored(rec, st)
	if err := dbidem.Complete(ctx, m.o.DB, claim.Principal, claim.Key, attempt, resp); err != nil {
		m.o.Logger.Warn("idem: lease response not stored", "error", err, "key", keyTag(claim.Principal, claim.Key))
		outcome = OutcomeStoreError
	}
	rec.sendTo(w)
	return outcome
}

func (m *Middleware) inProgress(w http.ResponseWriter, r *http.Request, after time.Duration) {
	secs := int(math.Ceil(after.Seconds()))
	if secs < 1 {
		secs = 1
	}
	w.Header().Set("Retry-After", strconv.Itoa(secs))
	m.problem(w, r, http.StatusConflict, CodeInProgress, "a request with this "+m.o.KeyHeader+" is still running; retry later", nil)
}

func (m *Middleware) replay(w http.ResponseWriter, r *http.Request, resp dbidem.Response) {
	switch resp.Withheld {
	case dbidem.WithheldOneTimeSecret:
		m.problem(w, r, http.StatusConflict, CodeOneTimeSecret, "the response to this request was a one-time secret and was sent once", nil)
		return
	case dbidem.WithheldTooLarge:
		m.problem(w, r, http.StatusConflict, CodeNotReplayable, "the response to this request was too large to store",
			func(p *Problem) { p.ResourceID = resp.ResourceID })
		return
	}
	for k, v := range resp.Header {
		w.Header()[k] = v
	}
	w.Header().Set(m.o.ReplayHeader, "true")
	if id := r.Header.Get(m.o.CorrelationHeader); id != "" && w.Header().Get(m.o.CorrelationHeader) == "" {
		w.Header().Set(m.o.CorrelationHeader, id) // the current request's, never the stored one
	}
	w.WriteHeader(resp.Status)
	_, _ = w.Write(resp.Body)
}
