package canon

import (
	"crypto/sha256"
	"encoding/hex"
	"hash"
	"sync"
)

// blockSize is how much canonical text the writer gathers before it hands it to out.
const blockSize = 4096

// maxPooled is the largest block the pool keeps (a block grows only by less than a block
// past blockSize: longer runs of text go to out directly).
const maxPooled = 4 * blockSize

// buffers keeps the writers' blocks between calls: a fingerprint is computed for every keyed
// request, and a fresh block each time was most of the bytes the middleware allocated.
var buffers = sync.Pool{New: func() any { b := make([]byte, 0, blockSize+64); return &b }}

// writer appends the canonical text to a buffer and hands it to out in blocks, and to also
// when it is set (a member's field hash, writeFields).
type writer struct {
	out  interface{ Write([]byte) (int, error) }
	also hash.Hash
	buf  []byte
}

func (w *writer) flushIfFull() {
	if len(w.buf) >= blockSize {
		w.flush()
	}
}

func (w *writer) flush() {
	if len(w.buf) > 0 {
		w.out.Write(w.buf)
		if w.also != nil {
			w.also.Write(w.buf)
		}
		w.buf = w.buf[:0]
	}
}

// shortEscapes are the two-character escapes RFC 8785 writes (ECMAScript's
// JSON.stringify): the byte after the backslash, or 0 where a byte below 0x20 takes \u00XX.
var shortEscapes = [0x60]byte{'"': '"', '\\': '\\', '\b': 'b', '\f': 'f', '\n': 'n', '\r': 'r', '\t': 't'}

func (w *writer) str(s []byte) {
	const hexdigits = "0123456789abcdef"
	w.buf = append(w.buf, '"')
	start := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' {
			continue
		}
		w.text(s[start:i])
		if e := shortEscapes[c]; e != 0 {
			w.buf = append(w.buf, '\\', e)
		} else {
			w.buf = append(w.buf, '\\', 'u', '0', '0', hexdigits[c>>4], hexdigits[c&0xF])
		}
		start = i + 1
		w.flushIfFull()
	}
	w.text(s[start:])
	w.buf = append(w.buf, '"')
	w.flushIfFull()
}

// string writes a string or a member name. One that points into the input had no escape, so
// it holds no byte that needs one (no '"', '\\' or control character): it is copied as it is.
func (w *writer) string(t *tree, s span) {
	if s.off < 0 {
		w.str(t.bytes(s))
		return
	}
	w.buf = append(w.buf, '"')
	w.text(t.bytes(s))
	w.buf = append(w.buf, '"')
}

// text appends bytes that need no escape; a run longer than a block goes to out directly.
func (w *writer) text(s []byte) {
	if len(s) < blockSize {
		w.buf = append(w.buf, s...)
		return
	}
	w.flush()
	w.out.Write(s)
	if w.also != nil {
		w.also.Write(s)
	}
}

// value writes node i (a value) and everything in it, through a stack of the open arrays and
// objects rather than by recursion.
func (w *writer) value(t *tree, i int32) {
	nodes := t.nodes
	var open [MaxDepth]int32
	depth := 0
	for {
		// Write node i; an array or object that has children is only opened.
		switch n := &nodes[i]; n.kind {
		case '{', '[':
			w.buf = append(w.buf, n.kind)
			if c := n.first(); c >= 0 {
				open[depth] = i
				depth++
				i = w.child(t, n.kind, c)
				continue
			}
			w.buf = append(w.buf, closer(n.kind))
		case '"':
			w.string(t, n.text)
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
		// Node i is written: go on to its next sibling, closing the containers it ends.
		for {
			if depth == 0 {
				return
			}
			parent := &nodes[open[depth-1]]
			link := i
			if parent.kind == '{' {
				link = i - 1 // the member's name
			}
			if next := nodes[link].next; next >= 0 {
				w.buf = append(w.buf, ',')
				i = w.child(t, parent.kind, next)
				break
			}
			w.buf = append(w.buf, closer(parent.kind))
			w.flushIfFull()
			depth--
			i = open[depth]
		}
	}
}

// child starts a child c of a container of kind: in an object, c is the member's name, which
// child writes; it returns the value to write next.
func (w *writer) child(t *tree, kind byte, c int32) int32 {
	if kind != '{' {
		return c
	}
	w.string(t, t.nodes[c].text)
	w.buf = append(w.buf, ':')
	return c + 1
}

// write writes the canonical text of node i of t to out, through a block from buffers.
func write(out interface{ Write([]byte) (int, error) }, t *tree, i int32) {
	b := buffers.Get().(*[]byte)
	w := writer{out: out, buf: (*b)[:0]}
	w.value(t, i)
	w.flush()
	if cap(w.buf) <= maxPooled {
		*b = w.buf[:0]
	} // else a long string grew the block: the pool keeps the old one, not a body-sized one
	buffers.Put(b)
}

// writeFields is write of the top-level object t.nodes[0] to out, which also puts in fields
// the SHA-256 of each member's canonical value, in hex, by the member's name: one pass over
// the tree, each value's text handed to both hashes (a second pass for the field hashes wrote
// every value's text again).
func writeFields(out interface{ Write([]byte) (int, error) }, t *tree, fields map[string]string) {
	b := buffers.Get().(*[]byte)
	w := writer{out: out, buf: (*b)[:0]}
	fh := sha256.New()
	var sum [sha256.Size]byte
	w.buf = append(w.buf, '{')
	for c := t.nodes[0].first(); c >= 0; c = t.nodes[c].next { // c: a member's name
		if c != t.nodes[0].first() {
			w.buf = append(w.buf, ',')
		}
		w.string(t, t.nodes[c].text)
		w.buf = append(w.buf, ':')
		w.flush()
		fh.Reset()
		w.also = fh
		w.value(t, c+1)
		w.flush()
		w.also = nil
		fields[string(t.bytes(t.nodes[c].text))] = hex.EncodeToString(fh.Sum(sum[:0]))
	}
	w.buf = append(w.buf, '}')
	w.flush()
	if cap(w.buf) <= maxPooled {
		*b = w.buf[:0]
	}
	buffers.Put(b)
}
