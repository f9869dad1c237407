package idemhttp

import (
	"encoding/json"
	"net/http"
)

// Problem codes: the `code` member of every problem this package writes, and the anchor of
// its type URI.
const (
	CodeKeyMissing       = "idempotency_key_missing"
	CodeKeyInvalid       = "idempotency_key_invalid"
	CodeKeyReuse         = "idempotency_key_reuse"
	CodeInProgress       = "request_in_progress"
	CodeOneTimeSecret    = "one_time_secret"
	CodeNotReplayable    = "response_not_replayable"
	CodeRequestTooLarge  = "request_too_large"
	CodePrincipalUnknown = "principal_unknown"
	CodeInternalError    = "internal_error"
	CodeStoreUnavailable = "store_unavailable"
	CodeBodyUnreadable   = "request_body_unreadable"
	problemContentType   = "application/problem+json"
)

var problemTitles = map[string]string{
	CodeKeyMissing:       "Idempotency-Key required",
	CodeBodyUnreadable:   "Request body unreadable",
	CodeKeyInvalid:       "Idempotency-Key malformed",
	CodeKeyReuse:         "Idempotency key reused for another request",
	CodeInProgress:       "A request with this idempotency key is in progress",
	CodeOneTimeSecret:    "The response was a one-time secret",
	CodeNotReplayable:    "The response cannot be replayed",
	CodeRequestTooLarge:  "Request body too large",
	CodePrincipalUnknown: "Unknown principal",
	CodeInternalError:    "Internal error",
	CodeStoreUnavailable: "Idempotency store unavailable",
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
	// ChangedFields names the top-level request fields that differ (idempotency_key_reuse).
	ChangedFields []string `json:"changed_fields,omitempty"`
	// ResourceID is the id of what the first request created (response_not_replayable).
	ResourceID string `json:"resource_id,omitempty"`
}

func (m *Middleware) problem(w http.ResponseWriter, r *http.Request, status int, code, detail string, edit func(*Problem)) {
	p := Problem{Type: m.o.ProblemBase + code, Title: problemTitles[code], Status: status, Detail: detail,
		Code: code, CorrelationID: r.Header.Get(m.o.CorrelationHeader)}
	if edit != nil {
		edit(&p)
	}
	body, _ := json.Marshal(p)
	w.Header().Set("Content-Type", problemContentType)
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}
