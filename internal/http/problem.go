package idemhttp

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/dbidem"
)

// Problem codes: the `code` member of every problem this package writes, and the anchor of
// its type URI in docs/http.md.
const (
	CodeKeyMissing       = "idempotency_key_missing"
	CodeKeyInvalid       = "idempotency_key_invalid"
	CodeKeyReuse         = "idempotency_key_reuse"
	CodeInProgress       = "request_in_progress"
	CodeOneTimeSecret    = "one_time_secret"
	CodeNotReplayable    = "response_not_replayable"
	CodeRequestTooLarge  = "request_too_large"
	CodeBodyUnreadable   = "request_body_unreadable"
	CodeBodyIncomplete   = "request_body_incomplete"
	CodeMalformedBody    = "malformed_body"
	CodeUnsupportedMedia = "unsupported_media_type"
	CodePrincipalUnknown = "principal_unknown"
	CodeInternalError    = "internal_error"
	CodeMisconfigured    = "idempotency_misconfigured"
	CodeStoreUnavailable = "store_unavailable"
	CodeOutcomeUnknown   = "outcome_unknown"
	CodeShuttingDown     = "shutting_down"
)

// problemSpec is a problem code's status and title.
type problemSpec struct {
	status int
	title  string
}

// problems is the one table of every problem this package answers: code, status, title.
// docs/http.md lists the same table; TestProblemTableMatchesDocs compares them.
var problems = map[string]problemSpec{
	CodeKeyMissing:       {http.StatusBadRequest, "Idempotency-Key required"},
	CodeKeyInvalid:       {http.StatusBadRequest, "Idempotency-Key malformed"},
	CodeKeyReuse:         {http.StatusUnprocessableEntity, "Idempotency key reused for another request"},
	CodeInProgress:       {http.StatusConflict, "A request with this idempotency key is in progress"},
	CodeOneTimeSecret:    {http.StatusConflict, "The response was a one-time secret"},
	CodeNotReplayable:    {http.StatusConflict, "The response cannot be replayed"},
	CodeRequestTooLarge:  {http.StatusRequestEntityTooLarge, "Request body too large"},
	CodeBodyUnreadable:   {http.StatusBadRequest, "Request body unreadable"},
	CodeBodyIncomplete:   {http.StatusRequestTimeout, "Request body incomplete"},
	CodeMalformedBody:    {http.StatusBadRequest, "Malformed body"},
	CodeUnsupportedMedia: {http.StatusUnsupportedMediaType, "Unsupported media type"},
	CodePrincipalUnknown: {http.StatusUnauthorized, "Unknown principal"},
	CodeInternalError:    {http.StatusInternalServerError, "Internal error"},
	CodeMisconfigured:    {http.StatusInternalServerError, "Idempotency misconfigured"},
	CodeStoreUnavailable: {http.StatusServiceUnavailable, "Idempotency store unavailable"},
	CodeOutcomeUnknown:   {http.StatusServiceUnavailable, "Outcome unknown"},
	CodeShuttingDown:     {http.StatusServiceUnavailable, "Shutting down"},
}

// bodyProblem is the problem of a request body that could not be read: 408
// request_body_incomplete when it did not arrive whole (the connection ended before its end, or
// the server's read timeout passed while the client was still sending), which a retry of the
// same request mends; 400 request_body_unreadable when what arrived is not a body (malformed
// chunked encoding), which a retry would send again.
//
// io.ErrUnexpectedEOF is net/http's for a body cut short. net/http's other reports of a body
// that stopped arriving are unexported errors, told by their exact text (transportCut). A
// decoder that an outer middleware put in front of the body (of a request sent with
// Content-Encoding: gzip) returns the same io.ErrUnexpectedEOF for a stream that arrived whole
// but truncated, and such middleware deletes the header: the two cannot be told apart here.
// Both are 408: a client that sent a broken stream retries it a few times for nothing, where a
// 400 would tell a client whose body was cut that its operation failed for good (D183).
func bodyProblem(err error) (code, detail string) {
	var ne net.Error
	if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) || errors.As(err, &ne) && ne.Timeout() ||
		transportCut(err) {
		return CodeBodyIncomplete, "the request body did not arrive whole (the connection ended or was too slow); nothing was done: send the request again with the same key"
	}
	return CodeBodyUnreadable, "the request body could not be read"
}

// transportCut tells whether err, or an error it wraps, is one of net/http's own reports of a
// request body that stopped arriving, which it does not export: a chunked body cut before its
// last line (by the connection, or by the read timeout, whose error net/http drops there), and
// on HTTP/2 a stream the client reset or a connection that ended. Matched by the whole text
// (or net/http's own prefix of a stream error), never by a part of it: a malformed trailer's
// error quotes the client's own line.
func transportCut(err error) bool {
	for e := err; e != nil; e = errors.Unwrap(e) {
		switch s := e.Error(); {
		case s == "http: unexpected EOF reading trailer", s == "client disconnected", s == "http2: stream closed",
			strings.HasPrefix(s, "stream error: stream ID "):
			return true
		}
	}
	return false
}

// notStrictJSON is the detail of a body sent as JSON that is not strictly valid JSON, the
// form the fingerprint canonicalizes (internal/canon): a 400 malformed_body.
const notStrictJSON = "the body is not strictly valid JSON (one value, no duplicate member names, valid UTF-8, " +
	"at most 128 levels of nesting, exponents of at most 16 digits)"

// errorProblem maps an error of the unit of work (from the driver, the database or the
// Gate) to the problem that answers it, and the detail to send. It is the one place that
// reads driver errors.
func errorProblem(err error) (code, detail string) {
	switch {
	case errors.Is(err, dbidem.ErrStoreBusy):
		// A lock other than a key's row: the key table's (maintenance), or a row the claim's
		// INSERT checks, such as the principal's row a foreign key of the application's names.
		return CodeStoreUnavailable, "the idempotency store is locked (maintenance on its table, or a row the claim checks held by another transaction); nothing was changed; retry with the same key"
	case errors.Is(err, dbidem.ErrInProgress):
		return CodeInProgress, "a request with this key is still running; retry later with the same key"
	case errors.Is(err, dbidem.ErrUnknownPrincipal):
		return CodePrincipalUnknown, "the principal of this request is not known"
	case errors.Is(err, dbidem.ErrInvalidArgument):
		return CodeMisconfigured, "the idempotency store refused the request's arguments (a route's action, the principal's length or the configured TTL): a server configuration problem; nothing was changed"
	case errors.Is(err, dbidem.ErrCommitUnknown):
		return CodeOutcomeUnknown, "the request's commit got no answer (the connection to the database was lost, or the request's deadline or the server's shutdown ended it while it committed): it may or may not have taken effect; retry with the same key to get its answer"
	case errors.Is(err, dbidem.ErrNotMigrated):
		// New checked the schema at start; a function missing now is a migrate under a running
		// server (a rolling upgrade), which the servers of the new release answer: retryable.
		return CodeStoreUnavailable, "the database is not migrated for this server; nothing was changed; retry with the same key"
	case errors.Is(err, dbidem.ErrPermissionDenied):
		return CodeMisconfigured, "the server's database role may not call the idempotency store: a server configuration problem; nothing was changed"
	case errors.Is(err, pgx.ErrTxCommitRollback):
		return CodeInternalError, "the request's work left its transaction failed; it rolled back, nothing was changed"
	case errors.Is(err, dbidem.ErrTxOwned):
		// The handler ended the claim's transaction itself (COMMIT or ROLLBACK as SQL): its own
		// failure, met again by a retry, not the store's.
		return CodeInternalError, "the request's work ended its own transaction; its claim rolled back with it"
	case handlerSQLError(err):
		return CodeInternalError, "the request's work failed in the database; nothing was changed"
	}
	return CodeStoreUnavailable, "the request could not be recorded; nothing was changed; retry with the same key"
}

// handlerSQLError tells whether err is PostgreSQL's refusal of the request's own work (the
// store's refusals are matched before it): a data exception (22), an integrity constraint (23:
// a deferred foreign key at COMMIT, say), a transaction the handler left aborted (25P02; not
// the rest of class 25: a read-only transaction, 25006, is a database that cannot take writes,
// after a failover or on a standby), a statement PostgreSQL rejects (42), or an exception a
// function raised (P0). A retry meets it again; it is not the store being unavailable (a lost
// connection, a restart, a read-only database, too many connections, a serialization failure
// or a lock timeout are).
func handlerSQLError(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || len(pgErr.Code) != 5 {
		return false
	}
	switch pgErr.Code {
	case "25P02": // in_failed_sql_transaction: an error the work did not act on
		return true
	case "42P05": // duplicate_prepared_statement: a pooler in transaction mode (docs/operations.md)
		return false
	}
	switch pgErr.Code[:2] {
	case "22", "23", "42", "P0":
		return true
	}
	return false
}

// Problem is an RFC 9457 problem details object.
type Problem struct {
	// Type is a URI that identifies the problem and documents it.
	Type string `json:"type"`
	// Title is a short, stable summary of the problem type.
	Title string `json:"title"`
	// Status is the HTTP status.
	Status int `json:"status"`
	// Detail explains this occurrence.
	Detail string `json:"detail,omitempty"`
	// Code is the stable machine-readable code (the anchor of Type).
	Code string `json:"code"`
	// CorrelationID is the request's correlation id, when it has one.
	CorrelationID string `json:"correlation_id,omitempty"`
	// ChangedFields names the top-level request fields that differ (idempotency_key_reuse):
	// empty when only the method, path or action changed; absent when unknown.
	ChangedFields *[]string `json:"changed_fields,omitempty"`
	// ResourceID is the id of what the first request created (response_not_replayable,
	// one_time_secret), when it is known.
	ResourceID string `json:"resource_id,omitempty"`
	// Header names the request header the problem is about (idempotency_key_missing,
	// idempotency_key_invalid). A JSON pointer cannot point into a request's headers, which
	// are not a JSON document; the member names the header as the request had to send it.
	Header string `json:"header,omitempty"`
}

// problemMediaType is the media type of every problem (RFC 9457).
const problemMediaType = "application/problem+json"

// WriteProblem writes an RFC 9457 problem: application/problem+json, nosniff, the status,
// and a body whose type is base followed by code. Applications use it for their own codes,
// so that every problem of a service has one shape.
func WriteProblem(w http.ResponseWriter, status int, base, code, title, detail, correlationID string) {
	writeProblem(w, Problem{Type: base + code, Title: title, Status: status, Detail: detail, Code: code,
		CorrelationID: correlationID})
}

func writeProblem(w http.ResponseWriter, p Problem) {
	body, _ := json.Marshal(p)
	w.Header().Set("Content-Type", problemMediaType)
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(p.Status)
	_, _ = w.Write(body)
}

// problem writes one of this package's problems (the table above). A code that is none of
// them (Refuse called with an application's own code, which is WriteProblem's) is logged and
// answered 500 internal_error: a status of 0 would go out as a 200 and, on a declared route,
// commit the work and store the refusal as its answer.
func (m *Middleware) problem(w http.ResponseWriter, r *http.Request, code, detail string, edit func(*Problem)) {
	spec, ok := problems[code]
	if !ok {
		m.o.Logger.Error("idem: Refuse takes only this package's problem codes (an application's own go to WriteProblem); answered 500 internal_error",
			"code", code, "request_id", r.Header.Get(m.o.CorrelationHeader))
		code, detail, edit = CodeInternalError, "the request failed; nothing was changed; retrying with the same key is safe", nil
		spec = problems[code]
	}
	p := Problem{Type: m.o.ProblemBase + code, Title: spec.title, Status: spec.status, Detail: detail,
		Code: code, CorrelationID: r.Header.Get(m.o.CorrelationHeader)}
	if edit != nil {
		edit(&p)
	}
	writeProblem(w, p)
}

// Refuse writes one of this package's problems (a Code... constant, such as
// CodeMalformedBody) with the options of the request's declared route, or the defaults
// outside one: for a handler that finds the body malformed in a way DecodeJSON does not see
// (a required member missing). Any other code is a programming error: it is logged and
// answered 500 internal_error (the work is rolled back, nothing is stored). An application's
// own problems go through WriteProblem. CodeInProgress (a job the handler runs under a key of
// its own, with idem.Do, is still running elsewhere) is 409 with Retry-After: 1 (unless the
// handler set one) and is not the request's final answer: its work is rolled back and nothing
// is stored, so the client's retry runs the handler again.
func Refuse(w http.ResponseWriter, r *http.Request, code, detail string) {
	problemFor(r.Context(), w, r, code, detail)
}

// problemFor writes a problem from a handler's context: the declared route's middleware, or
// the defaults outside one.
func problemFor(ctx context.Context, w http.ResponseWriter, r *http.Request, code, detail string) {
	m := defaultMiddleware
	s := stateOf(ctx)
	if s != nil {
		m = s.m
	}
	if code == CodeInProgress {
		if s != nil {
			s.inProgress = true
		}
		if w.Header().Get("Retry-After") == "" {
			w.Header().Set("Retry-After", "1")
		}
	}
	m.problem(w, r, code, detail, nil)
}
