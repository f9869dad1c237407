package canon

import (
	"bytes"
	"fmt"
	"math"
	"sync"
	"unsafe"
)

// The parser: a strictly valid JSON text into a flat tree (node), objects' members sorted
// as RFC 8785 orders them.

// span locates bytes: data[off:off+n] when off >= 0, arena[-off-1:][:n] when off < 0.
type span struct{ off, n int32 }

// node is one parsed JSON value, or the name of an object member, in a flat slice that
// holds no pointers, so one allocation holds the whole body and the garbage collector never
// scans it. A member is two nodes: its name (kind 'k'), then its value. Children (the names
// of an object's members) form a linked list through next; an object's members are relinked
// in canonical order when the object ends. Strings without escapes and numbers already in
// canonical form point into the input; others into the arena. An array or an object has no
// text: its text.off is its first child (first, setFirst), which keeps a node at 16 bytes.
type node struct {
	kind byte // '{', '[', '"', '0' (number), 't', 'f', 'n', 'k' (member name)
	text span // string, name: the decoded bytes; number: the canonical text
	next int32
}

// first is the first child of an array or an object, or -1.
func (n *node) first() int32 { return n.text.off }

func (n *node) setFirst(child int32) { n.text.off = child }

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
	pos int
	// scratch of the member sort (order.go) and of the case check (fold.go)
	keys, keysTmp []keyed
	fold          []byte
	// before178: the rule of the releases before D178 (an exponent of at most 15 digits as
	// written, whatever its canonical form), for ComputeBefore178.
	before178 bool
}

// parse returns the tree of a strictly valid JSON text. Give it back with release when done
// with it.
func parse(data []byte) (*parser, error) { return parseRule(data, false) }

// parseRule is parse, under the rule of the releases before D178 when before178 is set.
func parseRule(data []byte, before178 bool) (*parser, error) {
	var p *parser
	if poolParsers {
		p = parsers.Get().(*parser)
	} else {
		p = new(parser)
	}
	if err := p.parse(data, before178); err != nil {
		p.release()
		return nil, err
	}
	return p, nil
}

// parsers keeps parsers, their nodes, arena and scratch, between calls: a fingerprint is
// computed for every keyed request, and the nodes and arena of a large body were most of its
// cost (allocated, cleared, and collected again).
var parsers = sync.Pool{New: func() any { return new(parser) }}

// poolParsers is false only in the tests that count a call's own allocations: the pool drops
// a parser now and then (a quarter of them under the race detector), and its reuse would hide
// the allocations a call makes.
var poolParsers = true

// maxPooledParser bounds the bytes a parser keeps in the pool (its nodes, arena and scratch:
// what a body of a few MiB needs): a larger one is left to the garbage collector.
const maxPooledParser = 16 << 20

// release gives p back to the pool; p and its tree must not be used after.
func (p *parser) release() {
	held := cap(p.nodes)*int(unsafe.Sizeof(node{})) + cap(p.arena) + cap(p.fold) +
		(cap(p.keys)+cap(p.keysTmp))*int(unsafe.Sizeof(keyed{}))
	if !poolParsers || held > maxPooledParser {
		return
	}
	p.data = nil // the body is the caller's
	parsers.Put(p)
}

// parse parses data into p's tree, reusing p's nodes, arena and scratch.
func (p *parser) parse(data []byte, before178 bool) error {
	if len(data) > math.MaxInt32/2 {
		return fmt.Errorf("%w: larger than %d bytes", ErrNotCanonical, math.MaxInt32/2)
	}
	nodes := p.nodes[:0]
	if n := maxNodes(data); cap(nodes) < n {
		nodes = make([]node, 0, n)
	}
	*p = parser{tree: tree{data: data, nodes: nodes, arena: p.arena[:0]}, keys: p.keys, keysTmp: p.keysTmp,
		fold: p.fold, before178: before178}
	p.space()
	if err := p.value(); err != nil {
		return err
	}
	p.space()
	if p.pos != len(p.data) {
		return p.fail("data after the top-level value")
	}
	return nil
}

// maxNodes bounds the nodes of a JSON text, so that they are allocated once (growing them by
// append copied and allocated several times the final size for small values): every value
// but the first follows a ',', or the '[' or '{' that opens its container, and takes at least
// one byte more; a member name is followed by a ':'. Strings may hold those bytes too, which
// only loosens the bound.
func maxNodes(data []byte) int {
	n := 1
	for _, c := range []byte{',', '[', '{', ':'} {
		n += bytes.Count(data, []byte{c})
	}
	return min(n, 1+len(data)/2)
}

// reserve makes room for n more bytes in the arena. It doubles the arena when it grows:
// append grows a large slice by a quarter, and for a body whose values are mostly rewritten
// (long numbers not in canonical form) that allocated and copied about five times the
// arena's final size.
func (p *parser) reserve(n int) {
	if cap(p.arena)-len(p.arena) >= n {
		return
	}
	a := make([]byte, len(p.arena), max(2*cap(p.arena), len(p.arena)+n, 256))
	copy(a, p.arena)
	p.arena = a
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
	p.nodes = append(p.nodes, node{kind: kind, text: text, next: -1})
	return int32(len(p.nodes) - 1)
}

// value reads the JSON value at p.pos, arrays and objects through a stack of the open ones
// (not by recursion: a call per nested value cost more than the rest of the work on bodies
// of small values).
func (p *parser) value() error {
	type open struct {
		node int32 // the array or object
		last int32 // its last child so far (in an object, the member's name), or -1
		n    int32 // its children so far
		kind byte  // '[' or '{'
	}
	var stack [MaxDepth]open
	depth := 0
	for {
		var v int32 // the value read, once complete
		if p.pos >= len(p.data) {
			return p.fail("unexpected end")
		}
		switch c := p.data[p.pos]; {
		case c == '{' || c == '[':
			if depth == MaxDepth {
				return p.fail(fmt.Sprintf("nesting deeper than %d", MaxDepth))
			}
			v = p.add(c, span{off: -1})
			p.pos++
			p.space()
			if p.pos < len(p.data) && p.data[p.pos] == closer(c) {
				p.pos++
				break // empty
			}
			stack[depth] = open{node: v, last: -1, kind: c}
			depth++
			if c == '{' {
				if err := p.memberName(); err != nil {
					return err
				}
			}
			continue // to its first value
		case c == '"':
			s, err := p.string()
			if err != nil {
				return err
			}
			v = p.add('"', s)
		case c == 't', c == 'f', c == 'n':
			word := "null"
			if c == 't' {
				word = "true"
			} else if c == 'f' {
				word = "false"
			}
			if !bytes.HasPrefix(p.data[p.pos:], []byte(word)) {
				return p.fail("invalid literal")
			}
			p.pos += len(word)
			v = p.add(c, span{})
		case c == '-' || (c >= '0' && c <= '9'):
			s, err := p.number()
			if err != nil {
				return err
			}
			v = p.add('0', s)
		default:
			return p.fail("unexpected character")
		}
		// v is complete: link it into the innermost open container, then read a ',' and go
		// on to the next value, or the closing bracket, which completes the container.
		for {
			if depth == 0 {
				return nil
			}
			o := &stack[depth-1]
			kind := o.kind
			child := v
			if kind == '{' {
				child = v - 1 // the member's name, which the value follows
			}
			if o.last < 0 {
				p.nodes[o.node].setFirst(child)
			} else {
				p.nodes[o.last].next = child
			}
			o.last = child
			o.n++
			p.space()
			if p.pos >= len(p.data) {
				if kind == '{' {
					return p.fail("unexpected end in an object")
				}
				return p.fail("unexpected end in an array")
			}
			if p.data[p.pos] == ',' {
				p.pos++
				p.space()
				if kind == '{' {
					if err := p.memberName(); err != nil {
						return err
					}
				}
				break // to the next value
			}
			if p.data[p.pos] != closer(kind) {
				return p.fail("expected ',' or '" + string(closer(kind)) + "'")
			}
			p.pos++
			depth--
			if kind == '{' && o.n > 1 {
				// RFC 8785: members sorted by the UTF-16 code units of their names.
				if err := p.orderMembers(o.node, int(o.n)); err != nil {
					return err
				}
			}
			v = o.node
		}
	}
}

// closer is the closing bracket of an array or an object.
func closer(open byte) byte {
	if open == '{' {
		return '}'
	}
	return ']'
}

// memberName reads a member's name and the ':' after it, and adds the name's node: the
// member's value comes next.
func (p *parser) memberName() error {
	if p.pos >= len(p.data) || p.data[p.pos] != '"' {
		return p.fail("expected a member name")
	}
	name, err := p.string()
	if err != nil {
		return err
	}
	p.add('k', name)
	p.space()
	if p.pos >= len(p.data) || p.data[p.pos] != ':' {
		return p.fail("expected ':'")
	}
	p.pos++
	p.space()
	return nil
}
