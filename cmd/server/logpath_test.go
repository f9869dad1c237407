package main

import (
	"bytes"
	"strings"
	"testing"
)

// TestProviderKeyNotInTheRequestLog: the simulated provider's lookup (GET
// /v1/provider/calls/{key}) carries a provider key in its path, the idempotency key an outside
// receiver deduplicates by; the request log line wrote the path as it came. Keys are never
// logged: the line names the route's template.
func TestProviderKeyNotInTheRequestLog(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	var log bytes.Buffer
	logged := serveWith(t, s.db, s.db, nil, &log)
	_, token := s.principal("logpath")
	const key = "4f1e7ac0ffee5eed"
	r := logged.call("GET", providerCallsPrefix+key, token, "", "")
	logged.call("GET", "/v1//provider/calls/"+key, token, "", "") // 404, logged too
	if err := logged.shutdown(); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(log.String(), key) {
		t.Fatalf("the provider key %q (answer %d) is in the server's log:\n%s", key, r.status, log.String())
	}
	if !strings.Contains(log.String(), providerCallsPrefix+"{key}") {
		t.Fatalf("no request line for the provider's lookup in the log:\n%s", log.String())
	}
}
