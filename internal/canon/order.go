package canon

import (
	"bytes"
	"slices"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// The order and equality of member names: RFC 8785's UTF-16 order, and the case folding
// that decoders such as encoding/json match names with.

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
// (encoding/json's own folding), as the pairwise check of small objects does.
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
		out = utf8.AppendRune(out, orbitMin(r))
		i += n
	}
	return out
}

// orbitMin returns the smallest rune of r's orbit under unicode.SimpleFold: two runes have
// the same exactly when bytes.EqualFold matches them. (Upper-casing the lower case, as
// encoding/json did before Go 1.21, also matches U+0130 and U+0131 with 'i' and 'I'.)
func orbitMin(r rune) rune {
	m := r
	for f := unicode.SimpleFold(r); f != r; f = unicode.SimpleFold(f) {
		m = min(m, f)
	}
	return m
}
