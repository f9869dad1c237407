package canon

import (
	"bytes"
	"encoding/binary"
	"hash/maphash"
	"sync/atomic"
	"unicode"
	"unicode/utf8"
)

// The case check: do two member names of one object differ only in case, that is, are they
// equal under bytes.EqualFold (the simple case folding encoding/json matches names with)?
// Each name is folded once and hashed with a per-process random seed (so a client cannot
// make names collide); the hashes are compared pair by pair in a small object and sorted
// (radix) in a larger one, and only the names of equal hashes are compared with
// bytes.EqualFold: linear in the names' bytes, whatever the names.

// foldSeed seeds the hash of folded names.
var foldSeed = maphash.MakeSeed()

// caseDuplicateFew tells whether two of a few members have names equal under bytes.EqualFold,
// comparing their hashes pair by pair.
func (p *parser) caseDuplicateFew(members []int32) bool {
	var hs [sortInsertionMax]uint64
	for i, m := range members {
		hs[i] = p.foldHash(p.name(m))
		for j := range i {
			if hs[j] == hs[i] && bytes.EqualFold(p.name(members[j]), p.name(m)) {
				return true
			}
		}
	}
	return false
}

// caseDuplicateMany tells whether two of the members (the nodes of ks) have names equal under
// bytes.EqualFold. It sorts the members by the top 32 bits of their hashes (using tmp as
// scratch, and overwriting the keys), and compares the names of equal neighbours.
func (p *parser) caseDuplicateMany(ks, tmp []keyed) bool {
	for i := range ks {
		ks[i].key = p.foldHash(p.name(ks[i].node)) &^ 0xFFFFFFFF
	}
	sortByKey(ks, tmp)
	for i := 0; i < len(ks); {
		j := i + 1
		for j < len(ks) && ks[j].key == ks[i].key {
			j++
		}
		for a := i; a < j; a++ { // a few members at most: the hash is seeded at random
			for b := a + 1; b < j; b++ {
				if bytes.EqualFold(p.name(ks[a].node), p.name(ks[b].node)) {
					return true
				}
			}
		}
		i = j
	}
	return false
}

// foldHash hashes the folded form of a name: two names have the same folded form exactly
// when bytes.EqualFold says they are equal.
func (p *parser) foldHash(s []byte) uint64 {
	if cap(p.fold) < len(s) {
		p.fold = make([]byte, len(s)+len(s)/4)
	}
	p.fold = fold(p.fold[:len(s)], s)
	return maphash.Bytes(foldSeed, p.fold)
}

// fold writes the folded form of s into buf (as long as s: a folded character is never
// longer than the character) and returns it: ASCII letters upper-cased eight at a time, other
// characters through foldRune. s is valid UTF-8 (a name the parser checked): the paths for
// two- and four-byte characters decode without checking again.
func fold(buf, s []byte) []byte {
	i, j := 0, 0
	for i < len(s) {
		if i+8 <= len(s) {
			if w := binary.LittleEndian.Uint64(s[i:]); w&0x8080808080808080 == 0 {
				// A byte's bit 7 is set in w+0x1F.. from 'a' up, and in w+0x05.. above 'z'.
				lower := (w + 0x1F1F1F1F1F1F1F1F) &^ (w + 0x0505050505050505) & 0x8080808080808080
				binary.LittleEndian.PutUint64(buf[j:], w-lower>>2)
				i += 8
				j += 8
				continue
			}
		}
		if c := s[i]; c < utf8.RuneSelf {
			if 'a' <= c && c <= 'z' {
				c -= 'a' - 'A'
			}
			buf[j] = c
			i++
			j++
			continue
		}
		if c := s[i]; c < 0xE0 && i+1 < len(s) {
			// Two bytes (Latin, Greek, Cyrillic, ...), decoded and encoded in place: the
			// folded rune is never greater, so it takes one or two bytes.
			f := foldRune(rune(c&0x1F)<<6 | rune(s[i+1]&0x3F))
			if f < utf8.RuneSelf {
				buf[j] = byte(f)
				j++
			} else {
				buf[j], buf[j+1] = 0xC0|byte(f>>6), 0x80|byte(f&0x3F)
				j += 2
			}
			i += 2
			continue
		}
		if c := s[i]; c >= 0xF0 && i+3 < len(s) {
			// Four bytes (a supplementary character): the cased ones (Deseret, Osage, ...)
			// fold within their block, so the folded rune takes four bytes too.
			r := rune(c&0x07)<<18 | rune(s[i+1]&0x3F)<<12 | rune(s[i+2]&0x3F)<<6 | rune(s[i+3]&0x3F)
			if f := foldRune(r); f >= 0x10000 {
				buf[j], buf[j+1], buf[j+2], buf[j+3] = 0xF0|byte(f>>18), 0x80|byte(f>>12&0x3F), 0x80|byte(f>>6&0x3F), 0x80|byte(f&0x3F)
				j += 4
			} else {
				j += utf8.EncodeRune(buf[j:], f)
			}
			i += 4
			continue
		}
		r, n := utf8.DecodeRune(s[i:])
		i += n
		j += utf8.EncodeRune(buf[j:], foldRune(r))
	}
	return buf[:j]
}

// foldRune returns the smallest rune of r's orbit under unicode.SimpleFold (as encoding/json
// does): foldRune(x) == foldRune(y) exactly when bytes.EqualFold says x and y are equal. It
// is never greater than r. Results come from pages of 256 runes built on first use (a page
// costs 256 orbit walks, about 10 µs, once per process), since the orbit walk costs tens of
// nanoseconds per rune.
func foldRune(r rune) rune {
	if r < utf8.RuneSelf {
		if 'a' <= r && r <= 'z' {
			r -= 'a' - 'A'
		}
		return r
	}
	if r >= foldTop {
		return r
	}
	pg := foldPages[r>>8].Load()
	if pg == nil {
		pg = new([256]rune)
		for k := range pg {
			pg[k] = orbitMin(r&^0xFF | rune(k))
		}
		foldPages[r>>8].Store(pg) // a concurrent builder stores the same page
	}
	return pg[r&0xFF]
}

// foldTop bounds the runes that case folding changes: none at or above it has another rune in
// its orbit (TestFoldTop checks every rune up to unicode.MaxRune).
const foldTop = 0x20000

var foldPages [foldTop >> 8]atomic.Pointer[[256]rune]

// orbitMin walks r's orbit under unicode.SimpleFold and returns its smallest rune.
func orbitMin(r rune) rune {
	m := r
	for f := unicode.SimpleFold(r); f != r; f = unicode.SimpleFold(f) {
		m = min(m, f)
	}
	return m
}
