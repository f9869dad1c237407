package canon

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"testing"
	"unicode"
	"unicode/utf8"
)

// TestFoldTop: no rune at or above foldTop has another rune in its case-folding orbit, so
// foldRune may return those unchanged.
func TestFoldTop(t *testing.T) {
	for r := rune(foldTop); r <= unicode.MaxRune; r++ {
		if f := unicode.SimpleFold(r); f != r {
			t.Fatalf("SimpleFold(%U) = %U: raise foldTop", r, f)
		}
	}
}

// TestFoldRune: foldRune is the orbit's smallest rune, never greater than the rune, and
// equal for two runes exactly when bytes.EqualFold says they are equal.
func TestFoldRune(t *testing.T) {
	for r := rune(0); r < foldTop; r++ {
		f := foldRune(r)
		if f != orbitMin(r) || f > r {
			t.Fatalf("foldRune(%U) = %U, orbit minimum %U", r, f, orbitMin(r))
		}
		if r >= 0xD800 && r <= 0xDFFF {
			continue
		}
		if !bytes.EqualFold([]byte(string(r)), []byte(string(f))) {
			t.Fatalf("foldRune(%U) = %U, which bytes.EqualFold does not match", r, f)
		}
	}
}

// caseVariants are pairs that bytes.EqualFold matches (or not), several across scripts and
// byte lengths, and the pairs an upper-then-lower folding gets wrong.
var caseVariants = []struct {
	a, b  string
	equal bool
}{
	{"amount", "Amount", true}, {"k", "\u212A", true}, {"s", "\u017F", true}, {"SS", "\u017Fs", true},
	{"\u00DF", "\u1E9E", true}, {"\u03A3", "\u03C2", true}, {"\U00010400", "\U00010428", true},
	{"Ж", "ж", true}, {"i", "\u0130", false}, {"I", "\u0131", false},
	{"a", "b", false}, {"ab", "a", false}, {"é", "É", true}, {"e\u0301", "é", false},
}

// TestCaseCheck: Ambiguous says AmbiguousCase exactly when two member names of one object are
// equal under bytes.EqualFold, in objects of every size (pairwise check, hash set).
func TestCaseCheck(t *testing.T) {
	for _, c := range caseVariants {
		if bytes.EqualFold([]byte(c.a), []byte(c.b)) != c.equal {
			t.Fatalf("bytes.EqualFold(%q, %q) is not %v", c.a, c.b, c.equal)
		}
		for _, n := range []int{2, 16, 17, 1000} {
			var in bytes.Buffer
			fmt.Fprintf(&in, `{"x":[{%q:1,%q:2`, c.a, c.b)
			for i := 2; i < n; i++ {
				fmt.Fprintf(&in, `,"m%d":%d`, i, i)
			}
			in.WriteString(`}]}`)
			fp := Compute("POST", "/c", in.Bytes())
			if !fp.JSON {
				t.Fatalf("%q %q in %d members: not JSON", c.a, c.b, n)
			}
			if got := fp.Ambiguous == AmbiguousCase; got != c.equal {
				t.Errorf("%q and %q in an object of %d members: ambiguous %v, want %v", c.a, c.b, n, got, c.equal)
			}
		}
	}
}

// TestFold: fold agrees with folding rune by rune (ASCII runs take the eight-byte path).
func TestFold(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 10))
	alphabet := []rune("@AZ[`az{~\x00\x7f\u00e9\u017f\u212a\u0130\U00010428")
	for range 20000 {
		var in []rune
		for range r.IntN(40) {
			if r.IntN(4) == 0 {
				in = append(in, alphabet[r.IntN(len(alphabet))])
			} else {
				in = append(in, rune(r.IntN(128)))
			}
		}
		var want []byte
		for _, c := range in {
			want = utf8.AppendRune(want, foldRune(c))
		}
		s := []byte(string(in))
		if got := fold(make([]byte, len(s)), s); !bytes.Equal(got, want) {
			t.Fatalf("fold(%q) = %q, want %q", s, got, want)
		}
	}
}

// TestValidRune: validRune agrees with utf8.DecodeRune on every one- to four-byte prefix of
// interest (every lead byte with every second byte, and the third and fourth bytes at their
// edges), so the parser's fast path rejects exactly what the standard library rejects.
func TestValidRune(t *testing.T) {
	edges := []byte{0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xFF}
	for lead := 0x80; lead <= 0xFF; lead++ {
		for second := 0; second <= 0xFF; second++ {
			for _, third := range edges {
				for _, fourth := range edges {
					for n := 1; n <= 4; n++ {
						b := []byte{byte(lead), byte(second), third, fourth}[:n]
						r, size := utf8.DecodeRune(b)
						want := size
						if r == utf8.RuneError && size <= 1 {
							want = 0
						}
						if got := validRune(b); got != want {
							t.Fatalf("validRune(% x) = %d, utf8.DecodeRune says %d", b, got, want)
						}
					}
				}
			}
		}
	}
}

// TestFoldFastPaths: fold's in-place paths for two- and four-byte characters give what
// decoding and encoding every rune through foldRune gives, for every rune.
func TestFoldFastPaths(t *testing.T) {
	slow := func(s []byte) []byte {
		var out []byte
		for len(s) > 0 {
			r, n := utf8.DecodeRune(s)
			out = utf8.AppendRune(out, foldRune(r))
			s = s[n:]
		}
		return out
	}
	check := func(s []byte) {
		t.Helper()
		got := fold(make([]byte, len(s)+8), s)
		if want := slow(s); !bytes.Equal(got, want) {
			t.Fatalf("fold(% x) = % x, want % x", s, got, want)
		}
	}
	for r := rune(0); r <= unicode.MaxRune; r++ {
		if r >= 0xD800 && r <= 0xDFFF {
			continue
		}
		check([]byte("x" + string(r) + "y"))
	}
}

// TestPlain8: plain8 says true exactly when no byte of the word needs the string parser's
// attention, for every byte value in every position among plain neighbours.
func TestPlain8(t *testing.T) {
	plain := func(c byte) bool { return c >= 0x20 && c < 0x80 && c != '"' && c != '\\' }
	for pos := range 8 {
		for v := range 256 {
			for _, fill := range []byte{'a', ' ', '~', '!', '#', '[', ']'} {
				b := bytes.Repeat([]byte{fill}, 8)
				b[pos] = byte(v)
				want := plain(byte(v))
				if got := plain8(binary.LittleEndian.Uint64(b)); got != want {
					t.Fatalf("plain8(% x) = %v, want %v", b, got, want)
				}
			}
		}
	}
}
