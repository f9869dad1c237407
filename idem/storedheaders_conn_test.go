package idem_test

import (
	"context"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestStoredHeadersRefusesConnectionFields: a field of one connection or of one response's
// framing or moment cannot be replayed on another response: New refuses it by name (any case)
// rather than store "Connection: close", "Transfer-Encoding: chunked" or a handler's
// Content-Length (a replay declared 10 bytes and sent the 5 the first answer had, cut off) or
// the first answer's Date with an answer and send it again. Other names, Set-Cookie among them, are the
// application's choice.
func TestStoredHeadersRefusesConnectionFields(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 2)
	ctx := context.Background()
	for _, h := range []string{"Connection", "keep-alive", "Proxy-Connection", "Transfer-Encoding", "TE", "Trailer", "upgrade",
		"Proxy-Authenticate", "Proxy-Authorization", "Content-Length", "date"} {
		_, err := idem.New(ctx, idem.Options{DB: pool, Principal: glAlice, StoredHeaders: []string{"Content-Type", h}})
		if err == nil || !strings.Contains(err.Error(), "StoredHeaders") || !strings.Contains(err.Error(), h) {
			t.Errorf("StoredHeaders with %q: %v, want an error that names it", h, err)
		}
	}
	if _, err := idem.New(ctx, idem.Options{DB: pool, Principal: glAlice, StoredHeaders: []string{"Content-Type", "Set-Cookie", "X-Title"}}); err != nil {
		t.Errorf("StoredHeaders with Set-Cookie and X-Title: %v", err)
	}
}
