package idemhttp

import (
	"io"
	"mime"
	"net/http"
	"strings"

	"github.com/go-json-experiment/json"
)

// DecodeJSON reads the request's JSON body into v, strictly, so that what a handler acts on
// is exactly what was fingerprinted:
//
//   - a Content-Type other than application/json or application/*+json (parameters allowed;
//     none at all is taken as JSON) is 415 unsupported_media_type;
//   - member names match struct fields by exact case (the field's json tag, or its name);
//     an unknown member, a duplicate member, invalid UTF-8 and data after the value are 400
//     malformed_body, as is any body that does not decode into v.
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
	if s := stateOf(r.Context()); s != nil && s.body != nil {
		body = s.body
	} else {
		b, err := io.ReadAll(r.Body)
		if err != nil {
			problemFor(r.Context(), w, r, CodeBodyUnreadable, "the request body could not be read")
			return false
		}
		body = b
	}
	if err := json.Unmarshal(body, v, json.RejectUnknownMembers(true), json.MatchCaseInsensitiveNames(false)); err != nil {
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
