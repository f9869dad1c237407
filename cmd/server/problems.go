package main

import (
	"context"
	"errors"
	"net/http"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/idem"
)

// problemBase prefixes the ledger's own problem types; idempotency problems use idem's.
const problemBase = "https://github.com/pgidem/pgidem/blob/main/docs/ledger.md#"

// ledgerProblems is the title of every problem code the ledger answers (docs/ledger.md).
var ledgerProblems = map[string]string{
	"unauthorized":        "Authentication required",
	"validation_failed":   "Validation failed",
	"account_not_found":   "Account not found",
	"transfer_not_found":  "Transfer not found",
	"deposit_not_found":   "Deposit not found",
	"payout_not_found":    "Payout not found",
	"currency_mismatch":   "Currency mismatch",
	"insufficient_funds":  "Insufficient funds",
	"balance_limit":       "Balance limit",
	"internal_error":      "Internal error",
	"service_unavailable": "Service unavailable",
	"shutting_down":       "Shutting down",
	"not_found":           "Not found",
	"method_not_allowed":  "Method not allowed",
}

// problem writes one of the ledger's problems, through the one problem writer of idem.
func problem(w http.ResponseWriter, r *http.Request, status int, code, detail string) {
	idem.WriteProblem(w, status, problemBase, code, ledgerProblems[code], detail, requestIDOf(r.Context()))
}

// serverError answers an error the request cannot be blamed for: 503 with Retry-After when
// the database could not be reached or dropped the connection (a retry may succeed soon),
// 500 otherwise. A retry with the same key is safe either way: it gets the answer of
// whatever took effect, or runs.
func (s *ledger) serverError(w http.ResponseWriter, r *http.Request, err error) {
	failed(s.log, r, err)
	if errors.Is(err, idem.ErrCommitUnknown) {
		// A step's COMMIT (idem.Step) was sent and its reply lost: the step may have taken
		// effect (a reservation made, money moved), so "nothing was changed" would not be
		// true. As the middleware answers its own lost COMMIT.
		w.Header().Set("Retry-After", "1")
		problem(w, r, http.StatusServiceUnavailable, idem.CodeOutcomeUnknown,
			"the connection to the database was lost while the work committed: it may or may not have taken effect; "+retryHint(r)+
				" (the retry gets its answer, or goes on from what took effect)")
		return
	}
	if errors.Is(context.Cause(r.Context()), idem.ErrShutdown) {
		// The shutdown timeout ended the work before it answered: a transfer or deposit rolled
		// back; a payout's retry runs it again under the same provider key.
		w.Header().Set("Retry-After", "1")
		problem(w, r, http.StatusServiceUnavailable, idem.CodeShuttingDown, "the server is shutting down and ended the work before it answered; "+retryHint(r))
		return
	}
	if idem.IsUnavailable(err) {
		w.Header().Set("Retry-After", "1")
		problem(w, r, http.StatusServiceUnavailable, "service_unavailable", "the database could not be reached; "+retryHint(r))
		return
	}
	if poolerCacheError(err) {
		// pgx's statement cache through a pooler that does not keep prepared statements: the
		// database failed, not the request, as the middleware answers it for its own
		// statements (D259); the log names the fix (database.go).
		w.Header().Set("Retry-After", "1")
		problem(w, r, http.StatusServiceUnavailable, "service_unavailable",
			"the database connection's prepared statements failed (a connection pooler; see the server's log); "+retryHint(r))
		return
	}
	problem(w, r, http.StatusInternalServerError, "internal_error", "nothing was changed; "+retryHint(r))
}

// retryHint is the end of serverError's details: a request that carries a key is retried
// with it; one without (a GET, a balance's read) is simply sent again.
func retryHint(r *http.Request) string {
	if r.Header.Get("Idempotency-Key") != "" {
		return "retry with the same Idempotency-Key"
	}
	return "retry the request"
}

// unrecordedPayout is serverError for a payout the provider made whose row could not be
// written: "nothing was changed" would not be true. The retry runs under the same provider key,
// which the provider answers from its record, and records the payout (D259).
func (s *ledger) unrecordedPayout(w http.ResponseWriter, r *http.Request, err error) {
	if unavailable(r, err) {
		s.serverError(w, r, err)
		return
	}
	failed(s.log, r, err)
	// "failed or was cut off": a connection lost after the recording's COMMIT was sent leaves
	// it recorded or not; the retry finds out either way.
	problem(w, r, http.StatusInternalServerError, "internal_error",
		"the provider was paid under the payout's provider key, but the payout's recording failed or was cut off; retry with the same Idempotency-Key: "+
			"the provider answers the retry from its record, and the payout is recorded once")
}

// providerFailed is serverError for a payout whose provider call failed: the call may have been
// made (the provider acted, and its answer was lost or the work's time ran out while it
// waited), so "nothing was changed" would not be true. A lease lost meanwhile is not answered
// here: another attempt may hold the key, and the middleware answers for this one when the
// handler writes nothing (D274).
func (s *ledger) providerFailed(w http.ResponseWriter, r *http.Request, err error) {
	if errors.Is(context.Cause(r.Context()), idem.ErrLeaseLost) {
		return
	}
	if errors.Is(err, errProviderKeyReused) || unavailable(r, err) {
		s.serverError(w, r, err)
		return
	}
	failed(s.log, r, err)
	problem(w, r, http.StatusInternalServerError, "internal_error",
		"the provider's call failed or was cut off, and may have been made under the payout's provider key; retry with the same Idempotency-Key: "+
			"the provider answers a repeat under that key from its record, and pays once")
}

// unavailable tells whether serverError answers err with a 503 of its own (a COMMIT whose
// outcome is unknown, the shutdown's deadline, a database that could not be reached, pgx's
// statement cache through a pooler): the answers that say neither "nothing was changed" nor
// anything a route's own 500 would say. The payout routes' helpers defer to it.
func unavailable(r *http.Request, err error) bool {
	return errors.Is(err, idem.ErrCommitUnknown) || errors.Is(context.Cause(r.Context()), idem.ErrShutdown) ||
		idem.IsUnavailable(err) || poolerCacheError(err)
}

// poolerCacheError tells whether err is pgx's statement cache failing through a connection
// pooler that does not keep prepared statements (PgBouncer 1.18 in transaction mode):
// SQLSTATE 26000 or 42P05 about one of pgx's own statements.
func poolerCacheError(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "26000" || pgErr.Code == "42P05") && strings.Contains(pgErr.Message, "stmtcache_")
}

// stepError is serverError for a stepped payout that failed after its first step: the steps
// it did are recorded with the key, so "nothing was changed" would not be true; the retry
// with the key goes on after them.
func (s *ledger) stepError(w http.ResponseWriter, r *http.Request, err error) {
	if unavailable(r, err) {
		s.serverError(w, r, err)
		return
	}
	failed(s.log, r, err)
	problem(w, r, http.StatusInternalServerError, "internal_error",
		"the payout stopped after some of its steps, which are recorded with the key; retry with the same Idempotency-Key to finish it")
}

func invalid(w http.ResponseWriter, r *http.Request, detail string) {
	problem(w, r, http.StatusUnprocessableEntity, "validation_failed", detail)
}

func accountNotFound(w http.ResponseWriter, r *http.Request) {
	problem(w, r, http.StatusNotFound, "account_not_found", "no such account")
}
