package canon

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"fmt"
	"math/bits"
	"slices"
)

// The order of member names: RFC 8785's UTF-16 order, at a cost linear in the names' bytes
// (plus a log factor in the number of members for objects of up to sortRadixMin members),
// whatever names a client picks.

// utf16Rank maps every byte of UTF-8 to a rank such that comparing two valid UTF-8 strings
// rank by rank, from their first differing byte, orders them by their UTF-16 code units
// (RFC 8785 section 3.2.3). Bytes order UTF-8 by code point, and UTF-16 differs from code
// point order in one place only: supplementary characters (surrogate pairs, 0xD800-0xDBFF
// first) sort before U+E000..U+FFFF. The first differing byte of two valid UTF-8 strings is
// either in both a lead byte or in both a continuation byte (their common prefix ends on the
// same character boundary), so it is enough to move the lead bytes of supplementary
// characters (0xF0-0xF4) before those of U+E000..U+FFFF (0xEE, 0xEF).
var utf16Rank = func() (r [256]byte) {
	for i := range r {
		r[i] = byte(i)
	}
	r[0xEE], r[0xEF] = 0xF3, 0xF4
	for b := 0xF0; b <= 0xF4; b++ {
		r[b] = byte(b - 2)
	}
	return r
}()

// compareNames orders two valid UTF-8 strings by their UTF-16 code units, eight bytes at a
// time over their common prefix.
func compareNames(a, b []byte) int {
	n := min(len(a), len(b))
	i := 0
	for ; i+8 <= n; i += 8 {
		if x, y := binary.LittleEndian.Uint64(a[i:]), binary.LittleEndian.Uint64(b[i:]); x != y {
			i += bits.TrailingZeros64(x^y) / 8
			return int(utf16Rank[a[i]]) - int(utf16Rank[b[i]])
		}
	}
	for ; i < n; i++ {
		if a[i] != b[i] {
			return int(utf16Rank[a[i]]) - int(utf16Rank[b[i]])
		}
	}
	return len(a) - len(b) // the one with something left is greater
}

// chunkKey is a number that orders like s's first seven bytes (in utf16Rank) followed by
// min(len(s), 8): two names' keys are equal when they have the same first seven bytes and
// either both go on past them or both are equal (a duplicate).
func chunkKey(s []byte) uint64 {
	var k uint64
	if len(s) >= 8 {
		k = binary.BigEndian.Uint64(s)&^0xFF | 8
	} else {
		for i, c := range s {
			k |= uint64(c) << (56 - 8*i)
		}
		k |= uint64(len(s))
	}
	// The seven name bytes are ranked eight at a time, as utf16Rank says. Only the bytes from
	// 0xEE up change rank (names are valid UTF-8, so none is above 0xF4): x >= 0xEE exactly
	// when bit 7 is set and (x & 0x7F) + 0x12 reaches 0x80, and x >= 0xF0 likewise with 0x10.
	// 0xF0-0xF4 (the lead bytes of supplementary characters) move down by 2, 0xEE and 0xEF up
	// by 5; no byte leaves its place, so nothing carries into its neighbour.
	const low7, high = 0x7F7F7F7F7F7F7F00, 0x8080808080808000
	if ee := (k&low7 + 0x1212121212121200) & k & high; ee != 0 {
		f0 := (k&low7 + 0x1010101010101000) & k & high
		k = k - (f0>>7)*2 + ((ee&^f0)>>7)*5
	}
	return k
}

// keyed is a member (its node) with the chunkKey of its name at some offset.
type keyed struct {
	key  uint64
	node int32
}

// Objects of up to sortInsertionMax members are sorted by insertion, up to sortRadixMin by
// slices.SortFunc on the first chunk of their names, larger ones by a radix sort on chunks.
const (
	sortInsertionMax = 16
	sortRadixMin     = 256
)

// name is the text of a member name node.
func (p *parser) name(node int32) []byte { return p.bytes(p.nodes[node].text) }

// orderMembers relinks the n members of object obj (linked in the body's order) in canonical
// order. A duplicate name is an error (equal names meet in the sort); two names equal but for
// case set p.caseDup.
func (p *parser) orderMembers(obj int32, n int) error {
	if n <= sortInsertionMax {
		var buf [sortInsertionMax]int32
		ms := buf[:0]
		for c := p.nodes[obj].first(); c >= 0; c = p.nodes[c].next {
			ms = append(ms, c)
		}
		for i := 1; i < len(ms); i++ {
			for j := i; j > 0 && compareNames(p.name(ms[j-1]), p.name(ms[j])) > 0; j-- {
				ms[j-1], ms[j] = ms[j], ms[j-1]
			}
		}
		for i, m := range ms {
			if i > 0 && bytes.Equal(p.name(ms[i-1]), p.name(m)) {
				return p.duplicate(m)
			}
		}
		p.relink(obj, len(ms), func(i int) int32 { return ms[i] })
		if !p.caseDup {
			p.caseDup = p.caseDuplicateFew(ms)
		}
		return nil
	}
	ks, tmp := p.keyedScratch(n)
	sorted := true // as a canonical body's are: no sort
	var prev []byte
	i := 0
	for c := p.nodes[obj].first(); c >= 0; c = p.nodes[c].next {
		name := p.name(c)
		ks[i] = keyed{chunkKey(name), c}
		if i > 0 && sorted {
			switch d := compareNames(prev, name); {
			case d == 0:
				return p.duplicate(c)
			case d > 0:
				sorted = false
			}
		}
		prev = name
		i++
	}
	if !sorted {
		if dup := p.sortKeyed(ks, tmp, 0); dup >= 0 {
			return p.duplicate(dup)
		}
	}
	p.relink(obj, len(ks), func(i int) int32 { return ks[i].node })
	if !p.caseDup {
		p.caseDup = p.caseDuplicateMany(ks, tmp)
	}
	return nil
}

func (p *parser) duplicate(node int32) error {
	return fmt.Errorf("%w: duplicate member name %q", ErrNotCanonical, p.name(node))
}

// relink makes member(0), ..., member(n-1) the children of obj, in this order.
func (p *parser) relink(obj int32, n int, member func(int) int32) {
	prev := member(0)
	p.nodes[obj].setFirst(prev)
	for i := 1; i < n; i++ {
		m := member(i)
		p.nodes[prev].next = m
		prev = m
	}
	p.nodes[prev].next = -1
}

// keyedScratch returns two slices of n keyed for one object, reused by the next objects.
func (p *parser) keyedScratch(n int) (ks, tmp []keyed) {
	if cap(p.keys) < n {
		p.keys, p.keysTmp = make([]keyed, n), make([]keyed, n)
	}
	return p.keys[:n], p.keysTmp[:n]
}

// sortKeyed orders ks, whose keys are the chunkKey of their names from byte off (the names
// are equal before), using tmp (as long as ks) as scratch. It returns a member whose name
// another member has too, or -1 (then the order is complete).
func (p *parser) sortKeyed(ks, tmp []keyed, off int) (dup int32) {
	for {
		if len(ks) < sortRadixMin {
			tail := func(k keyed) []byte { return p.name(k.node)[off+7:] }
			slices.SortFunc(ks, func(a, b keyed) int {
				if a.key != b.key {
					return cmp.Compare(a.key, b.key)
				}
				if a.key&0xFF < 8 {
					return 0
				}
				return compareNames(tail(a), tail(b))
			})
			for i := 1; i < len(ks); i++ {
				if ks[i].key == ks[i-1].key && (ks[i].key&0xFF < 8 || bytes.Equal(tail(ks[i-1]), tail(ks[i]))) {
					return ks[i].node
				}
			}
			return -1
		}
		radixSort(ks, tmp[:len(ks)])
		// Runs of equal keys whose names go on are ordered by their next chunk: the largest
		// run by this loop, the others by recursion (so the recursion is at most log2 deep).
		// A run of names that end within the chunk is a run of duplicates.
		var largest []keyed
		for i := 0; i < len(ks); {
			j := i + 1
			for j < len(ks) && ks[j].key == ks[i].key {
				j++
			}
			if run := ks[i:j]; len(run) > 1 {
				if run[0].key&0xFF < 8 {
					return run[1].node
				}
				if len(run) > len(largest) {
					run, largest = largest, run
				}
				if len(run) > 0 {
					p.rekey(run, off+7)
					if dup := p.sortKeyed(run, tmp, off+7); dup >= 0 {
						return dup
					}
				}
			}
			i = j
		}
		if largest == nil {
			return -1
		}
		ks, off = largest, off+7
		p.rekey(ks, off)
	}
}

func (p *parser) rekey(ks []keyed, off int) {
	for i := range ks {
		ks[i].key = chunkKey(p.name(ks[i].node)[off:])
	}
}

// sortByKey sorts ks by key alone, using tmp (as long as ks) as scratch.
func sortByKey(ks, tmp []keyed) {
	if len(ks) < sortRadixMin {
		slices.SortFunc(ks, func(a, b keyed) int { return cmp.Compare(a.key, b.key) })
		return
	}
	radixSort(ks, tmp)
}

// radixSort sorts a by key, a byte at a time from the least significant (skipping the bytes
// that are the same in every key), through tmp (as long as a).
func radixSort(a, tmp []keyed) {
	var count [8][256]int32
	for i := range a {
		k := a[i].key
		count[0][byte(k)]++
		count[1][byte(k>>8)]++
		count[2][byte(k>>16)]++
		count[3][byte(k>>24)]++
		count[4][byte(k>>32)]++
		count[5][byte(k>>40)]++
		count[6][byte(k>>48)]++
		count[7][byte(k>>56)]++
	}
	src, dst := a, tmp
	for d := range 8 {
		shift := uint(8 * d)
		c := &count[d]
		if c[byte(src[0].key>>shift)] == int32(len(src)) {
			continue
		}
		var sum int32
		for b, n := range c {
			c[b] = sum
			sum += n
		}
		for _, e := range src {
			b := byte(e.key >> shift)
			dst[c[b]] = e
			c[b]++
		}
		src, dst = dst, src
	}
	if &src[0] != &a[0] {
		copy(a, src)
	}
}
