package idem

import "github.com/pgidem/pgidem/internal/canon"

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

// ComputeFingerprint returns the fingerprint of a request as the middleware computes it:
// SHA-256 over the upper-case method, "\n", the escaped path (no query), "\n" and the
// canonical body (RFC 8785 for strictly valid JSON, the raw bytes otherwise). A route whose
// meaning is narrower than its body sets Route.Fingerprint to a function built on it.
func ComputeFingerprint(method, escapedPath string, body []byte) Fingerprint {
	return Fingerprint(canon.Compute(method, escapedPath, body))
}
