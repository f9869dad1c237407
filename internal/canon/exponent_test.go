package canon

import (
	"testing"
)

// TestCanonicalExponentFitsTheLimit: a 15-digit exponent was strictly valid while its
// canonical text could need 16 digits (10e999999999999999 is 1e+1000000000000000), which was
// not: a body of exactly those bytes was hashed as its bytes and shared the fingerprint of the
// valid body, and a canonical text did not canonicalize again. The limit is 16 digits now, as
// written and once canonical (D178): the canonical text of a valid number is valid, and a
// number whose canonical exponent passes the limit is not valid either.
func TestCanonicalExponentFitsTheLimit(t *testing.T) {
	for _, c := range []struct{ a, b string }{
		{`10e9999999999999999`, `1e+10000000000000000`},
		{`0.1e-9999999999999999`, `1e-10000000000000000`},
		{`{"n":[10e9999999999999999]}`, `{"n":[1e+10000000000000000]}`},
	} {
		a, b := Compute("POST", "/f", []byte(c.a)), Compute("POST", "/f", []byte(c.b))
		if a.JSON || b.JSON {
			t.Errorf("%s JSON %v, %s JSON %v: want neither strictly valid", c.a, a.JSON, c.b, b.JSON)
		}
		if a.Sum == b.Sum {
			t.Errorf("%s and %s share a fingerprint", c.a, c.b)
		}
	}
	// 10e999999999999999 and the body of its canonical text are one request (one value).
	if a, b := Compute("POST", "/f", []byte(`10e999999999999999`)), Compute("POST", "/f", []byte(`1e+1000000000000000`)); !a.JSON || !b.JSON || a.Sum != b.Sum {
		t.Errorf("10e999999999999999 (JSON %v) and 1e+1000000000000000 (JSON %v): want one canonical request", a.JSON, b.JSON)
	}
	// At the limit: valid, and the canonical text canonicalizes again to itself.
	for _, v := range []string{`1e9999999999999999`, `9e9999999999999999`, `1e-9999999999999999`, `0.1e9999999999999999`,
		`100e-9999999999999999`, `10e999999999999999`, `0.1e-999999999999999`} {
		cc, err := Canonicalize([]byte(v))
		if err != nil {
			t.Fatalf("%s: %v", v, err)
		}
		again, err := Canonicalize(cc)
		if err != nil || string(again) != string(cc) {
			t.Errorf("the canonical form %s of %s canonicalizes to %s, %v", cc, v, again, err)
		}
	}
}

// TestExponentLeadingZerosAreNotCounted: docs/http.md's limit is 16 significant digits of an
// exponent: leading zeros are not counted, so 1e0000000000000000001 (19 digits as written) is
// the number 10, one request with the body that writes 10 (a review read "as written" as every
// digit).
func TestExponentLeadingZerosAreNotCounted(t *testing.T) {
	a, b := Compute("POST", "/f", []byte(`{"amount":1e0000000000000000001}`)), Compute("POST", "/f", []byte(`{"amount":10}`))
	if !a.JSON || !b.JSON || a.Sum != b.Sum {
		t.Errorf("1e0000000000000000001 (JSON %v) and 10 (JSON %v): want one canonical request", a.JSON, b.JSON)
	}
	if c := Compute("POST", "/f", []byte(`{"amount":1e00000000000000000012345678901234567}`)); c.JSON {
		t.Errorf("an exponent of 17 significant digits after leading zeros is strictly valid")
	}
}
