package canon

import (
	"bytes"
	"fmt"
	"math"
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
	pos     int
	depth   int
	scratch []byte
	// scratch of the member sort (order.go) and of the case check (fold.go)
	keys, keysTmp []keyed
	fold          []byte
}

// parse returns the tree of a strictly valid JSON text.
func parse(data []byte) (*tree, error) {
	if len(data) > math.MaxInt32/2 {
		return nil, fmt.Errorf("%w: larger than %d bytes", ErrNotCanonical, math.MaxInt32/2)
	}
	p := parser{tree: tree{data: data, nodes: make([]node, 0, maxNodes(data))}}
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
	case c == '{' || c == '[':
		return p.container(c)
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

// container reads an array or an object (kind '[' or '{') from its opening bracket up to
// and including its closing one: comma-separated items, members of an object named.
func (p *parser) container(kind byte) (int32, error) {
	if err := p.enter(); err != nil {
		return 0, err
	}
	c := p.add(kind, span{off: -1})
	closing, what := byte(']'), "an array"
	if kind == '{' {
		closing, what = '}', "an object"
	}
	last, n := int32(-1), 0
	if p.pos < len(p.data) && p.data[p.pos] == closing {
		p.pos++
		p.depth--
		return c, nil
	}
	for {
		child := int32(-1) // the member's name, or the item
		if kind == '{' {
			if p.pos >= len(p.data) || p.data[p.pos] != '"' {
				return 0, p.fail("expected a member name")
			}
			name, err := p.string()
			if err != nil {
				return 0, err
			}
			child = p.add('k', name)
			p.space()
			if p.pos >= len(p.data) || p.data[p.pos] != ':' {
				return 0, p.fail("expected ':'")
			}
			p.pos++
			p.space()
		}
		v, err := p.value() // node child+1 in an object
		if err != nil {
			return 0, err
		}
		if child < 0 {
			child = v
		}
		if last < 0 {
			p.nodes[c].setFirst(child)
		} else {
			p.nodes[last].next = child
		}
		last = child
		n++
		p.space()
		if p.pos >= len(p.data) {
			return 0, p.fail("unexpected end in " + what)
		}
		if p.data[p.pos] == closing {
			p.pos++
			break
		}
		if p.data[p.pos] != ',' {
			return 0, p.fail("expected ',' or '" + string(closing) + "'")
		}
		p.pos++
		p.space()
	}
	p.depth--
	if kind == '{' && n > 1 {
		// RFC 8785: members sorted by the UTF-16 code units of their names.
		if err := p.orderMembers(c, n); err != nil {
			return 0, err
		}
	}
	return c, nil
}
