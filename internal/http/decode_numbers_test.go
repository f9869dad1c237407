package idemhttp

import (
	stdjson "encoding/json"
	"math/big"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// TestDecodeJSONNumberTypes: the Go types handlers written for encoding/json take numbers into
// decode from the canonical text (D233): json.Number, time.Duration and *big.Int, whose v2
// defaults refused every body, and integers from 10^21 on, which the canonical text writes with
// an exponent. Null is the v2 default (the zero value, a nil pointer); a Number also takes a
// string that is a number, as encoding/json does; any other string, a fraction or a runaway
// exponent is 400.
func TestDecodeJSONNumberTypes(t *testing.T) {
	t.Parallel()
	decode := func(t *testing.T, text string, v any) int {
		t.Helper()
		r := httptest.NewRequest(http.MethodPost, "/", strings.NewReader(text))
		w := httptest.NewRecorder()
		if DecodeJSON(w, r, v) {
			return 200
		}
		return w.Code
	}
	t.Run("Number", func(t *testing.T) {
		for text, want := range map[string]string{`{"n":12.50}`: "12.5", `{"n":1000000000000000000000}`: "1e+21", `{"n":-0.0000001}`: "-1e-7", `{"n":7}`: "7"} {
			var v struct {
				N stdjson.Number `json:"n"`
			}
			if code := decode(t, text, &v); code != 200 || string(v.N) != want {
				t.Errorf("%s: %d %q, want 200 %q", text, code, v.N, want)
			}
		}
		var v struct {
			N stdjson.Number `json:"n"`
		}
		v.N = "5"
		if code := decode(t, `{"n":null}`, &v); code != 200 || v.N != "" {
			t.Errorf("null: %d %q, want 200 and the zero value (the v2 default)", code, v.N)
		}
		// A string that is a number, as encoding/json takes it (a map's keys too); any other
		// string is refused.
		if code := decode(t, `{"n":"12.50"}`, &v); code != 200 || v.N != "12.50" {
			t.Errorf("the string \"12.50\" into a Number: %d %q, want 200 12.50", code, v.N)
		}
		var m map[stdjson.Number]int
		if code := decode(t, `{"1.5":1,"2":2}`, &m); code != 200 || m["1.5"] != 1 || m["2"] != 2 {
			t.Errorf("Number map keys: %d %v", code, m)
		}
		for _, text := range []string{`{"n":"abc"}`, `{"n":"12 "}`, `{"n":" 12"}`, `{"n":"true"}`, `{"n":"01"}`, `{"n":""}`, `{"n":true}`} {
			if code := decode(t, text, &v); code != 400 {
				t.Errorf("%s into a Number: %d, want 400", text, code)
			}
		}
	})
	t.Run("Duration", func(t *testing.T) {
		var v struct {
			D time.Duration `json:"d"`
		}
		if code := decode(t, `{"d":5e9}`, &v); code != 200 || v.D != 5*time.Second {
			t.Errorf("5e9: %d %v, want 200 5s", code, v.D)
		}
		for _, text := range []string{`{"d":1.5}`, `{"d":"5s"}`, `{"d":1e19}`} {
			if code := decode(t, text, &v); code != 400 {
				t.Errorf("%s: %d, want 400", text, code)
			}
		}
	})
	t.Run("BigInt", func(t *testing.T) {
		want, _ := new(big.Int).SetString("12345678901234567890123", 10)
		for _, text := range []string{`{"n":12345678901234567890123}`, `{"n":1.2345678901234567890123e22}`, `{"n":123456789012345678901230e-1}`} {
			var v struct {
				N *big.Int `json:"n"`
			}
			if code := decode(t, text, &v); code != 200 || v.N == nil || v.N.Cmp(want) != 0 {
				t.Errorf("%s: %d %v, want 200 %v", text, code, v.N, want)
			}
		}
		var v struct {
			N *big.Int `json:"n"`
		}
		if code := decode(t, `{"n":null}`, &v); code != 200 || v.N != nil {
			t.Errorf("null: %d %v, want 200 and nil", code, v.N)
		}
		if code := decode(t, `{"n":-1e+21}`, &v); code != 200 || v.N.String() != "-1"+strings.Repeat("0", 21) {
			t.Errorf("-1e+21: %d %v", code, v.N)
		}
		// The bound counts digits, not the sign.
		if code := decode(t, `{"n":-1e+9999}`, &v); code != 200 || len(v.N.String()) != 10001 {
			t.Errorf("-1e+9999 (10,000 digits): %d", code)
		}
		for _, text := range []string{`{"n":1.5}`, `{"n":1e-3}`, `{"n":1e+999999999}`, `{"n":"1"}`} {
			var v struct {
				N *big.Int `json:"n"`
			}
			if code := decode(t, text, &v); code != 400 {
				t.Errorf("%s: %d, want 400", text, code)
			}
		}
	})
}
