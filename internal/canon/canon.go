// Package canon computes the fingerprint of a request: SHA-256 over the upper-case method,
// "\n", the escaped path (no query), "\n", and the canonical body.
//
// The canonical body is the RFC 8785 (JSON Canonicalization Scheme) form of a body that is
// strictly valid JSON, and the raw bytes of any other body. Strictly valid means: the RFC 8259
// grammar, valid UTF-8, no lone surrogate in a \u escape, no duplicate member name in any
// object, at most [MaxDepth] levels of nesting and exponents of at most 16 digits (as written
// and in the canonical form). A body
// that fails any of these is not an error: it is fingerprinted as its bytes, so two requests
// share a fingerprint exactly when their bytes are equal.
//
// One deliberate difference from RFC 8785: numbers keep their exact decimal value. RFC 8785
// formats every number as the IEEE 754 double nearest to it, so 9007199254740993 and
// 9007199254740992 (two different amounts) would canonicalize alike and a different transfer
// would replay an old answer. Here a number is written in the RFC 8785 (ECMAScript) layout,
// but with the literal's own significant digits: 1, 1.0, 10e-1 and 1e0 are all "1";
// 4.50 is "4.5", 1E30 is "1e+30", exactly as RFC 8785 writes them; 9007199254740993 stays
// 9007199254740993. For every number whose digits are the shortest ones that round-trip
// through a double (every number a JSON encoder writes from a float64), the output is byte
// for byte RFC 8785's; only literals with more precision than a double differ.
//
// The cost is linear in the size of the body, whatever its shape: an object's members are
// radix-sorted on their names' bytes (comparison-sorted below 256 members), however long
// the prefixes the names share, and the case check hashes every folded name once, with a
// per-process random seed. github.com/gowebpki/jcs, which this package is checked against,
// is quadratic on deep nesting and on many members.
package canon

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"strings"
)

// MaxDepth is the deepest nesting of arrays and objects that is canonicalized; a deeper
// body is fingerprinted as raw bytes.
const MaxDepth = 128

// MaxFields is the most top-level members for which Compute reports per-field hashes. A
// larger object gets none (Fields is nil, and a mismatch cannot name the changed fields):
// the hashes are stored with the key, and 64 bytes per member of an object with thousands
// of members would make every key row huge.
const MaxFields = 64

// MaxFieldNameBytes is the most bytes (UTF-8, after unescaping) that the top-level member
// names of an object may take together for Compute to report per-field hashes. The names are
// stored with the key, and they are the one part of a request that is: without this bound
// a client could make a key's row as large as the request body with one long name. A larger
// total gets no hashes, as for more than MaxFields members.
const MaxFieldNameBytes = 4096

// maxExponentDigits bounds the significant digits of a number's exponent, as written and in its
// canonical form (1e9999999999999999 is canonicalized; a longer exponent is not, nor
// 10e9999999999999999, whose canonical exponent is 10000000000000000), so positions fit in an
// int64 and a canonical text canonicalizes again to itself: no body hashed as its bytes is the
// canonical text of another (D178; it was 15 for both, and 10e999999999999999's canonical
// 1e+1000000000000000 was hashed as its bytes).
const maxExponentDigits = 16

// Fingerprint is what identifies a request.
type Fingerprint struct {
	// Sum is SHA-256 over method, "\n", escaped path, "\n", canonical body.
	Sum [sha256.Size]byte
	// JSON tells whether the body was canonicalized as JSON (false: hashed as raw bytes,
	// or empty).
	JSON bool
	// Fields maps every top-level member name of a JSON object body to the hex SHA-256 of
	// its canonical value: what idem_begin's p_request_fields takes to name the changed
	// fields of a mismatch. Nil when the body is not a JSON object, has more than
	// MaxFields members, or its member names take more than MaxFieldNameBytes together.
	Fields map[string]string
	// Ambiguous is why a strictly valid JSON body must still be refused, or "" (the case
	// duplicate when there are both): a string or
	// member name holds U+0000 (PostgreSQL's jsonb and text cannot store it), or two member
	// names of one object differ only in case (decoders such as encoding/json match names
	// case-insensitively, so the request would not mean what its fingerprint says).
	Ambiguous string
}

// The reasons in Fingerprint.Ambiguous.
const (
	AmbiguousNUL  = "a string or member name holds U+0000"
	AmbiguousCase = "two member names of one object differ only in case"
)

// Compute returns the fingerprint of a request. method is upper-cased; escapedPath is the
// request's escaped path without the query (url.URL.EscapedPath); body is the whole body,
// nil or empty when there is none.
func Compute(method, escapedPath string, body []byte) Fingerprint {
	fp, _ := compute(method, escapedPath, body, false)
	return fp
}

// ComputeRaw returns the fingerprint of a request whose body is hashed as its bytes, whatever
// they hold: a body declared as another type than JSON, which its handler reads as it is.
// SHA-256 over the upper-case method, " bytes", '\n', the escaped path, '\n' and the body: the
// first line holds a space, which no method does, so it never equals a fingerprint of Compute
// (D178), whose raw form releases before D178 gave such a body when it was not strictly valid
// JSON, and whose canonical form they gave it when it was.
func ComputeRaw(method, escapedPath string, body []byte) Fingerprint {
	h := sha256.New()
	h.Write([]byte(strings.ToUpper(method)))
	h.Write([]byte(" bytes\n"))
	h.Write([]byte(escapedPath))
	h.Write([]byte{'\n'})
	h.Write(body)
	var fp Fingerprint
	h.Sum(fp.Sum[:0])
	return fp
}

// ComputeCanonical is Compute that also returns the canonical body the fingerprint was
// computed from: the RFC 8785 form of a strictly valid JSON body, numbers exact (see the
// package comment), from the same parse. A handler that decodes it instead of the raw body
// acts on exactly what was fingerprinted: 1e2 and 100, or {"a":1,"b":2} and {"b":2,"a":1},
// share a fingerprint and decode alike. The canonical body is nil when the body is not
// strictly valid JSON (Fingerprint.JSON is false: the fingerprint is over the raw bytes). It
// is returned for an Ambiguous body too, which the caller must still refuse. It costs one
// buffer of about the body's size more than Compute.
func ComputeCanonical(method, escapedPath string, body []byte) (Fingerprint, []byte) {
	return compute(method, escapedPath, body, true)
}

// ComputeBefore178 is Compute as the releases before D178 computed it: an exponent of 16
// digits made a body not strictly valid (hashed as its bytes), and none was refused for its
// canonical form. The same as Compute for every other body (the golden digests). For keys
// those releases stored.
func ComputeBefore178(method, escapedPath string, body []byte) Fingerprint {
	fp, _ := computeRule(method, escapedPath, body, false, true)
	return fp
}

// compute is Compute, and when keep is set also returns the canonical body.
func compute(method, escapedPath string, body []byte, keep bool) (Fingerprint, []byte) {
	return computeRule(method, escapedPath, body, keep, false)
}

// computeRule is compute, under the rule of the releases before D178 when before178 is set.
func computeRule(method, escapedPath string, body []byte, keep, before178 bool) (Fingerprint, []byte) {
	h := sha256.New()
	h.Write([]byte(strings.ToUpper(method)))
	h.Write([]byte{'\n'})
	h.Write([]byte(escapedPath))
	h.Write([]byte{'\n'})
	var fp Fingerprint
	var canonical []byte
	if len(body) > 0 {
		if t, err := parseRule(body, before178); err == nil {
			fp.JSON = true
			switch { // the case first: DecodeJSON refuses it without a key too (D178)
			case t.caseDup:
				fp.Ambiguous = AmbiguousCase
			case t.nul:
				fp.Ambiguous = AmbiguousNUL
			}
			var out *bytes.Buffer // the canonical text, kept
			var dst interface{ Write([]byte) (int, error) } = h
			if keep {
				out = bytes.NewBuffer(make([]byte, 0, len(body)))
				dst = out
			}
			n, names := 0, 0
			for c := t.nodes[0].first(); t.nodes[0].kind == '{' && c >= 0 && n <= MaxFields && names <= MaxFieldNameBytes; c = t.nodes[c].next {
				n++
				names += len(t.bytes(t.nodes[c].text))
			}
			if t.nodes[0].kind == '{' && n <= MaxFields && names <= MaxFieldNameBytes {
				fp.Fields = make(map[string]string, n)
				writeFields(dst, &t.tree, fp.Fields)
			} else {
				write(dst, &t.tree, 0)
			}
			t.release()
			if keep {
				canonical = out.Bytes()
				h.Write(canonical)
			}
		} else {
			h.Write(body)
		}
	}
	h.Sum(fp.Sum[:0])
	return fp, canonical
}

// Canonicalize returns the canonical form of a strictly valid JSON text (see the package
// comment), or an error that says why the text is not one.
func Canonicalize(data []byte) ([]byte, error) {
	c, _, err := CanonicalizeAmbiguous(data)
	return c, err
}

// CanonicalizeAmbiguous is Canonicalize, and also says why the text must still be refused,
// as Fingerprint.Ambiguous does (AmbiguousNUL, AmbiguousCase), or "".
func CanonicalizeAmbiguous(data []byte) (canonical []byte, ambiguous string, err error) {
	t, err := parse(data)
	if err != nil {
		return nil, "", err
	}
	switch { // the case first: DecodeJSON refuses it without a key too (D178)
	case t.caseDup:
		ambiguous = AmbiguousCase
	case t.nul:
		ambiguous = AmbiguousNUL
	}
	var out bytes.Buffer
	out.Grow(len(data))
	write(&out, &t.tree, 0)
	t.release()
	return out.Bytes(), ambiguous, nil
}

// ErrNotCanonical wraps every reason a text is not canonicalized.
var ErrNotCanonical = errors.New("canon: not strictly valid JSON")
