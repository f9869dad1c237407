// Package idemclient is the other half of idempotency: an HTTP client that retries requests
// safely against any API that takes an Idempotency-Key.
//
// Every logical operation gets one key, made before the first attempt (or given by the
// caller), and every retry of it carries that key and the same body. It retries, with jittered
// exponential backoff, when the outcome is unknown or temporary: a network error or timeout, a
// 5xx (but 501 and 505), 408, 429, or 409 request_in_progress, honouring Retry-After (seconds
// or a date, up to a minute). A final answer (a 2xx, any other 4xx, 501, 505) ends the
// operation: retrying it would get the same answer; so does an error no retry mends (a URL
// that is not http or https, an untrusted certificate, TLS to a plain server). The context
// bounds the whole operation: give it a deadline.
//
//	c := &idemclient.Client{AttemptTimeout: 5 * time.Second}
//	req, _ := http.NewRequest("POST", "https://api.example.com/v1/orders", strings.NewReader(`{"sku":"a1"}`))
//	req.Header.Set("Content-Type", "application/json")
//	res, err := c.Do(ctx, req, "") // "": a new key for this operation, in res.Key
//	if err != nil {
//		return err // the context ended with the outcome unknown: retry later under res.Key
//	}
//	fmt.Println(res.Status, res.Replayed) // 201 false; or 201 true when a lost answer was retried
//
// It has no dependency on the server side of this module (no pgx, no database driver).
package idemclient

import "github.com/pgidem/pgidem/internal/client"

// Client sends logical operations and retries them safely. The zero value is ready to use;
// every field documents its default. A Client is safe for concurrent use.
type Client = client.Client

// Result is the answer to an operation: the final status, headers and body, whether it was a
// replay of an earlier attempt's answer, how many attempts it took and the key it used.
type Result = client.Result

// ErrGaveUp is returned when an operation ran out of attempts (Client.MaxAttempts) with its
// outcome still unknown.
var ErrGaveUp = client.ErrGaveUp

// NewKey returns a new random idempotency key (a version 4 UUID).
func NewKey() string { return client.NewKey() }
