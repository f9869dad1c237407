package canon

import (
	"strings"
	"testing"
)

// TestNumberWithoutExponent: the literals that number keeps as they are (no exponent) are
// exactly those appendDecimal writes back unchanged.
func TestNumberWithoutExponent(t *testing.T) {
	ints := []string{"0", "1", "10", "123", "1" + strings.Repeat("0", 20), "9" + strings.Repeat("9", 20), "1" + strings.Repeat("0", 21)}
	fracs := []string{"", "0", "5", "50", "05", "00000", "000001", "0000001", "0000010", "00000012", "123456789", strings.Repeat("0", 30) + "1"}
	for _, sign := range []string{"", "-"} {
		for _, i := range ints {
			for _, f := range fracs {
				lit := sign + i
				var frac []byte
				if f != "" {
					lit += "." + f
					frac = []byte(f)
				}
				want := string(appendDecimal(nil, sign == "-", []byte(i), frac, 0))
				got, err := Canonicalize([]byte(lit))
				if err != nil || string(got) != want {
					t.Errorf("%s: %s (%v), want %s", lit, got, err, want)
				}
			}
		}
	}
}
