package canon

import (
	"bytes"
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
