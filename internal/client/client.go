// Package client is a small Go client for the reference ledger API that retries safely:
// the other half of idempotency.
//
// Every logical operation (a deposit, a transfer) gets one Idempotency-Key, generated
// before the first attempt and kept across every retry of it. An attempt is retried, with
// jittered exponential backoff, when its outcome is unknown or temporary: a network error
// or timeout, a 5xx, 408, 429, or 409 request_in_progress (honouring Retry-After). A final
// answer (any other 4xx, or a 2xx) ends the operation: retrying it would get the same
// answer. The context bounds the whole operation, retries included.
//
//	c := client.New("http://127.0.0.1:8080", token)
//	res, err := c.Post(ctx, "/v1/transfers", map[string]any{"from": 1, "to": 2, "amount": 100})
//	// res.Status is the first execution's answer, res.Replayed tells whether this answer
//	// was a replay of it (a lost response retried).
package client

import (
	"bytes"
	"context"
	crand "crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Client sends operations to one server with one bearer token. Its fields may be changed
// before first use; a Client is safe for concurrent use.
type Client struct {
	// BaseURL is the server, for example http://127.0.0.1:8080.
	BaseURL string
	// Token is the bearer token.
	Token string
	// HTTP sends the requests. Default: a client with keep-alive connections.
	HTTP *http.Client
	// AttemptTimeout bounds one attempt (0: none beyond the operation's context). A client
	// that gives up on an attempt does not know its outcome, and retries with the same key.
	AttemptTimeout time.Duration
	// MaxAttempts bounds the attempts of one operation (0: until the context ends).
	MaxAttempts int
	// Backoff is the first retry's wait; each retry doubles it, up to MaxBackoff, and waits
	// a random duration between half of it and all of it. Default 50ms.
	Backoff time.Duration
	// MaxBackoff caps the wait between retries, Retry-After included. Default 2s.
	MaxBackoff time.Duration
}

// New returns a Client for baseURL with the default settings.
func New(baseURL, token string) *Client {
	return &Client{BaseURL: strings.TrimRight(baseURL, "/"), Token: token}
}

// Result is the answer to an operation.
type Result struct {
	// Status, Header and Body are the final answer's.
	Status int
	Header http.Header
	Body   []byte
	// Replayed is true when the answer was a replay of the first execution's (the server
	// sent Idempotent-Replayed: true): an earlier attempt had taken effect.
	Replayed bool
	// Attempts is how many requests the operation took.
	Attempts int
	// Key is the idempotency key the operation used.
	Key string
}

// JSON decodes the body into v.
func (r Result) JSON(v any) error { return json.Unmarshal(r.Body, v) }

// Code is the problem code of an error answer ("" for a success or a body without one).
func (r Result) Code() string {
	var p struct {
		Code string `json:"code"`
	}
	_ = json.Unmarshal(r.Body, &p)
	return p.Code
}

// ErrGaveUp is returned when an operation ran out of attempts (MaxAttempts) with an outcome
// still unknown; the last attempt's error or answer is wrapped.
var ErrGaveUp = errors.New("client: gave up")

// NewKey returns a random idempotency key (a UUID, version 4).
func NewKey() string {
	var b [16]byte
	_, _ = crand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// Post sends one logical operation: a POST of body (JSON-encoded) to path, under a new key.
func (c *Client) Post(ctx context.Context, path string, body any) (Result, error) {
	return c.Do(ctx, http.MethodPost, path, NewKey(), body)
}

// Do sends one logical operation under key (every attempt carries it) and retries it until
// its answer is final, the context ends or MaxAttempts runs out. body is JSON-encoded; nil
// sends none. An empty key sends no Idempotency-Key: the retries are then not safe for an
// operation that is not idempotent by itself, so such a Client should set MaxAttempts 1.
func (c *Client) Do(ctx context.Context, method, path, key string, body any) (Result, error) {
	var payload []byte
	if body != nil {
		var err error
		if payload, err = json.Marshal(body); err != nil {
			return Result{}, fmt.Errorf("client: encode body: %w", err)
		}
	}
	backoff := c.Backoff
	if backoff <= 0 {
		backoff = 50 * time.Millisecond
	}
	maxBackoff := c.MaxBackoff
	if maxBackoff <= 0 {
		maxBackoff = 2 * time.Second
	}
	res := Result{Key: key}
	for attempt := 1; ; attempt++ {
		res.Attempts = attempt
		r, err := c.once(ctx, method, path, key, payload)
		wait := jitter(backoff << min(attempt-1, 20))
		switch {
		case err == nil && !retryable(r):
			r.Attempts, r.Key = attempt, key
			return r, nil
		case err == nil:
			if ra := retryAfter(r.Header); ra > 0 {
				wait = ra
			}
			res = r
			res.Attempts, res.Key = attempt, key
		case ctx.Err() != nil:
			return res, ctx.Err()
		}
		if c.MaxAttempts > 0 && attempt >= c.MaxAttempts {
			if err != nil {
				return res, fmt.Errorf("%w after %d attempts: %w", ErrGaveUp, attempt, err)
			}
			return res, fmt.Errorf("%w after %d attempts: last answer %d", ErrGaveUp, attempt, res.Status)
		}
		select {
		case <-ctx.Done():
			return res, ctx.Err()
		case <-time.After(min(wait, maxBackoff)):
		}
	}
}

func (c *Client) once(ctx context.Context, method, path, key string, payload []byte) (Result, error) {
	if c.AttemptTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.AttemptTimeout)
		defer cancel()
	}
	var body io.Reader
	if payload != nil {
		body = bytes.NewReader(payload)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.BaseURL+path, body)
	if err != nil {
		return Result{}, err
	}
	req.Header.Set("Authorization", "Bearer "+c.Token)
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	if payload != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	hc := c.HTTP
	if hc == nil {
		hc = http.DefaultClient
	}
	resp, err := hc.Do(req)
	if err != nil {
		return Result{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return Result{}, err // the answer was lost on the way: its outcome is unknown
	}
	return Result{Status: resp.StatusCode, Header: resp.Header, Body: b,
		Replayed: resp.Header.Get("Idempotent-Replayed") == "true"}, nil
}

// retryable tells whether an answer leaves the operation's outcome open: 5xx, 408, 429, or
// 409 request_in_progress. Every other answer is final.
func retryable(r Result) bool {
	switch {
	case r.Status >= 500, r.Status == http.StatusRequestTimeout, r.Status == http.StatusTooManyRequests:
		return true
	case r.Status == http.StatusConflict:
		return r.Code() == "request_in_progress"
	}
	return false
}

// retryAfter reads Retry-After in seconds (0 when absent or not a number).
func retryAfter(h http.Header) time.Duration {
	s, err := strconv.Atoi(strings.TrimSpace(h.Get("Retry-After")))
	if err != nil || s < 0 {
		return 0
	}
	return time.Duration(s) * time.Second
}

// jitter waits between half of d and d.
func jitter(d time.Duration) time.Duration {
	if d <= 1 {
		return d
	}
	return d/2 + time.Duration(rand.Int64N(int64(d/2)+1))
}
