package dbidem

import "testing"

// TestHoldsNUL: the escape \u0000 in a step's JSON is found, a literal backslash before "u0000"
// (escaped as \\) is not.
func TestHoldsNUL(t *testing.T) {
	for in, want := range map[string]bool{
		`"a\u0000b"`:      true,
		`"\\u0000"`:       false,
		`"\\\u0000"`:      true,
		`"\\\\u0000"`:     false,
		`"\\u0000\u0000"`: true,
		`{"k":"\u0001"}`:  false,
		`1`:               false,
	} {
		if got := holdsNUL([]byte(in)); got != want {
			t.Errorf("holdsNUL(%s) = %v, want %v", in, got, want)
		}
	}
}
