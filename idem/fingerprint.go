package idem

import (
	"net/http"

	"github.com/pgidem/pgidem/internal/canon"
	idemhttp "github.com/pgidem/pgidem/internal/http"
)

// Fingerprint identifies a request (ComputeFingerprint).
type Fingerprint struct {
	// Sum is SHA-256 over the upper-case method, "\n", the escaped path, "\n" and the
	// canonical body: what Claim.Fingerprint takes.
	Sum [32]byte
	// JSON tells whether the body was canonicalized as JSON (false: hashed as raw bytes, or
	// empty).
	JSON bool
	// Fields maps every top-level member name of a JSON object body to the hex SHA-256 of its
	// canonical value (Claim.Fields): they let a mismatch name the changed fields. Nil when
	// the body is not a JSON object, has more than 64 members, or its member names take more
	// than 4,096 bytes together (the names are stored with the key).
	Fields map[string]string
	// Ambiguous is why a strictly valid JSON body must still be refused, or "": a string or
	// member name holds U+0000, or two member names of one object differ only in case.
	Ambiguous string
}

// ComputeFingerprint returns the fingerprint of a request whose body is sent as JSON (a JSON
// Content-Type, or none), as the middleware computes it: SHA-256 over the upper-case method,
// "\n", the escaped path (no query), "\n" and the canonical body (RFC 8785 for strictly valid
// JSON, with every number's exact digits; the raw bytes otherwise). A route whose meaning is
// narrower than its JSON body sets Route.Fingerprint to a function built on it; keep the
// numbers' digits when it rewrites the body (json.Decoder.UseNumber, not float64). For a
// request of any Content-Type, RequestFingerprint is the middleware's own.
func ComputeFingerprint(method, escapedPath string, body []byte) Fingerprint {
	return Fingerprint(canon.Compute(method, escapedPath, body))
}

// RequestFingerprint returns the middleware's default fingerprint of r with this body (the
// one Route.Fingerprint replaces): ComputeFingerprint for a body sent as JSON (a JSON
// Content-Type, or none) or an empty one; for a body declared as another type (text/plain,
// a form, an image), which its handler reads as it is, SHA-256 over its bytes exactly,
// whatever they hold ("1.10" and "1.1" are two requests there), in a form no JSON body's
// fingerprint takes.
func RequestFingerprint(r *http.Request, body []byte) Fingerprint {
	if len(body) > 0 && !idemhttp.SentAsJSON(r) {
		return Fingerprint(canon.ComputeRaw(r.Method, r.URL.EscapedPath(), body))
	}
	return ComputeFingerprint(r.Method, r.URL.EscapedPath(), body)
}
