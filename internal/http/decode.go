package idemhttp

import (
	"io"
	"mime"
	"net/http"
	"strings"

	"github.com/go-json-experiment/json"

	"github.com/pgidem/pgidem/internal/canon"
)

// DecodeJSON reads the request's JSON body into v, strictly, so that what a handler acts on
// is exactly what was fingerprinted:
//
//   - a Content-Type other than application/json or application/*+json (parameters allowed;
//     none at all is taken as JSON) is 415 unsupported_media_type;
//   - it decodes the canonical form of the body (RFC 8785, as the fingerprint hashes it), so
//     bodies that share a fingerprint decode alike: 1e2, 100.0 and 100 are all the number
//     100, and "\u0041" is "A";
//   - member names match struct fields by exact case (the field's json tag, or its name);
//     an unknown member, a duplicate member, two names that differ only in case (whatever v
//     is, a map included), invalid UTF-8, data after the value, nesting deeper than 128
//     levels and an exponent of more than 16 digits (what the fingerprint does not
//     canonicalize) are 400 malformed_body, as is any body that does not decode into v.
//
// Numbers are exact: the canonical form keeps every digit of the literal, but writes an
// integer from 10^21 on and a fraction below 10^-6 with an exponent (1e+21, 1.5e-7). Besides
// the v2 semantics' own types (float64, the integer types, anything with an UnmarshalJSON that
// takes such a text), it reads encoding/json's Number (the canonical text: 12.5, 1e+21; or a
// string that is a number), time.Duration (an integer of nanoseconds, as encoding/json does)
// and math/big's Int (an integer, in either layout, of at most 10,000 digits). A type that
// cannot read the exponent layout refuses those numbers: take them as strings.
//
// On a declared route it decodes the very bytes the middleware read and fingerprinted. On
// failure it writes the problem and returns false; both statuses are final (stored for a
// keyed request). It uses the encoding/json v2 semantics of github.com/go-json-experiment/json,
// which are strict by design.
func DecodeJSON(w http.ResponseWriter, r *http.Request, v any) bool {
	if r.Header.Get("Content-Type") != "" && !jsonContent(r) {
		problemFor(r.Context(), w, r, CodeUnsupportedMedia, "send the body as application/json")
		return false
	}
	var body []byte
	s := stateOf(r.Context())
	if s != nil && s.body != nil {
		body = s.body
	} else {
		b, err := io.ReadAll(r.Body)
		if err != nil {
			code, detail := bodyProblem(err)
			problemFor(r.Context(), w, r, code, detail)
			return false
		}
		body = b
	}
	switch {
	case s != nil && s.canonical != nil:
		body = s.canonical
	default:
		// Not canonicalized yet (a request without a key): the same text the fingerprint
		// would hash. A body that is not strictly valid JSON (the fingerprint hashes it as its
		// bytes) is refused as a keyed request's is before its claim, so that a request gets
		// one answer with a key and without: an exponent of more than 16 digits or nesting
		// deeper than 128 levels too, which a JSON decoder alone might take (D162).
		// Names that differ only in case are refused whatever the target (a map would keep
		// both), as a keyed request's body is before its claim. (U+0000 is the handler's to
		// judge here: without a key nothing is stored.)
		c, ambiguous, err := canon.CanonicalizeAmbiguous(body)
		if ambiguous == canon.AmbiguousCase {
			problemFor(r.Context(), w, r, CodeMalformedBody, "the body is ambiguous: "+ambiguous)
			return false
		}
		if err != nil {
			problemFor(r.Context(), w, r, CodeMalformedBody, notStrictJSON)
			return false
		}
		body = c
		if s != nil && s.body != nil {
			s.canonical = c
		}
	}
	if err := json.Unmarshal(body, v, decodeOptions); err != nil {
		problemFor(r.Context(), w, r, CodeMalformedBody, "the body must be one JSON object with exactly the documented members (names are case-sensitive)")
		return false
	}
	return true
}

// jsonContent tells whether the request says its body is JSON: application/json or
// application/*+json, parameters allowed.
func jsonContent(r *http.Request) bool {
	mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	return err == nil && (mt == "application/json" || (strings.HasPrefix(mt, "application/") && strings.HasSuffix(mt, "+json")))
}
