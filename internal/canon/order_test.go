package canon

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"unicode/utf16"

	"github.com/gowebpki/jcs"
)

// utf16Compare is the reference order of RFC 8785: the names' UTF-16 code units.
func utf16Compare(a, b string) int {
	return slices.Compare(utf16.Encode([]rune(a)), utf16.Encode([]rune(b)))
}

func sign(x int) int { return min(max(x, -1), 1) }

// nameRunes are the characters around every boundary of the UTF-16 order: ASCII, 2-byte,
// 3-byte below and above the surrogates, U+E000..U+FFFF, supplementary.
var nameRunes = []rune{0, 'A', 'a', 'k', 'z', 0x7F, 0x80, 0xE9, 0x7FF, 0x800, 0x17F, 0x212A, 0xD7FF, 0xE000, 0xFB01, 0xFFFD, 0xFFFF, 0x10000, 0x10400, 0x1F600, 0x10FFFF}

// randomNames returns n distinct names that share prefixes (of up to 20 characters) with each other.
func randomNames(r *rand.Rand, n int) []string {
	seen := map[string]bool{}
	var out []string
	for len(out) < n {
		var b strings.Builder
		if len(out) > 0 && r.IntN(2) == 0 {
			prev := []rune(out[r.IntN(len(out))])
			b.WriteString(string(prev[:r.IntN(len(prev)+1)]))
		}
		for range r.IntN(12) {
			b.WriteRune(nameRunes[r.IntN(len(nameRunes))])
		}
		if s := b.String(); !seen[s] {
			seen[s] = true
			out = append(out, s)
		}
	}
	return out
}

func TestCompareNames(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	names := randomNames(r, 3000)
	for i := range 200000 {
		a, b := names[r.IntN(len(names))], names[r.IntN(len(names))]
		if i%5 == 0 {
			ra := []rune(a)
			b = string(ra[:r.IntN(len(ra)+1)]) // a prefix, or a itself
		}
		if got, want := sign(compareNames([]byte(a), []byte(b))), utf16Compare(a, b); got != want {
			t.Fatalf("compareNames(%q, %q) = %d, want %d", a, b, got, want)
		}
	}
}

// objectNames returns the member names of every object of a valid JSON text, in order.
func objectNames(t testing.TB, data []byte) [][]string {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber() // 1e400 is valid JSON, not a float64
	var out [][]string
	var walk func()
	walk = func() {
		tok, err := dec.Token()
		if err != nil {
			t.Fatalf("%s: %v", data, err)
		}
		switch tok {
		case json.Delim('['):
			for dec.More() {
				walk()
			}
			dec.Token()
		case json.Delim('{'):
			o := len(out)
			out = append(out, nil)
			for dec.More() {
				name, _ := dec.Token()
				out[o] = append(out[o], name.(string))
				walk()
			}
			dec.Token()
		}
	}
	walk()
	return out
}

// TestMemberOrder: objects of every size the sort treats differently (insertion, SortFunc,
// radix with runs of shared prefixes), in random and reversed order, come out in UTF-16
// order, byte for byte as jcs writes them.
func TestMemberOrder(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int{2, 3, 16, 17, 100, 255, 256, 257, 3000} {
		names := randomNames(r, n)
		for _, order := range []string{"random", "reversed", "sorted"} {
			switch order {
			case "random":
				r.Shuffle(len(names), func(i, j int) { names[i], names[j] = names[j], names[i] })
			case "reversed":
				slices.SortFunc(names, utf16Compare)
				slices.Reverse(names)
			case "sorted":
				slices.SortFunc(names, utf16Compare)
			}
			var in bytes.Buffer
			in.WriteByte('{')
			for i, name := range names {
				if i > 0 {
					in.WriteByte(',')
				}
				q, _ := json.Marshal(name)
				fmt.Fprintf(&in, "%s:%d", q, i)
			}
			in.WriteByte('}')
			got, err := Canonicalize(in.Bytes())
			if err != nil {
				t.Fatalf("%d names, %s: %v", n, order, err)
			}
			want, err := jcs.Transform(in.Bytes())
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("%d names, %s:\n got %s\njcs  %s", n, order, got, want)
			}
		}
	}
}

// TestLongSharedPrefixes: names that share prefixes longer than a radix chunk, in runs large
// enough for the radix sort at several depths.
func TestLongSharedPrefixes(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	var names []string
	for _, p := range []string{"", strings.Repeat("x", 7), strings.Repeat("x", 30), strings.Repeat("\U0001F600", 9), strings.Repeat("\uFFFF", 10)} {
		for i := range 600 {
			names = append(names, fmt.Sprintf("%s%s%d", p, string(nameRunes[i%len(nameRunes)]), i))
		}
	}
	r.Shuffle(len(names), func(i, j int) { names[i], names[j] = names[j], names[i] })
	var in bytes.Buffer
	in.WriteByte('{')
	for i, name := range names {
		if i > 0 {
			in.WriteByte(',')
		}
		q, _ := json.Marshal(name)
		fmt.Fprintf(&in, "%s:0", q)
	}
	in.WriteByte('}')
	got, err := Canonicalize(in.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	order := objectNames(t, got)[0]
	want := slices.Clone(names)
	slices.SortFunc(want, utf16Compare)
	if !slices.Equal(order, want) {
		t.Fatalf("order differs from UTF-16 order")
	}
	dup := append(in.Bytes()[:in.Len()-1], fmt.Sprintf(`,%q:1}`, names[1234])...)
	if _, err := Canonicalize(dup); err == nil || !strings.Contains(err.Error(), "duplicate") {
		t.Fatalf("a duplicate among %d members: %v", len(names)+1, err)
	}
}

// TestDuplicates: a duplicate name is found in objects of every size the sort treats
// differently, in sorted and unsorted bodies, whatever prefix the names share.
func TestDuplicates(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	for _, n := range []int{2, 16, 17, 255, 256, 3000} {
		for _, prefix := range []string{"", "abcdef", strings.Repeat("y", 7), strings.Repeat("\u00e9", 20)} {
			for _, c := range []struct{ sorted, short bool }{{false, false}, {false, true}, {true, false}, {true, true}} {
				sorted := c.sorted
				names := randomNames(r, n-1)
				for i := range names {
					names[i] = prefix + names[i]
				}
				// the shortest name (within a radix chunk) or the longest
				pick := slices.MinFunc(names, func(a, b string) int { return len(a) - len(b) })
				if !c.short {
					pick = slices.MaxFunc(names, func(a, b string) int { return len(a) - len(b) })
				}
				names = append(names, pick)
				if sorted {
					slices.SortFunc(names, utf16Compare)
				} else {
					r.Shuffle(len(names), func(i, j int) { names[i], names[j] = names[j], names[i] })
				}
				var in bytes.Buffer
				in.WriteByte('{')
				for i, name := range names {
					if i > 0 {
						in.WriteByte(',')
					}
					q, _ := json.Marshal(name)
					fmt.Fprintf(&in, "%s:%d", q, i)
				}
				in.WriteByte('}')
				if _, err := Canonicalize(in.Bytes()); err == nil || !strings.Contains(err.Error(), "duplicate") {
					t.Fatalf("%d members, prefix %q, %+v: %v", n, prefix, c, err)
				}
			}
		}
	}
}

// TestChunkKeyRanks: chunkKey's eight-at-a-time ranking equals ranking each byte through
// utf16Rank, for every byte value that valid UTF-8 holds (not 0xF5-0xFF) in every position.
func TestChunkKeyRanks(t *testing.T) {
	slow := func(s []byte) uint64 {
		var k uint64
		for i := 0; i < 7 && i < len(s); i++ {
			k |= uint64(utf16Rank[s[i]]) << (56 - 8*i)
		}
		return k | uint64(min(len(s), 8))
	}
	for pos := range 8 {
		for v := range 0xF5 {
			for _, fill := range []byte{'a', 0x80, 0xEE, 0xEF, 0xF0, 0xF4} {
				for n := pos + 1; n <= 9; n++ {
					s := bytes.Repeat([]byte{fill}, n)
					s[pos] = byte(v)
					if got, want := chunkKey(s), slow(s); got != want {
						t.Fatalf("chunkKey(% x) = %016x, want %016x", s, got, want)
					}
				}
			}
		}
	}
}
