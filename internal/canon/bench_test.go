package canon

import (
	"bytes"
	"encoding/json"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"unsafe"

	"github.com/gowebpki/jcs"
)

// The benchmark bodies. Every shape is something a client can send at the body limit; the
// adversarial ones aim at what could make the cost grow faster than the body: the member sort
// (many members, long shared prefixes, names that need decoding or UTF-16 ordering), the
// case-variant check (names equal but for case, in one object or across objects), the number
// formatting, deep nesting, and many tiny values (one node each).

// shape is one kind of body: gen writes about size bytes.
type shape struct {
	name string
	raw  bool // not strictly valid JSON on purpose: parsed to the end, then hashed as bytes
	gen  func(size int) []byte
}

// fill writes open, items separated by commas until the body reaches size, and closing.
func fill(size int, open, closing string, item func(b *bytes.Buffer, i int)) []byte {
	var b bytes.Buffer
	b.Grow(size + 256)
	b.WriteString(open)
	for i := 0; b.Len() < size-len(closing); i++ {
		if i > 0 {
			b.WriteByte(',')
		}
		item(&b, i)
	}
	b.WriteString(closing)
	return b.Bytes()
}

// fields is a top-level object of exactly MaxFields members (one more and no field hash is
// made), each an array of item's values, the whole about size bytes.
func fields(size int, item func(b *bytes.Buffer, k int)) []byte {
	per := size / MaxFields
	var b bytes.Buffer
	b.Grow(size + 256)
	b.WriteByte('{')
	for i := range MaxFields {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `"f%02d":[`, i)
		start := b.Len()
		for k := 0; b.Len()-start < per-16; k++ {
			if k > 0 {
				b.WriteByte(',')
			}
			item(&b, k)
		}
		b.WriteByte(']')
	}
	b.WriteByte('}')
	return b.Bytes()
}

// name36 is i (below 36^width) as width base-36 digits, shuffled: distinct i give distinct
// names, in no particular order.
func name36(i, width int) string {
	const digits = "0123456789abcdefghijklmnopqrstuvwxyz"
	mod := 1
	for range width {
		mod *= 36
	}
	x := i * 1000003 % mod // 1000003 is prime to 36: a bijection of [0, mod)
	out := make([]byte, width)
	for k := width - 1; k >= 0; k-- {
		out[k] = digits[x%36]
		x /= 36
	}
	return string(out)
}

// casePattern upper-cases the letters of s whose position is a set bit of bits.
func casePattern(s string, bits uint64) string {
	out := []byte(s)
	for k := range out {
		if bits>>(k%64)&1 == 1 && 'a' <= out[k] && out[k] <= 'z' {
			out[k] -= 'a' - 'A'
		}
	}
	return string(out)
}

// mix is a cheap deterministic scramble of i.
func mix(i int) uint64 {
	x := uint64(i)*0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019
	x ^= x >> 31
	x *= 0xBF58476D1CE4E5B9
	return x ^ x>>29
}

var shapes = []shape{
	// The original three.
	{"many_keys", false, func(size int) []byte {
		var b bytes.Buffer
		b.WriteByte('{')
		for i := 0; b.Len() < size; i++ {
			if i > 0 {
				b.WriteByte(',')
			}
			fmt.Fprintf(&b, `"key%07d":"value %d"`, (i*7919)%10000000, i)
		}
		b.WriteByte('}')
		return b.Bytes()
	}},
	{"deep", false, func(size int) []byte { return deepBody(size, false) }},
	{"numbers", false, func(size int) []byte {
		var b bytes.Buffer
		b.WriteByte('[')
		for i := 0; b.Len() < size; i++ {
			if i > 0 {
				b.WriteByte(',')
			}
			fmt.Fprintf(&b, "%d.%03de%d", i*31337, i%1000, i%40-20)
		}
		b.WriteByte(']')
		return b.Bytes()
	}},

	// One object of ~110,000 members at 1 MiB: 4-character names, shuffled.
	{"wide", false, func(size int) []byte {
		return fill(size, "{", "}", func(b *bytes.Buffer, i int) { fmt.Fprintf(b, `"%s":0`, name36(i, 4)) })
	}},
	// Names that share a 64-byte prefix: every sort comparison walks it.
	{"wide_prefix", false, func(size int) []byte {
		p := strings.Repeat("x", 64)
		return fill(size, "{", "}", func(b *bytes.Buffer, i int) { fmt.Fprintf(b, `"%s%s":0`, p, name36(i, 4)) })
	}},
	// Names that share a 4000-byte prefix (about 260 of them at 1 MiB, the radix sort's size):
	// the sort goes through the prefix seven bytes at a time.
	{"wide_long_prefix", false, func(size int) []byte {
		p := strings.Repeat("x", 4000)
		return fill(size, "{", "}", func(b *bytes.Buffer, i int) { fmt.Fprintf(b, `"%s%s":0`, p, name36(i, 4)) })
	}},
	// The same with a prefix of 2-byte letters (decoded to compare, case-folded to check).
	{"wide_prefix_utf8", false, func(size int) []byte {
		p := strings.Repeat("Ж", 32)
		return fill(size, "{", "}", func(b *bytes.Buffer, i int) { fmt.Fprintf(b, `"%s%s":0`, p, name36(i, 4)) })
	}},
	// The same with 4-byte letters (surrogate pairs in UTF-16 order, cased: Deseret).
	{"wide_prefix_astral", false, func(size int) []byte {
		p := strings.Repeat("\U00010400", 16)
		return fill(size, "{", "}", func(b *bytes.Buffer, i int) { fmt.Fprintf(b, `"%s%s":0`, p, name36(i, 4)) })
	}},
	// Every name written with \u escapes: decoded into the arena, sorted from there.
	{"wide_escaped", false, func(size int) []byte {
		return fill(size, "{", "}", func(b *bytes.Buffer, i int) {
			b.WriteByte('"')
			for _, c := range []byte(name36(i, 4)) {
				fmt.Fprintf(b, `\u%04x`, c)
			}
			b.WriteString(`":0`)
		})
	}},
	// One object whose names are equal but for case in their first 24 letters, and differ
	// after: near duplicates that are not case variants.
	{"near_dups", false, func(size int) []byte {
		return fill(size, "{", "}", func(b *bytes.Buffer, i int) {
			fmt.Fprintf(b, `"%s_%s":0`, casePattern("abcdefghijklmnopqrstuvwx", mix(i)), name36(i, 4))
		})
	}},
	// Small objects (16 members) of names equal but for case in a 64-letter prefix and for
	// their last letter: a pairwise case-insensitive check walks every prefix.
	{"near_dups_small", false, func(size int) []byte {
		p := strings.Repeat("abcdefgh", 8)
		return fill(size, "[", "]", func(b *bytes.Buffer, i int) {
			b.WriteByte('{')
			for j := range 16 {
				if j > 0 {
					b.WriteByte(',')
				}
				fmt.Fprintf(b, `"%s%c":%d`, casePattern(p, mix(i*16+j)), 'a'+j, j)
			}
			b.WriteByte('}')
		})
	}},
	// Objects of 20 members whose names are case variants of the names of the other
	// objects (allowed: each object on its own is unambiguous).
	{"case_across", false, func(size int) []byte {
		return fill(size, "[", "]", func(b *bytes.Buffer, i int) {
			b.WriteByte('{')
			for j := range 20 {
				if j > 0 {
					b.WriteByte(',')
				}
				fmt.Fprintf(b, `"%s":%d`, casePattern(fmt.Sprintf("fieldname%c", 'a'+j), mix(i)), j)
			}
			b.WriteByte('}')
		})
	}},
	// The same with 8 members per object.
	{"case_across_small", false, func(size int) []byte {
		return fill(size, "[", "]", func(b *bytes.Buffer, i int) {
			b.WriteByte('{')
			for j := range 8 {
				if j > 0 {
					b.WriteByte(',')
				}
				fmt.Fprintf(b, `"%s":%d`, casePattern(fmt.Sprintf("fieldname%c", 'a'+j), mix(i)), j)
			}
			b.WriteByte('}')
		})
	}},
	// Objects of 256 members, the smallest the radix sort takes (and its case check).
	{"objects_256", false, func(size int) []byte {
		return fill(size, "[", "]", func(b *bytes.Buffer, i int) {
			b.WriteByte('{')
			for j := range 256 {
				if j > 0 {
					b.WriteByte(',')
				}
				fmt.Fprintf(b, `"%s":%d`, name36(i*256+j, 4), j)
			}
			b.WriteByte('}')
		})
	}},
	// An array of small objects, as a batch endpoint receives them.
	{"objects", false, func(size int) []byte {
		return fill(size, "[", "]", func(b *bytes.Buffer, i int) {
			fmt.Fprintf(b, `{"id":%d,"name":"item %d","ok":true,"tags":["a","b"]}`, i, i)
		})
	}},
	// An array of empty objects and arrays: the most containers per byte.
	{"empty", false, func(size int) []byte {
		return fill(size, "[", "]", func(b *bytes.Buffer, i int) {
			if i%2 == 0 {
				b.WriteString("{}")
			} else {
				b.WriteString("[]")
			}
		})
	}},
	// An array of one-digit numbers: the most values per byte.
	{"tiny_values", false, func(size int) []byte {
		return fill(size, "[", "]", func(b *bytes.Buffer, i int) { b.WriteByte(byte('0' + i%10)) })
	}},
	// One long string of escapes, \u escapes (surrogate pairs, control characters) and
	// multi-byte UTF-8.
	{"string_escapes", false, func(size int) []byte {
		const unit = `\"\\\/\b\f\n\r\t\u00e9\u20AC\ud83d\ude00\u001f\u2028é€😀 `
		var b bytes.Buffer
		b.WriteByte('"')
		for b.Len() < size-1 {
			b.WriteString(unit)
		}
		b.WriteByte('"')
		return b.Bytes()
	}},
	// One long string of raw multi-byte UTF-8.
	{"string_utf8", false, func(size int) []byte {
		var b bytes.Buffer
		b.WriteByte('"')
		for b.Len() < size-1 {
			b.WriteString("é€😀aЖ")
		}
		b.WriteByte('"')
		return b.Bytes()
	}},
	// Integers, decimals, exponents, the largest exponents, long literals with zeros.
	{"numbers_mixed", false, func(size int) []byte {
		return fill(size, "[", "]", func(b *bytes.Buffer, i int) {
			switch i % 6 {
			case 0:
				fmt.Fprintf(b, "%d", i*7919)
			case 1:
				fmt.Fprintf(b, "-%d.%d", i, i*31)
			case 2:
				fmt.Fprintf(b, "%dE+%d", i, i%300)
			case 3:
				fmt.Fprintf(b, "%de999999999999999", i)
			case 4:
				fmt.Fprintf(b, "-0.000%de-999999999999990", i)
			case 5:
				fmt.Fprintf(b, "%d%s.%s000e-7", i, strings.Repeat("0", 40), strings.Repeat("0", 20))
			}
		})
	}},
	// Numbers that all take the exponent layout with huge exponents.
	{"numbers_huge_exp", false, func(size int) []byte {
		return fill(size, "[", "]", func(b *bytes.Buffer, i int) {
			fmt.Fprintf(b, "%d.%04de-%015d", i%9+1, i%10000, 999999999999999-i)
		})
	}},
	// Numbers of 10,000 digits, with a fraction and an exponent.
	{"numbers_long", false, func(size int) []byte {
		return fill(size, "[", "]", func(b *bytes.Buffer, i int) {
			fmt.Fprintf(b, "%d%s.%s%de-%d", i%9+1, strings.Repeat("0", 5000), strings.Repeat("7", 5000), i, i%400)
		})
	}},
	// The top-level object of MaxFields members, each a long array: every byte is hashed
	// twice (the fingerprint and the member's field hash).
	{"fields", false, func(size int) []byte {
		return fields(size, func(b *bytes.Buffer, k int) { fmt.Fprintf(b, "%d", k) })
	}},
	// The same with numbers whose canonical form is five times as long as they are (1e20 is
	// 100000000000000000000): the most canonical text per byte of body, written twice.
	{"fields_growing_numbers", false, func(size int) []byte {
		return fields(size, func(b *bytes.Buffer, k int) { fmt.Fprintf(b, "%de20", k%9+1) })
	}},
	// Arrays nested MaxDepth deep, one after the other: the most containers per byte, at
	// every depth.
	{"deep_arrays", false, func(size int) []byte {
		one := strings.Repeat("[", MaxDepth-1) + strings.Repeat("]", MaxDepth-1)
		return fill(size, "[", "]", func(b *bytes.Buffer, i int) { b.WriteString(one) })
	}},
	// The deep shape, with a last element nested one level past MaxDepth: parsed to the
	// end, then hashed as bytes.
	{"deep_past", true, func(size int) []byte { return deepBody(size, true) }},
	// The wide shape, with a duplicate member at the end: parsed and sorted, then hashed as bytes.
	{"wide_dup", true, func(size int) []byte {
		b := fill(size, "{", "}", func(b *bytes.Buffer, i int) { fmt.Fprintf(b, `"%s":0`, name36(i, 4)) })
		return append(b[:len(b)-1], fmt.Sprintf(`,"%s":1}`, name36(0, 4))...)
	}},
}

// deepBody is an array of values nested MaxDepth-1 deep; past adds one of MaxDepth+1.
func deepBody(size int, past bool) []byte {
	one := strings.Repeat(`{"a":[`, (MaxDepth-1)/2) + `1` + strings.Repeat(`]}`, (MaxDepth-1)/2)
	var b bytes.Buffer
	b.WriteByte('[')
	for i := 0; b.Len() < size; i++ {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(one)
	}
	if past {
		b.WriteString(`,` + strings.Repeat(`[`, MaxDepth) + strings.Repeat(`]`, MaxDepth))
	}
	b.WriteByte(']')
	return b.Bytes()
}

var benchSizes = []int{1 << 10, 64 << 10, 1 << 20}

// Benchmarks: ns/byte (shown as MB/s) should stay flat from 1 KiB to 1 MiB for every shape.
// cpu-ns/op is the CPU time of the process per call (the garbage collector's included), which
// a busy machine disturbs less than the wall-clock ns/op.
func BenchmarkCompute(b *testing.B) {
	for _, size := range benchSizes {
		for _, s := range shapes {
			b.Run(fmt.Sprintf("%s/%dKiB", s.name, size>>10), func(b *testing.B) {
				body := s.gen(size)
				_, err := Canonicalize(body)
				if (err != nil) != s.raw {
					b.Fatalf("%s: %v", s.name, err)
				}
				if fp := Compute("POST", "/bench", body); fp.Ambiguous != "" {
					b.Fatalf("%s: %s", s.name, fp.Ambiguous)
				}
				b.SetBytes(int64(len(body)))
				cpu := cpuTime()
				for b.Loop() {
					Compute("POST", "/bench", body)
				}
				if cpu >= 0 {
					b.ReportMetric(float64(cpuTime()-cpu)/float64(b.N), "cpu-ns/op")
				}
			})
		}
	}
}

// BenchmarkJCS is the alternative side by side: github.com/gowebpki/jcs on the original three
// shapes (up to 64 KiB; its cost grows faster than the body).
func BenchmarkJCS(b *testing.B) {
	for _, size := range []int{1 << 10, 16 << 10, 64 << 10} {
		for _, s := range shapes[:3] {
			b.Run(fmt.Sprintf("%s/%dKiB", s.name, size>>10), func(b *testing.B) {
				body := s.gen(size)
				b.SetBytes(int64(len(body)))
				for b.Loop() {
					if _, err := jcs.Transform(body); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkComputeTransfer is the common case: a small object of three members, as the
// reference server's POST /v1/transfers receives it.
func BenchmarkComputeTransfer(b *testing.B) {
	body := []byte(`{"from":12,"to":34,"amount":1}`)
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		Compute("POST", "/v1/transfers", body)
	}
}

// BenchmarkComputeCanonicalTransfer is BenchmarkComputeTransfer that keeps the canonical body.
func BenchmarkComputeCanonicalTransfer(b *testing.B) {
	body := []byte(`{"from":12,"to":34,"amount":1}`)
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		ComputeCanonical("POST", "/v1/transfers", body)
	}
}

// TestAllocationsFlat: no shape allocates per member or per value (the case check once
// allocated a folded copy of every name): the allocations of a 512 KiB body are at most about
// those of a 64 KiB one (a few more as the arena and the scratch grow). Allocations, unlike
// time, are deterministic.
func TestAllocationsFlat(t *testing.T) {
	if testing.Short() {
		t.Skip("builds bodies of 512 KiB")
	}
	poolParsers = false // every call makes its own parser: its allocations are counted
	defer func() { poolParsers = true }()
	for _, s := range shapes {
		small, large := s.gen(64<<10), s.gen(512<<10)
		a := testing.AllocsPerRun(1, func() { Compute("POST", "/a", small) })
		b := testing.AllocsPerRun(1, func() { Compute("POST", "/a", large) })
		if b > 2*a+16 {
			t.Errorf("%s: %.0f allocations at 64 KiB, %.0f at 512 KiB", s.name, a, b)
		}
	}
}

// TestArenaGrowsByDoubling: a body whose values are mostly rewritten (long numbers not in
// canonical form, numbers_long) fills an arena about as large as itself. Growing it by append
// (a quarter at a time for a large slice) allocated and copied about five times its final
// size, and that made the shape slower than encoding/json decoding the same body; doubling
// allocates at most about twice. Allocated bytes, unlike time, are deterministic.
func TestArenaGrowsByDoubling(t *testing.T) {
	var body []byte
	for _, s := range shapes {
		if s.name == "numbers_long" {
			body = s.gen(1 << 20)
		}
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	tr := new(parser) // a fresh one: a parser from the pool may have room already
	err := tr.parse(body, false)
	runtime.ReadMemStats(&after)
	if err != nil {
		t.Fatal(err)
	}
	arena := len(tr.arena)
	nodes := cap(tr.nodes) * int(unsafe.Sizeof(node{}))
	if arena < len(body)/2 {
		t.Fatalf("the arena holds %d bytes of a %d-byte body: the shape no longer rewrites most of it", arena, len(body))
	}
	if got := int(after.TotalAlloc - before.TotalAlloc); got > nodes+5*arena/2 {
		t.Fatalf("parsing allocated %d bytes for an arena of %d and nodes of %d: the arena grew by less than doubling", got, arena, nodes)
	}
}

// BenchmarkStdlibDecode is the yardstick of the fingerprint's budget: encoding/json decoding
// the same bodies into any (reading the bytes once, building a generic value), per shape. The
// bench tool reports Compute's time over this one's, per shape, so the budget is a ratio that
// holds on any machine. The raw shapes are not valid JSON: Unmarshal rejects them after its
// validity scan, so their ratio only tells that Compute reads the whole body, as it must.
func BenchmarkStdlibDecode(b *testing.B) {
	for _, size := range benchSizes {
		for _, s := range shapes {
			b.Run(fmt.Sprintf("%s/%dKiB", s.name, size>>10), func(b *testing.B) {
				body := s.gen(size)
				b.SetBytes(int64(len(body)))
				// Numbers past float64's range (numbers_mixed, numbers_long) make Unmarshal
				// return an error after decoding the whole body; only invalid JSON would
				// stop it early.
				if !s.raw && !json.Valid(body) {
					b.Fatalf("%s: not valid JSON to encoding/json", s.name)
				}
				for b.Loop() {
					var v any
					_ = json.Unmarshal(body, &v)
				}
			})
		}
	}
}
