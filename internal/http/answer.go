package idemhttp

import (
	"context"
	"errors"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
)

// The answers the middleware writes itself: the handler's buffered response, replays, and
// the problems that stand for a decision of the store.

// answer sends the handler's response, or 500 for a panic.
func (q *request) answer(rec *recorder) {
	if rec == nil {
		detail := q.retryHint("the request failed; nothing was changed; retrying with the same key is safe")
		if q.rt.Lease > 0 {
			// A lease route's work may have changed things before it failed: a provider called,
			// steps committed. What the retry does with them depends on the key.
			detail = "the request failed; the steps it recorded are kept, and retrying with the same key is safe: " +
				"the retry goes on after them under the same provider key"
			if q.noKey {
				detail = "the request failed; the work it did outside the database or in steps before it failed may have had its effect"
			}
		}
		q.m.problem(q.w, q.r, CodeInternalError, detail, nil)
		return
	}
	rec.sendTo(q.w)
}

// storeError answers a failure of the unit of work (not of the handler), and returns the
// request's state: "" for one counted in no state (a principal the application's table does
// not hold), neither counted nor timed.
func (q *request) storeError(err error) State {
	gone := q.r.Context().Err() != nil && !errors.Is(err, dbidem.ErrCommitUnknown)
	if gone && !errors.Is(err, context.Canceled) {
		// The client is gone, or an outer middleware's deadline ended the request; the
		// transaction rolled back. A keyed unit of work outlives its client, so a failure of
		// its own is still worth a line.
		q.m.o.Logger.Warn("idem: unit of work failed after its request's context ended; rolled back", "error", err,
			"request_id", q.r.Header.Get(q.m.o.CorrelationHeader))
	}
	// Answered even when the request's context has ended: a client still connected (the
	// context ended by an outer middleware's deadline) would get net/http's empty 200
	// otherwise, and take it for the operation's success.
	if dbidem.IsWorkLockTimeout(err) {
		// The work's own statements, or its COMMIT's deferred checks, waited too long for a row
		// another transaction holds, run after run: it rolled back. Not the store's failure; a
		// retry may well pass.
		if !gone {
			q.m.o.Logger.Warn("idem: the unit of work met lock timeouts of its own; rolled back", "error", err,
				"request_id", q.r.Header.Get(q.m.o.CorrelationHeader))
		}
		q.w.Header().Set("Retry-After", "1")
		q.m.problem(q.w, q.r, CodeStoreUnavailable, q.retryHint("the request's work waited too long for a lock; "+
			"it rolled back, nothing was changed; retry with the same key"), nil)
		return StateAcquired
	}
	code, detail := errorProblem(err)
	detail = q.retryHint(detail)
	switch code {
	case CodeInProgress:
		q.inProgress(0)
		return StateBusy
	case CodePrincipalUnknown:
		// The application's table of principals has no such principal: the request is not
		// one the store failed (no store_error, which alerts), nor a claim. Counted in no
		// state and not timed, as a request refused at shutdown is.
		q.m.problem(q.w, q.r, code, detail, nil)
		return "" // no state
	case CodeStoreUnavailable, CodeOutcomeUnknown:
		q.w.Header().Set("Retry-After", "1")
	case CodeInternalError:
		// PostgreSQL refused the handler's own work (D173): the store did not fail.
		if !gone {
			q.m.o.Logger.Error("idem: unit of work failed", "error", err, "problem", code, "request_id", q.r.Header.Get(q.m.o.CorrelationHeader))
		}
		q.m.problem(q.w, q.r, code, detail, nil)
		return StateAcquired
	}
	switch {
	case gone:
		// Logged above.
	case errors.Is(err, dbidem.ErrStoreBusy):
		// Maintenance (a migration's swap, VACUUM FULL, pg_repack) locks the key table for a
		// while: expected, answered at once, and retried by the client.
		q.m.o.Logger.Warn("idem: the key table is locked; answered 503", "request_id", q.r.Header.Get(q.m.o.CorrelationHeader))
	default:
		q.m.o.Logger.Error("idem: unit of work failed", "error", err, "problem", code, "request_id", q.r.Header.Get(q.m.o.CorrelationHeader))
	}
	q.m.problem(q.w, q.r, code, detail, nil)
	return StateStoreError
}

// retryHint is detail for this request: one sent without a key is told to retry, not to
// retry "with the same key".
func (q *request) retryHint(detail string) string {
	if q.noKey {
		return withoutKey(detail)
	}
	return detail
}

// withoutKey is a problem's detail for a request that sent no key.
func withoutKey(detail string) string { return strings.ReplaceAll(detail, " with the same key", "") }

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
	id := resp.ResourceID
	if id == "" {
		id = resp.Header.Get("Location")
	}
	switch resp.Withheld {
	case dbidem.WithheldOneTimeSecret:
		q.m.problem(q.w, q.r, CodeOneTimeSecret, "the response to this request was a one-time secret and was sent once: "+
			"it cannot be sent again; to get a secret, send a new request with a new key", func(p *Problem) { p.ResourceID = id })
		return
	case dbidem.WithheldTooLarge:
		if q.r.Method != http.MethodHead {
			q.m.problem(q.w, q.r, CodeNotReplayable, "the response to this request was too large to store",
				func(p *Problem) { p.ResourceID = id })
			return
		}
		// A HEAD's answer has no body: one stored before D265 kept its GET's body, withheld
		// when it was too large, and its status and headers are the answer.
	}
	for k, v := range resp.Header {
		if replayable(k, v, resp.Body, q.r.Method == http.MethodHead) {
			q.w.Header()[k] = v
		}
	}
	if ct, _, _ := strings.Cut(resp.Header.Get("Content-Type"), ";"); strings.EqualFold(strings.TrimSpace(ct), problemMediaType) {
		// A stored problem goes out as every problem does (WriteProblem), though the header
		// is not one of the stored ones.
		q.w.Header().Set("X-Content-Type-Options", "nosniff")
	}
	if id := q.r.Header.Get(q.m.o.CorrelationHeader); id != "" && q.w.Header().Get(q.m.o.CorrelationHeader) == "" {
		q.w.Header().Set(q.m.o.CorrelationHeader, id)
	}
	q.w.WriteHeader(resp.Status)
	_, _ = q.w.Write(resp.Body)
}

// replayable tells whether a stored header goes out on a replay. The middleware stores none of
// the fields of one connection or of one response's framing or moment (StoredHeaders refuses
// them), but a row stored by an earlier configuration, or by another client through the SQL
// API, may hold them: a Content-Length that does not say the body's length cut a replay short
// or left its client waiting, a Date or Connection of the first answer went out again. They are
// left for net/http to set, but a HEAD's Content-Length with no body, its GET's (D265).
func replayable(name string, lines []string, body []byte, head bool) bool {
	if strings.EqualFold(name, "Content-Length") {
		return len(lines) == 1 && (head && len(body) == 0 && validLength(lines[0]) || lines[0] == strconv.Itoa(len(body)))
	}
	return !slices.ContainsFunc(connectionHeaders, func(c string) bool { return strings.EqualFold(c, name) })
}
