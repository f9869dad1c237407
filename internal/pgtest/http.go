package pgtest

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
)

// noRedirects answers with the first response, so a test sees a 3xx as it was sent.
var noRedirects = &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}

// Send is the tests' one HTTP helper: it sends one request with the headers given as name,
// value pairs (a pair with an empty value is left out; a name given twice is sent twice),
// follows no redirect, and returns the status, the headers and the body. A failure to send
// or read gives status -1 and the error as the body, so that a test can tell it apart.
func Send(t testing.TB, ctx context.Context, method, url, body string, headers ...string) (int, http.Header, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		if headers[i+1] != "" {
			req.Header.Add(headers[i], headers[i+1])
		}
	}
	res, err := noRedirects.Do(req)
	if err != nil {
		return -1, nil, err.Error()
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		return -1, res.Header, err.Error()
	}
	return res.StatusCode, res.Header, string(b)
}
