package idemhttp

import "testing"

// TestDeclaredKey: a declared route's key leaves the variables' patterns out, nested braces
// included, and upper-cases the method.
func TestDeclaredKey(t *testing.T) {
	t.Parallel()
	for in, want := range map[[2]string]string{
		{"post", "/orders"}:                             "POST /orders",
		{"POST", "/accounts/{id:[0-9]+}/deposits"}:      "POST /accounts/{id}/deposits",
		{"PUT", "/a/{id:[0-9]{3}}/b/{name}"}:            "PUT /a/{id}/b/{name}",
		{"POST", "/t/{x:(?:a|b)}/{y:[a-z]{1,2}:[0-9]}"}: "POST /t/{x}/{y}",
		{"POST", "/plain:colon"}:                        "POST /plain:colon",
	} {
		if got := declaredKey(in[0], in[1]); got != want {
			t.Errorf("declaredKey(%q, %q) = %q, want %q", in[0], in[1], got, want)
		}
	}
}
