// Package httpsyntax holds the few rules of HTTP's syntax (RFC 9110) that both sides of this
// module check: the middleware its options, the client a request before it sends it. It
// depends on nothing but the standard library.
package httpsyntax

import "strings"

// IsToken tells whether s is an RFC 9110 token (section 5.6.2): what a method or a header name
// is.
func IsToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c <= ' ' || c >= 0x7f || strings.IndexByte(`"(),/:;<=>?@[\]{}`, c) >= 0 {
			return false
		}
	}
	return true
}

// ValidFieldValue tells whether a header may carry v: no control character but a tab.
func ValidFieldValue(v string) bool {
	return !strings.ContainsFunc(v, func(r rune) bool { return (r < 0x20 && r != '\t') || r == 0x7f })
}
