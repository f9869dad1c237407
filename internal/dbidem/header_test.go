package dbidem

import (
	"net/http"
	"reflect"
	"testing"
)

// TestStoredHeadersKeepEveryLineAndByte: what encodeHeader stores, decodeHeader reads back as
// the lines that went out (D166): several lines stay several, bytes that are not UTF-8 and
// U+0000 stay bytes, a carriage return or line feed inside a value is the space net/http
// writes, and a string that another client stored (a list joined with ", ") is one line.
func TestStoredHeadersKeepEveryLineAndByte(t *testing.T) {
	t.Parallel()
	in := http.Header{
		"Set-Cookie":   {"a=1; Expires=Wed, 21 Oct 2037 07:28:00 GMT", "b=2"},
		"Etag":         {"\"v\xe9\xff1\""},
		"X-Nul":        {"a\x00b"},
		"X-Soh":        {"\x01starts with U+0001"},
		"X-Stx":        {"\x02starts with U+0002"},
		"X-Crlf":       {"a\r\nb"},
		"Content-Type": {"application/json"},
		"X-Empty":      {"", "x"},
		"X-Utf8":       {"café ☕"},
	}
	want := in.Clone()
	want["X-Crlf"] = []string{"a  b"}
	got, err := decodeHeader([]byte(encodeHeader(in)))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("stored and read back:\n got %q\nwant %q", got, want)
	}
	// The example of docs/sql-api.md, "Stored headers".
	if s := encodeHeader(http.Header{"Etag": {"\"v\xe9\""}}); s != `{"Etag":"\u0001ĢŶǩĢ"}` {
		t.Fatalf("the documented form of an ETag with byte 0xE9: %s", s)
	}
	// The multi-line example of the same section.
	if s := encodeHeader(http.Header{"Set-Cookie": {"a=1", "b=2"}}); s != `{"Set-Cookie":"\u0002a=1\nb=2"}` {
		t.Fatalf("the documented form of two Set-Cookie lines: %s", s)
	}
	// A row of the previous release, which stored a value's line feed as it was (net/http sent
	// it as a space): still one line.
	if h, err := decodeHeader([]byte(`{"Location":"/a\n/b"}`)); err != nil || !reflect.DeepEqual(h, http.Header{"Location": {"/a\n/b"}}) {
		t.Fatalf("a row of the previous release with a line feed: %q %v", h, err)
	}
	// A header with no line (a handler's w.Header()["Content-Type"] = nil, which keeps net/http
	// from sniffing one) is stored as U+0001 alone, and read back as a name with no line
	// (D265); an empty line stays an empty line.
	for _, none := range []http.Header{{"Content-Type": nil}, {"Content-Type": {}}} {
		s := encodeHeader(none)
		if s != `{"Content-Type":"\u0001"}` {
			t.Fatalf("a header with no line: %s", s)
		}
		h, err := decodeHeader([]byte(s))
		if v, ok := h["Content-Type"]; err != nil || !ok || len(v) != 0 {
			t.Fatalf("a header with no line, read back: %q %v", h, err)
		}
	}
	if h, err := decodeHeader([]byte(encodeHeader(http.Header{"X-Empty": {""}}))); err != nil || !reflect.DeepEqual(h, http.Header{"X-Empty": {""}}) {
		t.Fatalf("an empty line: %q %v", h, err)
	}
	// UTF-8 text is stored as it is; a string from another client is one line, as it is.
	if s := encodeHeader(http.Header{"X-Utf8": {"café"}}); s != `{"X-Utf8":"café"}` {
		t.Fatalf("UTF-8 text: %s", s)
	}
	h, err := decodeHeader([]byte(`{"Vary":"Accept, Origin","X-Odd":"\u0001not bytes ☕"}`))
	if err != nil || !reflect.DeepEqual(h, http.Header{"Vary": {"Accept, Origin"}, "X-Odd": {"\x01not bytes ☕"}}) {
		t.Fatalf("strings another client stored: %q %v", h, err)
	}
}
