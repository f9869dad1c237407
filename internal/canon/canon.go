// Package canon computes the fingerprint of a request: SHA-256 over the upper-case method,
// "\n", the escaped path (no query), "\n", and the canonical body.
//
// The canonical body is the RFC 8785 (JSON Canonicalization Scheme) form of a body that is
// strictly valid JSON, and the raw bytes of any other body. Strictly valid means: the RFC 8259
// grammar, valid UTF-8, no lone surrogate in a \u escape, no duplicate member name in any
// object, at most [MaxDepth] levels of nesting and exponents of at most 15 digits. A body
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
// The cost is linear in the size of the body (plus n log n to sort the members of each
// object), whatever its shape; github.com/gowebpki/jcs, which this package is checked
// against, is quadratic on deep nesting and on many members.
package canon

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// MaxDepth is the deepest nesting of arrays and objects that is canonicalized; a deeper
// body is fingerprinted as raw bytes.
const MaxDepth = 128

// MaxFields is the most top-level members for which Compute reports per-field hashes. A
// larger object gets none (Fields is nil, and a mismatch cannot name the changed fields):
// the hashes are stored with the key, and 64 bytes per member of an object with thousands
// of members would make every key row huge.
const MaxFields = 64

// maxExponentDigits bounds the significant digits of a number's exponent (1e999999999999999
// is canonicalized, a longer exponent is not), so positions fit in an int64.
const maxExponentDigits = 15

// Fingerprint is what identifies a request.
type Fingerprint struct {
	// Sum is SHA-256 over method, "\n", escaped path, "\n", canonical body.
	Sum [sha256.Size]byte
	// JSON tells whether the body was canonicalized as JSON (false: hashed as raw bytes,
	// or empty).
	JSON bool
	// Fields maps every top-level member name of a JSON object body to the hex SHA-256 of
	// its canonical value: what idem_begin's p_request_fields takes to name the changed
	// fields of a mismatch. Nil when the body is not a JSON object or has more than
	// MaxFields members.
	Fields map[string]string
	// Ambiguous is why a strictly valid JSON body must still be refused, or "": a string or
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
	h := sha256.New()
	h.Write([]byte(strings.ToUpper(method)))
	h.Write([]byte{'\n'})
	h.Write([]byte(escapedPath))
	h.Write([]byte{'\n'})
	var fp Fingerprint
	if len(body) > 0 {
		if t, err := parse(body); err == nil {
			fp.JSON = true
			switch {
			case t.nul:
				fp.Ambiguous = AmbiguousNUL
			case t.caseDup:
				fp.Ambiguous = AmbiguousCase
			}
			buf := write(h, t, 0, make([]byte, 0, 4096+64))
			n := 0
			for c := t.nodes[0].first; t.nodes[0].kind == '{' && c >= 0 && n <= MaxFields; c = t.nodes[c].next {
				n++
			}
			if t.nodes[0].kind == '{' && n <= MaxFields {
				fp.Fields = make(map[string]string, n)
				fh := sha256.New()
				var sum [sha256.Size]byte
				for c := t.nodes[0].first; c >= 0; c = t.nodes[c].next {
					fh.Reset()
					buf = write(fh, t, c, buf)
					fp.Fields[string(t.bytes(t.nodes[c].name))] = hex.EncodeToString(fh.Sum(sum[:0]))
				}
			}
		} else {
			h.Write(body)
		}
	}
	h.Sum(fp.Sum[:0])
	return fp
}

// Canonicalize returns the canonical form of a strictly valid JSON text (see the package
// comment), or an error that says why the text is not one.
func Canonicalize(data []byte) ([]byte, error) {
	t, err := parse(data)
	if err != nil {
		return nil, err
	}
	var out bytes.Buffer
	out.Grow(len(data))
	write(&out, t, 0, make([]byte, 0, 4096+64))
	return out.Bytes(), nil
}

// ErrNotCanonical wraps every reason a text is not canonicalized.
var ErrNotCanonical = errors.New("canon: not strictly valid JSON")

// span locates bytes: data[off:off+n] when off >= 0, arena[-off-1:][:n] when off < 0.
type span struct{ off, n int32 }

// node is one parsed JSON value in a flat slice that holds no pointers, so one allocation
// grows for the whole body and the garbage collector never scans it. Children form a
// linked list through next; an object's members are relinked in canonical order when the
// object ends. Strings without escapes and numbers already in canonical form point into
// the input; others into the arena.
type node struct {
	kind  byte // '{', '[', '"', '0' (number), 't', 'f', 'n'
	text  span // string: the decoded bytes; number: the canonical text
	name  span // member name, when the parent is an object
	first int32
	next  int32
}

// tree is a parsed body; the root is nodes[0].
type tree struct {
	data    []byte
	arena   []byte
	nodes   []node
	nul     bool // a string or name holds U+0000
	caseDup bool // two names of one object differ only in case
}

func (t *tree) bytes(s span) []byte {
	if s.off >= 0 {
		return t.data[s.off : s.off+s.n]
	}
	o := -s.off - 1
	return t.arena[o : o+s.n]
}

type parser struct {
	tree
	pos     int
	depth   int
	order   []int32 // scratch stack of member indices, for sorting
	scratch []byte
}

// parse returns the tree of a strictly valid JSON text.
func parse(data []byte) (*tree, error) {
	if len(data) > math.MaxInt32/2 {
		return nil, fmt.Errorf("%w: larger than %d bytes", ErrNotCanonical, math.MaxInt32/2)
	}
	p := parser{tree: tree{data: data, nodes: make([]node, 0, 16+len(data)/8)}}
	p.space()
	if _, err := p.value(); err != nil {
		return nil, err
	}
	p.space()
	if p.pos != len(p.data) {
		return nil, p.fail("data after the top-level value")
	}
	return &p.tree, nil
}

func (p *parser) fail(what string) error {
	return fmt.Errorf("%w: %s at byte %d", ErrNotCanonical, what, p.pos)
}

func (p *parser) space() {
	for p.pos < len(p.data) {
		switch p.data[p.pos] {
		case ' ', '\t', '\n', '\r':
			p.pos++
		default:
			return
		}
	}
}

func (p *parser) add(kind byte, text span) int32 {
	p.nodes = append(p.nodes, node{kind: kind, text: text, first: -1, next: -1})
	return int32(len(p.nodes) - 1)
}

func (p *parser) literal(word string, kind byte) (int32, error) {
	if !bytes.HasPrefix(p.data[p.pos:], []byte(word)) {
		return 0, p.fail("invalid literal")
	}
	p.pos += len(word)
	return p.add(kind, span{}), nil
}

func (p *parser) value() (int32, error) {
	if p.pos >= len(p.data) {
		return 0, p.fail("unexpected end")
	}
	switch c := p.data[p.pos]; {
	case c == '{':
		return p.object()
	case c == '[':
		return p.array()
	case c == '"':
		s, err := p.string()
		return p.add('"', s), err
	case c == 't':
		return p.literal("true", 't')
	case c == 'f':
		return p.literal("false", 'f')
	case c == 'n':
		return p.literal("null", 'n')
	case c == '-' || (c >= '0' && c <= '9'):
		s, err := p.number()
		return p.add('0', s), err
	}
	return 0, p.fail("unexpected character")
}

func (p *parser) enter() error {
	p.depth++
	if p.depth > MaxDepth {
		return p.fail(fmt.Sprintf("nesting deeper than %d", MaxDepth))
	}
	p.pos++
	p.space()
	return nil
}

func (p *parser) object() (int32, error) {
	if err := p.enter(); err != nil {
		return 0, err
	}
	obj := p.add('{', span{})
	base := len(p.order)
	if p.pos < len(p.data) && p.data[p.pos] == '}' {
		p.pos++
		p.depth--
		return obj, nil
	}
	for {
		if p.pos >= len(p.data) || p.data[p.pos] != '"' {
			return 0, p.fail("expected a member name")
		}
		name, err := p.string()
		if err != nil {
			return 0, err
		}
		p.space()
		if p.pos >= len(p.data) || p.data[p.pos] != ':' {
			return 0, p.fail("expected ':'")
		}
		p.pos++
		p.space()
		child, err := p.value()
		if err != nil {
			return 0, err
		}
		p.nodes[child].name = name
		p.order = append(p.order, child)
		p.space()
		if p.pos >= len(p.data) {
			return 0, p.fail("unexpected end in an object")
		}
		if p.data[p.pos] == '}' {
			p.pos++
			break
		}
		if p.data[p.pos] != ',' {
			return 0, p.fail("expected ',' or '}'")
		}
		p.pos++
		p.space()
	}
	p.depth--
	// RFC 8785: members sorted by the UTF-16 code units of their names. Equal neighbours
	// after sorting are duplicates, which make the text ambiguous.
	members := p.order[base:]
	name := func(i int32) []byte { return p.bytes(p.nodes[i].name) }
	slices.SortFunc(members, func(a, b int32) int { return compareUTF16(name(a), name(b)) })
	for i := 1; i < len(members); i++ {
		if bytes.Equal(name(members[i]), name(members[i-1])) {
			return 0, fmt.Errorf("%w: duplicate member name %q", ErrNotCanonical, name(members[i]))
		}
	}
	if !p.caseDup {
		p.caseDup = foldDuplicates(members, name)
	}
	p.nodes[obj].first = members[0]
	for i := 1; i < len(members); i++ {
		p.nodes[members[i-1]].next = members[i]
	}
	p.nodes[members[len(members)-1]].next = -1
	p.order = p.order[:base]
	return obj, nil
}

// foldDuplicates tells whether two of the members have names that are equal under the case
// folding of bytes.EqualFold (which encoding/json uses to match names). Small objects compare
// pairwise; larger ones sort their folded names.
func foldDuplicates(members []int32, name func(int32) []byte) bool {
	if len(members) <= 16 {
		for i := range members {
			for j := i + 1; j < len(members); j++ {
				if bytes.EqualFold(name(members[i]), name(members[j])) {
					return true
				}
			}
		}
		return false
	}
	folded := make([][]byte, len(members))
	for i, m := range members {
		folded[i] = foldName(name(m))
	}
	slices.SortFunc(folded, bytes.Compare)
	for i := 1; i < len(folded); i++ {
		if bytes.Equal(folded[i], folded[i-1]) {
			return true
		}
	}
	return false
}

// foldName folds a name so that foldName(x) == foldName(y) exactly when bytes.EqualFold(x, y)
// (encoding/json's own folding).
func foldName(in []byte) []byte {
	out := make([]byte, 0, len(in))
	for i := 0; i < len(in); {
		if c := in[i]; c < utf8.RuneSelf {
			if 'a' <= c && c <= 'z' {
				c -= 'a' - 'A'
			}
			out = append(out, c)
			i++
			continue
		}
		r, n := utf8.DecodeRune(in[i:])
		out = utf8.AppendRune(out, unicode.ToUpper(unicode.ToLower(r)))
		i += n
	}
	return out
}

func (p *parser) array() (int32, error) {
	if err := p.enter(); err != nil {
		return 0, err
	}
	arr := p.add('[', span{})
	if p.pos < len(p.data) && p.data[p.pos] == ']' {
		p.pos++
		p.depth--
		return arr, nil
	}
	last := int32(-1)
	for {
		child, err := p.value()
		if err != nil {
			return 0, err
		}
		if last < 0 {
			p.nodes[arr].first = child
		} else {
			p.nodes[last].next = child
		}
		last = child
		p.space()
		if p.pos >= len(p.data) {
			return 0, p.fail("unexpected end in an array")
		}
		if p.data[p.pos] == ']' {
			p.pos++
			break
		}
		if p.data[p.pos] != ',' {
			return 0, p.fail("expected ',' or ']'")
		}
		p.pos++
		p.space()
	}
	p.depth--
	return arr, nil
}

func hexDigit(c byte) (rune, bool) {
	switch {
	case c >= '0' && c <= '9':
		return rune(c - '0'), true
	case c >= 'a' && c <= 'f':
		return rune(c-'a') + 10, true
	case c >= 'A' && c <= 'F':
		return rune(c-'A') + 10, true
	}
	return 0, false
}

func (p *parser) hex4() (rune, error) {
	if p.pos+4 > len(p.data) {
		return 0, p.fail("short \\u escape")
	}
	var r rune
	for _, c := range p.data[p.pos : p.pos+4] {
		d, ok := hexDigit(c)
		if !ok {
			return 0, p.fail("invalid \\u escape")
		}
		r = r<<4 | d
	}
	p.pos += 4
	return r, nil
}

// string decodes the JSON string at p.pos (which is '"'). A string without escapes is
// returned as a slice of the input.
func (p *parser) string() (span, error) {
	p.pos++
	start := p.pos
	// Fast path: no escapes, ASCII only.
	for p.pos < len(p.data) {
		c := p.data[p.pos]
		if c == '"' {
			p.pos++
			return span{int32(start), int32(p.pos - 1 - start)}, nil
		}
		if c == '\\' || c < 0x20 || c >= utf8.RuneSelf {
			break
		}
		p.pos++
	}
	escaped := false
	arenaStart := len(p.arena)
	p.arena = append(p.arena, p.data[start:p.pos]...)
	for p.pos < len(p.data) {
		c := p.data[p.pos]
		switch {
		case c == '"':
			p.pos++
			if !escaped {
				p.arena = p.arena[:arenaStart]
				return span{int32(start), int32(p.pos - 1 - start)}, nil
			}
			return span{int32(-arenaStart - 1), int32(len(p.arena) - arenaStart)}, nil
		case c < 0x20:
			return span{}, p.fail("control character in a string")
		case c >= utf8.RuneSelf:
			r, size := utf8.DecodeRune(p.data[p.pos:])
			if r == utf8.RuneError && size <= 1 {
				return span{}, p.fail("invalid UTF-8")
			}
			p.arena = append(p.arena, p.data[p.pos:p.pos+size]...)
			p.pos += size
		case c != '\\':
			p.arena = append(p.arena, c)
			p.pos++
		default:
			escaped = true
			p.pos++
			if p.pos >= len(p.data) {
				return span{}, p.fail("unexpected end in an escape")
			}
			e := p.data[p.pos]
			p.pos++
			switch e {
			case '"', '\\', '/':
				p.arena = append(p.arena, e)
			case 'b':
				p.arena = append(p.arena, '\b')
			case 'f':
				p.arena = append(p.arena, '\f')
			case 'n':
				p.arena = append(p.arena, '\n')
			case 'r':
				p.arena = append(p.arena, '\r')
			case 't':
				p.arena = append(p.arena, '\t')
			case 'u':
				r, err := p.hex4()
				if err != nil {
					return span{}, err
				}
				if utf16.IsSurrogate(r) {
					if r >= 0xDC00 || p.pos+2 > len(p.data) || p.data[p.pos] != '\\' || p.data[p.pos+1] != 'u' {
						return span{}, p.fail("lone surrogate")
					}
					p.pos += 2
					lo, err := p.hex4()
					if err != nil {
						return span{}, err
					}
					if lo < 0xDC00 || lo > 0xDFFF {
						return span{}, p.fail("lone surrogate")
					}
					r = utf16.DecodeRune(r, lo)
				}
				if r == 0 {
					p.nul = true
				}
				p.arena = utf8.AppendRune(p.arena, r)
			default:
				return span{}, p.fail("invalid escape")
			}
		}
	}
	return span{}, p.fail("unterminated string")
}

// number reads a JSON number and returns its canonical text (see the package comment): the
// literal itself when it already is canonical, else a copy.
func (p *parser) number() (span, error) {
	lit := p.pos
	neg := false
	if p.data[p.pos] == '-' {
		neg = true
		p.pos++
	}
	digitsFrom := func() int {
		s := p.pos
		for p.pos < len(p.data) && p.data[p.pos] >= '0' && p.data[p.pos] <= '9' {
			p.pos++
		}
		return s
	}
	s := digitsFrom()
	intPart := p.data[s:p.pos]
	if len(intPart) == 0 || (len(intPart) > 1 && intPart[0] == '0') {
		return span{}, p.fail("invalid number")
	}
	var fracPart []byte
	if p.pos < len(p.data) && p.data[p.pos] == '.' {
		p.pos++
		s := digitsFrom()
		fracPart = p.data[s:p.pos]
		if len(fracPart) == 0 {
			return span{}, p.fail("invalid number: no digit after '.'")
		}
	}
	var exp int64
	if p.pos < len(p.data) && (p.data[p.pos] == 'e' || p.data[p.pos] == 'E') {
		p.pos++
		expNeg := false
		if p.pos < len(p.data) && (p.data[p.pos] == '+' || p.data[p.pos] == '-') {
			expNeg = p.data[p.pos] == '-'
			p.pos++
		}
		s := digitsFrom()
		ed := bytes.TrimLeft(p.data[s:p.pos], "0")
		if s == p.pos {
			return span{}, p.fail("invalid number: no digit in the exponent")
		}
		if len(ed) > maxExponentDigits {
			return span{}, p.fail("exponent too long")
		}
		for _, c := range ed {
			exp = exp*10 + int64(c-'0')
		}
		if expNeg {
			exp = -exp
		}
	}
	p.scratch = appendDecimal(p.scratch[:0], neg, intPart, fracPart, exp)
	if bytes.Equal(p.scratch, p.data[lit:p.pos]) {
		return span{int32(lit), int32(p.pos - lit)}, nil
	}
	o := len(p.arena)
	p.arena = append(p.arena, p.scratch...)
	return span{int32(-o - 1), int32(len(p.scratch))}, nil
}

// appendDecimal appends the exact value ±(intPart.fracPart × 10^exp) in the ECMAScript
// Number-to-String layout that RFC 8785 prescribes, using the literal's significant digits.
func appendDecimal(b []byte, neg bool, intPart, fracPart []byte, exp int64) []byte {
	// value = 0.d1d2d3... × 10^point, with the digits taken from intPart and then fracPart
	point := int64(len(intPart)) + exp
	lead := 0
	for lead < len(intPart) && intPart[lead] == '0' {
		lead++
	}
	a, c := intPart[lead:], fracPart // the significant digits are a followed by c
	point -= int64(lead)
	if len(a) == 0 {
		z := 0
		for z < len(c) && c[z] == '0' {
			z++
		}
		c = c[z:]
		point -= int64(z)
	}
	c = bytes.TrimRight(c, "0")
	if len(c) == 0 {
		a = bytes.TrimRight(a, "0")
	}
	k := int64(len(a) + len(c))
	if k == 0 {
		return append(b, '0')
	}
	digit := func(i int64) byte {
		if i < int64(len(a)) {
			return a[i]
		}
		return c[i-int64(len(a))]
	}
	digits := func(b []byte, from, to int64) []byte {
		for i := from; i < to; i++ {
			b = append(b, digit(i))
		}
		return b
	}
	if neg {
		b = append(b, '-')
	}
	n := point
	switch {
	case k <= n && n <= 21:
		b = digits(b, 0, k)
		for i := k; i < n; i++ {
			b = append(b, '0')
		}
	case 0 < n && n <= 21:
		b = digits(b, 0, n)
		b = append(b, '.')
		b = digits(b, n, k)
	case -6 < n && n <= 0:
		b = append(b, '0', '.')
		for i := n; i < 0; i++ {
			b = append(b, '0')
		}
		b = digits(b, 0, k)
	default:
		b = append(b, digit(0))
		if k > 1 {
			b = append(b, '.')
			b = digits(b, 1, k)
		}
		b = append(b, 'e')
		if n-1 >= 0 {
			b = append(b, '+')
		}
		b = strconv.AppendInt(b, n-1, 10)
	}
	return b
}

// compareUTF16 orders two strings by their UTF-16 code units (RFC 8785 section 3.2.3).
func compareUTF16(a, b []byte) int {
	for i, j := 0, 0; ; {
		if i == len(a) || j == len(b) {
			return (len(a) - i) - (len(b) - j) // the one with something left is greater
		}
		ca, cb := a[i], b[j]
		if ca < utf8.RuneSelf && cb < utf8.RuneSelf {
			if ca != cb {
				return int(ca) - int(cb)
			}
			i++
			j++
			continue
		}
		ra, sa := utf8.DecodeRune(a[i:])
		rb, sb := utf8.DecodeRune(b[j:])
		if ra != rb {
			return utf16Key(ra) - utf16Key(rb)
		}
		i += sa
		j += sb
	}
}

// utf16Key maps a rune to a number that orders like its UTF-16 code units: supplementary
// characters (surrogate pairs, 0xD800-0xDBFF first) sort before U+E000..U+FFFF.
func utf16Key(r rune) int {
	if r >= 0x10000 {
		hi, lo := utf16.EncodeRune(r)
		return int(hi)<<16 | int(lo)
	}
	return int(r) << 16
}

// writer appends the canonical text to a buffer and hands it to out in blocks.
type writer struct {
	out interface{ Write([]byte) (int, error) }
	buf []byte
}

func (w *writer) flushIfFull() {
	if len(w.buf) >= 4096 {
		w.flush()
	}
}

func (w *writer) flush() {
	if len(w.buf) > 0 {
		w.out.Write(w.buf)
		w.buf = w.buf[:0]
	}
}

func (w *writer) str(s []byte) {
	const hexdigits = "0123456789abcdef"
	w.buf = append(w.buf, '"')
	start := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' {
			continue
		}
		w.buf = append(w.buf, s[start:i]...)
		switch c {
		case '"':
			w.buf = append(w.buf, '\\', '"')
		case '\\':
			w.buf = append(w.buf, '\\', '\\')
		case '\b':
			w.buf = append(w.buf, '\\', 'b')
		case '\f':
			w.buf = append(w.buf, '\\', 'f')
		case '\n':
			w.buf = append(w.buf, '\\', 'n')
		case '\r':
			w.buf = append(w.buf, '\\', 'r')
		case '\t':
			w.buf = append(w.buf, '\\', 't')
		default:
			w.buf = append(w.buf, '\\', 'u', '0', '0', hexdigits[c>>4], hexdigits[c&0xF])
		}
		start = i + 1
		w.flushIfFull()
	}
	w.buf = append(w.buf, s[start:]...)
	w.buf = append(w.buf, '"')
	w.flushIfFull()
}

func (w *writer) value(t *tree, i int32) {
	nodes := t.nodes
	n := &nodes[i]
	switch n.kind {
	case '{', '[':
		open, close := n.kind, byte('}')
		if open == '[' {
			close = ']'
		}
		w.buf = append(w.buf, open)
		for c := n.first; c >= 0; c = nodes[c].next {
			if c != n.first {
				w.buf = append(w.buf, ',')
			}
			if open == '{' {
				w.str(t.bytes(nodes[c].name))
				w.buf = append(w.buf, ':')
			}
			w.value(t, c)
		}
		w.buf = append(w.buf, close)
	case '"':
		w.str(t.bytes(n.text))
	case '0':
		w.buf = append(w.buf, t.bytes(n.text)...)
	case 't':
		w.buf = append(w.buf, "true"...)
	case 'f':
		w.buf = append(w.buf, "false"...)
	case 'n':
		w.buf = append(w.buf, "null"...)
	}
	w.flushIfFull()
}

// write writes the canonical text of v to out.
func write(out interface{ Write([]byte) (int, error) }, t *tree, i int32, buf []byte) []byte {
	w := writer{out: out, buf: buf[:0]}
	w.value(t, i)
	w.flush()
	return w.buf
}
