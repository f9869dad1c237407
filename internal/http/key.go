package idemhttp

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
)

// parseKey reads the key header: an RFC 8941 sf-string ("k1") or a bare value (k1). It only
// unquotes; whether the key is valid (1 to 255 visible ASCII characters) is the SQL API's
// rule, which validKey repeats so that a bad key is refused before any database work
// (FuzzParseKey compares the two). Several header lines are ambiguous, hence invalid.
func parseKey(values []string) (key string, present, valid bool) {
	if len(values) == 0 {
		return "", false, false
	}
	if len(values) > 1 {
		return "", true, false
	}
	// Optional whitespace around a field value is space and tab (RFC 9110, OWS), nothing else:
	// strings.TrimSpace would also take U+00A0, U+0085 and U+3000 off, which a server passes
	// through as bytes, and name another key than the one sent.
	v := strings.Trim(values[0], " \t")
	if strings.HasPrefix(v, `"`) {
		if len(v) < 2 || !strings.HasSuffix(v, `"`) {
			return "", true, false
		}
		var b strings.Builder
		for i := 1; i < len(v)-1; i++ {
			c := v[i]
			switch {
			case c == '\\':
				i++
				if i >= len(v)-1 || (v[i] != '"' && v[i] != '\\') {
					return "", true, false
				}
				b.WriteByte(v[i])
			case c == '"' || c < 0x20 || c > 0x7e:
				return "", true, false
			default:
				b.WriteByte(c)
			}
		}
		v = b.String()
	}
	if !validKey(v) {
		return "", true, false
	}
	return v, true, true
}

// validKey is idem_begin's key rule: 1 to 255 bytes, each visible ASCII (0x21 to 0x7E).
func validKey(k string) bool {
	if len(k) < 1 || len(k) > 255 {
		return false
	}
	for i := 0; i < len(k); i++ {
		if k[i] < 0x21 || k[i] > 0x7e {
			return false
		}
	}
	return true
}

// keyHash is what logs show of a key: a short hash, never the key.
func KeyHash(principal, key string) string {
	h := sha256.Sum256([]byte(principal + "\x00" + key))
	return hex.EncodeToString(h[:6])
}
