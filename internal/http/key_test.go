package idemhttp

import (
	"strings"
	"testing"
)

func TestParseKey(t *testing.T) {
	for _, c := range []struct {
		in             []string
		key            string
		present, valid bool
	}{
		{nil, "", false, false},
		{[]string{"k1"}, "k1", true, true},
		{[]string{`"k1"`}, "k1", true, true},
		{[]string{`"a\"b\\c"`}, `a"b\c`, true, true},
		{[]string{`""`}, "", true, false},
		{[]string{`"a b"`}, "", true, false},
		{[]string{`"ab`}, "", true, false},
		{[]string{`"a\qb"`}, "", true, false},
		{[]string{"a", "b"}, "", true, false},
		{[]string{strings.Repeat("k", 255)}, strings.Repeat("k", 255), true, true},
		{[]string{strings.Repeat("k", 256)}, "", true, false},
		{[]string{"clé"}, "", true, false},
	} {
		key, present, valid := parseKey(c.in)
		if key != c.key || present != c.present || valid != c.valid {
			t.Errorf("parseKey(%q) = %q, %v, %v; want %q, %v, %v", c.in, key, present, valid, c.key, c.present, c.valid)
		}
	}
}

// FuzzParseKey: never panics, and a key it accepts is what the SQL functions accept.
func FuzzParseKey(f *testing.F) {
	for _, s := range []string{"k1", `"k1"`, `"a\"b"`, `""`, "\x00", `"\`, strings.Repeat("x", 300)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		key, present, valid := parseKey([]string{v})
		if !present {
			t.Fatal("a header value was not present")
		}
		if !valid {
			return
		}
		if len(key) < 1 || len(key) > 255 {
			t.Fatalf("%q gave a key of %d bytes", v, len(key))
		}
		for i := 0; i < len(key); i++ {
			if key[i] < 0x21 || key[i] > 0x7e {
				t.Fatalf("%q gave key %q with byte %#x", v, key, key[i])
			}
		}
	})
}
