package dbidem

import (
	"bytes"
	"testing"
)

// TestDecodeByteaText: both text forms of a bytea decode to its bytes, and a text in neither
// form is an error, not a wrong body (D231). The escape form of every byte value as the
// database writes it is read in idem's TestLegacyRoleSettingsChangeNoAnswer.
func TestDecodeByteaText(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []byte
	}{
		{`\x`, []byte{}},
		{`\x00ff41`, []byte{0, 0xff, 'A'}},
		{``, []byte{}},
		{`abc`, []byte("abc")},
		{`\\`, []byte(`\`)},
		{`\000\377a\\b\047`, []byte{0, 0xff, 'a', '\\', 'b', '\''}},
	} {
		got, err := decodeByteaText(c.in)
		if err != nil || !bytes.Equal(got, c.want) {
			t.Errorf("decodeByteaText(%q) = %v, %v; want %v", c.in, got, err, c.want)
		}
	}
	for _, in := range []string{`\x0`, `\x0g`, `\`, `\9`, `\12`, `\400`, `a\b`} {
		if got, err := decodeByteaText(in); err == nil {
			t.Errorf("decodeByteaText(%q) = %v, want an error", in, got)
		}
	}
}
