package canon

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/gowebpki/jcs"
)

var seeds = []string{
	``, `{}`, `[]`, `null`, `true`, `0`, `-0.0`, `1e-7`, `1E+30`, `123456789012345678901234567890`,
	`9007199254740993`, `0.10000000000000001`, `"\u00e9\ud83d\ude00\u2028"`, `"\ud800"`,
	`{"a":1,"b":[true,false,null],"c":{"d":"e"}}`, `{"b":1,"a":2}`, `{"a":1,"a":2}`,
	`[1 2]`, `0x1p-2`, `+1`, `01`, `.5`, `1_0`, "\"\xff\"", `{"\u20ac":1,"\ud83d\ude00":2,"\ufb01":3}`, `{"k":1,"\u212a":2}`, `{"i":1,"\u0130":2}`,
	strings.Repeat("[", 130) + strings.Repeat("]", 130), ` [ 1 , { "x" : "\/" } ] `,
}

// FuzzCanonicalize: never panics; the canonical form is stable, valid JSON with the same
// value as the input (as encoding/json decodes both), and has jcs's value where jcs accepts.
func FuzzCanonicalize(f *testing.F) {
	for _, s := range seeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		fp := Compute("POST", "/f", data)
		c, err := Canonicalize(data)
		fpc, cc := ComputeCanonical("POST", "/f", data)
		if !reflect.DeepEqual(fpc, fp) || !bytes.Equal(cc, c) || (cc == nil) != (err != nil) {
			t.Fatalf("%q: ComputeCanonical %+v %q, Compute %+v, Canonicalize %q", data, fpc, cc, fp, c)
		}
		if err != nil {
			if fp.JSON {
				t.Fatalf("%q: Compute says JSON, Canonicalize says %v", data, err)
			}
			return
		}
		if !fp.JSON {
			t.Fatalf("%q: canonicalized but fingerprinted raw", data)
		}
		again, err := Canonicalize(c)
		if err != nil || !bytes.Equal(again, c) {
			t.Fatalf("%q: not stable: %s -> %s (%v)", data, c, again, err)
		}
		if !json.Valid(c) {
			t.Fatalf("%q: canonical form %s is not valid JSON", data, c)
		}
		caseDup := false
		for _, names := range objectNames(t, c) {
			for i := range names {
				if i > 0 && utf16Compare(names[i-1], names[i]) >= 0 {
					t.Fatalf("%q: members not in UTF-16 order: %q", data, names)
				}
				for j := range i {
					caseDup = caseDup || strings.EqualFold(names[i], names[j])
				}
			}
		}
		if fp.Ambiguous != AmbiguousNUL && (fp.Ambiguous == AmbiguousCase) != caseDup {
			t.Fatalf("%q: Ambiguous %q, but names equal under EqualFold: %v", data, fp.Ambiguous, caseDup)
		}
		var in, out any
		errIn, errOut := json.Unmarshal(data, &in), json.Unmarshal(c, &out)
		if (errIn == nil) != (errOut == nil) {
			t.Fatalf("%q: encoding/json: input %v, canonical %v", data, errIn, errOut)
		}
		if errIn == nil && !reflect.DeepEqual(in, out) {
			t.Fatalf("%q: value changed: %#v -> %#v", data, in, out)
		}
		if j, err := jcs.Transform(data); err == nil && errOut == nil {
			var jv any
			if err := json.Unmarshal(j, &jv); err == nil && !reflect.DeepEqual(jv, out) {
				t.Fatalf("%q: jcs %s, here %s", data, j, c)
			}
		}
	})
}

// FuzzFingerprint: two bodies share a fingerprint only if they are the same bytes or the
// same JSON value.
func FuzzFingerprint(f *testing.F) {
	for i := range seeds {
		f.Add([]byte(seeds[i]), []byte(seeds[(i+1)%len(seeds)]))
	}
	f.Add([]byte(`{"a":1,"b":2}`), []byte(`{"b":2.0,"a":1}`))
	f.Add([]byte(`1`), []byte(`1.0`))
	f.Fuzz(func(t *testing.T, a, b []byte) {
		fa, fb := Compute("POST", "/f", a), Compute("POST", "/f", b)
		if fa.Sum != fb.Sum {
			return
		}
		if bytes.Equal(a, b) {
			return
		}
		if !fa.JSON || !fb.JSON {
			t.Fatalf("%q and %q share a fingerprint but are not both JSON", a, b)
		}
		var va, vb any
		if json.Unmarshal(a, &va) == nil && json.Unmarshal(b, &vb) == nil && !reflect.DeepEqual(va, vb) {
			t.Fatalf("%q and %q share a fingerprint but differ: %#v %#v", a, b, va, vb)
		}
	})
}
