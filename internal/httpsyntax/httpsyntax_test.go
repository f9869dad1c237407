package httpsyntax

import "testing"

func TestIsToken(t *testing.T) {
	for s, want := range map[string]bool{"POST": true, "Idempotency-Key": true, "X_a.b~c!#$%&'*+^`|": true,
		"": false, "BAD METHOD": false, "a:b": false, "a\tb": false, "é": false, "a(b)": false, "a\x7f": false} {
		if got := IsToken(s); got != want {
			t.Errorf("IsToken(%q) = %v, want %v", s, got, want)
		}
	}
}

func TestValidFieldValue(t *testing.T) {
	for s, want := range map[string]bool{"": true, "a b": true, "a\tb": true, "é": true, "a\nb": false, "a\rb": false,
		"a\x00b": false, "a\x7fb": false} {
		if got := ValidFieldValue(s); got != want {
			t.Errorf("ValidFieldValue(%q) = %v, want %v", s, got, want)
		}
	}
}
