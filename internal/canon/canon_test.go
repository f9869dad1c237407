package canon

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/gowebpki/jcs"
)

// jcsTestdata is the RFC 8785 test vectors shipped with github.com/gowebpki/jcs.
func jcsTestdata(t testing.TB) string {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "github.com/gowebpki/jcs").Output()
	if err != nil {
		t.Fatalf("locate the jcs module (its testdata holds the RFC 8785 vectors): %v", err)
	}
	return filepath.Join(strings.TrimSpace(string(out)), "testdata")
}

// exactNumbers lists the vectors whose expected output rounds a number to a double; this
// package keeps the literal's digits instead (see the package comment).
var exactNumbers = map[string]string{
	"values.json": `{"literals":[null,true,false],"numbers":[333333333.33333329,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}`,
}

func TestRFC8785Vectors(t *testing.T) {
	dir := jcsTestdata(t)
	inputs, _ := filepath.Glob(filepath.Join(dir, "input", "*.json"))
	if len(inputs) < 8 {
		t.Fatalf("found %d RFC 8785 vectors in %s", len(inputs), dir)
	}
	for _, in := range inputs {
		name := filepath.Base(in)
		t.Run(name, func(t *testing.T) {
			input, _ := os.ReadFile(in)
			want, err := os.ReadFile(filepath.Join(dir, "output", name))
			if err != nil {
				t.Fatal(err)
			}
			if exact, ok := exactNumbers[name]; ok {
				want = []byte(exact)
			}
			got, err := Canonicalize(input)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("\n got %s\nwant %s", got, want)
			}
		})
	}
}

// TestAgreesWithJCS: where jcs is right (strictly valid input, numbers that a double holds
// exactly in their shortest form), the output is jcs's byte for byte.
func TestAgreesWithJCS(t *testing.T) {
	for _, in := range []string{
		`{"b":[1,2.5,-0.001,1e21,1e-7,123456789012345680000],"a":{"z":null,"y":"\u00e9\ud83d\ude00"},"":true}`,
		`[{"\u20ac":1,"\ud83d\ude00":2,"\ufb01":3,"a":4}]`,
		`"\u0000\u001f\u007f\u2028 /\\\""`,
		`[0,-0,0.0,100,1e2,12.340]`,
		"  {\"k\" :\t[ true , false ]\r\n}  ",
		`{"n":5e-324,"m":1.7976931348623157e308}`,
	} {
		want, err := jcs.Transform([]byte(in))
		if err != nil {
			t.Fatalf("jcs: %s: %v", in, err)
		}
		got, err := Canonicalize([]byte(in))
		if err != nil {
			t.Fatalf("%s: %v", in, err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s:\n got %s\njcs  %s", in, got, want)
		}
	}
}

func TestNotStrictJSONIsRaw(t *testing.T) {
	deep := strings.Repeat("[", MaxDepth+1) + strings.Repeat("]", MaxDepth+1)
	for _, in := range []string{
		`0x1p-2`, `+1`, `01`, `.5`, `1_0`, `1.`, `1e`, `-`, `[1 2]`, `{"a":1,"a":1}`,
		`{"a":{"b":1,"b":2}}`, `"\ud800"`, `"\udc00\ud800"`, `"\ud800x"`, "\"\xff\"", "\"\xed\xa0\x80\"",
		"\"a\tb\"", `{"a":1,}`, `[1,]`, `nul`, `{"a" 1}`, `1 2`, `"\x"`, deep, `1e12345678901234567`,
		`{a:1}`, `'a'`, `NaN`, `Infinity`, ``, ` `,
	} {
		if _, err := Canonicalize([]byte(in)); !errors.Is(err, ErrNotCanonical) {
			t.Errorf("%q was canonicalized (err %v)", in, err)
		}
		if fp := Compute("POST", "/x", []byte(in)); fp.JSON || fp.Fields != nil {
			t.Errorf("%q: fingerprint says JSON", in)
		}
	}
	ok := strings.Repeat("[", MaxDepth) + strings.Repeat("]", MaxDepth)
	if _, err := Canonicalize([]byte(ok)); err != nil {
		t.Errorf("nesting of exactly MaxDepth refused: %v", err)
	}
}

func TestEquivalentBodiesShareAFingerprint(t *testing.T) {
	groups := [][]string{
		{`{"amount":100,"to":"acc_2"}`, ` { "to" : "acc_2" , "amount" : 100 } `, `{"to":"\u0061cc_2","amount":1e2}`, `{"amount":100.0,"to":"acc\u005f2"}`},
		{`1`, `1.0`, `1e0`, `10e-1`, `0.1e1`, `1.000E+0`, `1000e-3`, `0.0100e2`},
		{`1e32`, `100.0e30`, `1E+32`, `100000000000000000000000000000000`},
		{`-0`, `0`, `0.0`, `-0.0e7`},
		{`"é"`, `"\u00e9"`, `"\u00E9"`},
		{`"/"`, `"\/"`},
		{`[1,{"b":[],"a":{}}]`, "[1,{\"a\":{},\n\"b\":[ ]}]"},
		{`{"😀":1,"\uffff":2}`, `{"\uffff":2,"\ud83d\ude00":1}`},
	}
	for _, g := range groups {
		first := Compute("POST", "/v1/transfers", []byte(g[0]))
		if !first.JSON {
			t.Fatalf("%s is not JSON?", g[0])
		}
		for _, other := range g[1:] {
			if fp := Compute("post", "/v1/transfers", []byte(other)); fp.Sum != first.Sum {
				c1, _ := Canonicalize([]byte(g[0]))
				c2, _ := Canonicalize([]byte(other))
				t.Errorf("%s and %s differ: %s vs %s", g[0], other, c1, c2)
			}
		}
	}
}

func TestDifferentBodiesDiffer(t *testing.T) {
	bodies := []string{
		``, `{}`, `[]`, `null`, `0`, `""`, `"0"`, `false`, `true`, `[null]`, `{"a":null}`, `{"a":0}`,
		`{"amount":9007199254740993}`, `{"amount":9007199254740992}`, `{"amount":9007199254740993.0000000001}`,
		`{"amount":0.1}`, `{"amount":0.10000000000000001}`, `{"amount":1e400}`, `{"amount":1e401}`,
		`{"amount":-1}`, `{"amount":1}`, `{"amount":"1"}`, `{"amount":[1]}`, `{"Amount":1}`,
		`{"a":1,"b":2}`, `{"a":2,"b":1}`, `{"a":{"b":1}}`, `{"a.b":1}`, `[1,2]`, `[2,1]`, `[12]`,
		`"a\u0000"`, `"a"`, `"\u2028"`, "\"\u00e9\"", "\"e\u0301\"",
		`not json`, `not  json`, `{"a":1,"a":1}`, `{"a":1, "a":1}`,
	}
	seen := map[[32]byte]string{}
	for _, b := range bodies {
		fp := Compute("POST", "/v1/transfers", []byte(b))
		if prev, ok := seen[fp.Sum]; ok {
			t.Errorf("%q and %q share a fingerprint", prev, b)
		}
		seen[fp.Sum] = b
	}
}

func TestMethodAndPathCount(t *testing.T) {
	body := []byte(`{"a":1}`)
	base := Compute("POST", "/v1/accounts/1/deposits", body).Sum
	for _, c := range []struct{ method, path string }{
		{"PUT", "/v1/accounts/1/deposits"},
		{"POST", "/v1/accounts/2/deposits"},
		{"POST", "/v1/accounts/1/deposits/"},
		{"POST", "/v1/accounts/1%2Fdeposits"},
		{"POST\n/v1", "accounts/1/deposits"},
	} {
		if Compute(c.method, c.path, body).Sum == base {
			t.Errorf("%s %s shares the fingerprint of POST /v1/accounts/1/deposits", c.method, c.path)
		}
	}
	if Compute("post", "/v1/accounts/1/deposits", body).Sum != base {
		t.Error("the method is not upper-cased")
	}
}

func TestFields(t *testing.T) {
	a := Compute("POST", "/t", []byte(`{"amount":100,"to":"x","memo":{"k":[1,2]}}`))
	b := Compute("POST", "/t", []byte(`{"memo":{"k":[1,2.0]},"to":"x","amount":200}`))
	if len(a.Fields) != 3 || len(b.Fields) != 3 {
		t.Fatalf("fields: %v %v", a.Fields, b.Fields)
	}
	if a.Fields["to"] != b.Fields["to"] || a.Fields["memo"] != b.Fields["memo"] {
		t.Error("equal members hash differently")
	}
	if a.Fields["amount"] == b.Fields["amount"] {
		t.Error("different amounts hash alike")
	}
	if len(a.Fields["to"]) != 64 {
		t.Errorf("field hash %q is not hex SHA-256", a.Fields["to"])
	}
	var big strings.Builder
	big.WriteString("{")
	for i := range MaxFields + 1 {
		if i > 0 {
			big.WriteString(",")
		}
		fmt.Fprintf(&big, `"f%d":%d`, i, i)
	}
	big.WriteString("}")
	if fp := Compute("POST", "/t", []byte(big.String())); !fp.JSON || fp.Fields != nil {
		t.Errorf("an object of %d members: JSON %v, %d fields; want JSON and no fields", MaxFields+1, fp.JSON, len(fp.Fields))
	}
	// The member names together: at MaxFieldNameBytes the hashes are reported, one byte more
	// and they are not (an escaped name counts its unescaped bytes).
	long := strings.Repeat("n", MaxFieldNameBytes-2)
	if fp := Compute("POST", "/t", []byte(`{"\u0061":1,"`+long+`b":2}`)); len(fp.Fields) != 2 {
		t.Errorf("names of %d bytes together: %d fields; want 2", MaxFieldNameBytes, len(fp.Fields))
	}
	if fp := Compute("POST", "/t", []byte(`{"a":1,"`+long+`bc":2}`)); !fp.JSON || fp.Fields != nil {
		t.Errorf("names of %d bytes together: JSON %v, %d fields; want JSON and no fields", MaxFieldNameBytes+1, fp.JSON, len(fp.Fields))
	}
	for _, body := range []string{`[1]`, `1`, `"s"`, `not json`, ``} {
		if fp := Compute("POST", "/t", []byte(body)); fp.Fields != nil {
			t.Errorf("%q has fields %v", body, fp.Fields)
		}
	}
}

func TestUTF16Order(t *testing.T) {
	// U+E000..U+FFFF sort after supplementary characters in UTF-16 (RFC 8785 3.2.3).
	names := []string{"\uffff", "😀", "\ue000", "a", "", "aa", "\u00e9", "b"}
	want := []string{"", "a", "aa", "b", "\u00e9", "😀", "\ue000", "\uffff"}
	in := `{`
	for i, n := range names {
		if i > 0 {
			in += ","
		}
		b, _ := json.Marshal(n)
		in += string(b) + `:0`
	}
	in += `}`
	got, err := Canonicalize([]byte(in))
	if err != nil {
		t.Fatal(err)
	}
	var order []string
	dec := json.NewDecoder(bytes.NewReader(got))
	dec.Token()
	for dec.More() {
		tok, _ := dec.Token()
		order = append(order, tok.(string))
		dec.Token()
	}
	if !reflect.DeepEqual(order, want) {
		t.Errorf("order %q, want %q", order, want)
	}
}

// TestPoolKeepsNoLargeBlock: a body with a string far longer than a block grows the writer's
// block; the pool must not keep that body-sized block for every later request.
func TestPoolKeepsNoLargeBlock(t *testing.T) {
	body := []byte(`{"memo":"` + strings.Repeat("x", 1<<20) + `"}`)
	for range 20 {
		Compute("POST", "/x", body)
		b := buffers.Get().(*[]byte)
		if cap(*b) > maxPooled {
			t.Fatalf("the pool holds a block of %d bytes after a 1 MiB string", cap(*b))
		}
		buffers.Put(b)
	}
}

// TestComputeCanonical: the canonical body is Canonicalize's, nil for a body that is not
// strictly valid JSON, and the fingerprint is Compute's.
func TestComputeCanonical(t *testing.T) {
	for _, in := range []string{
		`{"amount":1e2,"to":"acc_2"}`, ` { "to" : "acc\u005f2" , "amount" : 100 } `, `[1,{"b":[],"a":{}}]`,
		`{"Amount":1,"amount":2}`, `"a\u0000"`, `12.50`, `{"😀":1,"\uffff":2}`,
		`not json`, `{"a":1,"a":2}`, ``, `[1,]`, strings.Repeat("[", MaxDepth+1) + strings.Repeat("]", MaxDepth+1),
		string(shapes[3].gen(64 << 10)), // wide
	} {
		fp, canonical := ComputeCanonical("post", "/v1/transfers", []byte(in))
		if want := Compute("post", "/v1/transfers", []byte(in)); !reflect.DeepEqual(fp, want) {
			t.Errorf("%.40q: ComputeCanonical's fingerprint %+v, Compute's %+v", in, fp, want)
		}
		want, err := Canonicalize([]byte(in))
		if err != nil {
			want = nil
		}
		if !bytes.Equal(canonical, want) || (canonical == nil) != (want == nil) || fp.JSON != (want != nil) {
			t.Errorf("%.40q: canonical %.40q (JSON %v), Canonicalize %.40q", in, canonical, fp.JSON, want)
		}
	}
	// Every shape of the benchmarks: the field hashes are written in the same pass as the body
	// (writeFields), whose text must be Canonicalize's, member names with escapes included.
	for _, s := range shapes {
		body := s.gen(64 << 10)
		_, canonical := ComputeCanonical("POST", "/t", body)
		if want, err := Canonicalize(body); err == nil && !bytes.Equal(canonical, want) {
			t.Errorf("shape %s: ComputeCanonical's text is not Canonicalize's", s.name)
		}
	}
	// Bodies that share a fingerprint have one canonical text.
	_, a := ComputeCanonical("POST", "/t", []byte(`{"amount":1e2,"to":"acc_2"}`))
	_, b := ComputeCanonical("POST", "/t", []byte(`{"to":"acc_2","amount":100.0}`))
	if string(a) != `{"amount":100,"to":"acc_2"}` || !bytes.Equal(a, b) {
		t.Errorf("canonical bodies %s and %s", a, b)
	}
}
