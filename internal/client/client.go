// Package client is a Go client that retries safely: the other half of idempotency.
//
// Client works for any HTTP API that takes an Idempotency-Key. Every logical operation gets
// one key, generated before the first attempt (or given by the caller) and kept across every
// retry of it, with the same body. An attempt is retried, with jittered exponential backoff,
// when its outcome is unknown or temporary: a network error or timeout, a 5xx (but 501 and
// 505, and 500 idempotency_misconfigured), 408, 425, 429, or 409 request_in_progress (honouring
// Retry-After, in seconds or as a date, up to a minute), at most MaxAttempts times (10 by
// default). A final answer (any other 4xx, 501, 505, 500 idempotency_misconfigured, or a
// 2xx) ends the operation: retrying it would get the same answer; so does an error no retry
// can mend (a request net/http refuses to send, a certificate the client does not trust, a
// redirect CheckRedirect refuses). The context bounds the whole operation, the reading of
// the request's body and the retries included: give it a deadline.
//
//	req, _ := http.NewRequest("POST", "https://api.example.com/v1/charges", strings.NewReader(`{"amount":100}`))
//	req.Header.Set("Content-Type", "application/json")
//	res, err := (&client.Client{}).Do(ctx, req, "") // "": a new key for this operation
//	// res.Status is the first execution's answer, res.Replayed tells whether this answer
//	// was a replay of it (a lost response retried).
//
// Ledger is a thin client for the reference ledger API on top of it.
package client

import (
	"bufio"
	"bytes"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"context"
	crand "crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pgidem/pgidem/internal/httpsyntax"
)

// Client sends logical operations to any HTTP API that takes an idempotency key, and retries
// them safely. The zero value is ready to use; its fields may be changed before first use; a
// Client is safe for concurrent use.
type Client struct {
	// HTTP sends the requests. Default http.DefaultClient.
	HTTP *http.Client
	// KeyHeader is the request header that carries the key. Default "Idempotency-Key".
	KeyHeader string
	// AttemptTimeout bounds one attempt (0: none beyond the operation's context). A client
	// that gives up on an attempt does not know its outcome, and retries with the same key.
	AttemptTimeout time.Duration
	// MaxAttempts bounds the attempts of one operation. 0: DefaultMaxAttempts (10); a
	// negative value: no bound, until the context ends.
	MaxAttempts int
	// Backoff is the first retry's wait; each retry doubles it, up to MaxBackoff, and waits
	// a random duration between half of it and all of it. Default 50ms.
	Backoff time.Duration
	// MaxBackoff caps the client's own backoff. Default 2s. A server's Retry-After is
	// honoured as sent (seconds or an HTTP date), up to a minute, even when it is longer.
	MaxBackoff time.Duration
	// ReplayedHeader is the response header whose value "true" (in any case) marks a replay
	// (Result.Replayed). Default "Idempotent-Replayed", the reference server's and the
	// middleware's default (its Options.ReplayHeader).
	ReplayedHeader string
	// MaxResponseBytes bounds the response body read into Result.Body. Default 0:
	// DefaultMaxResponseBytes; a negative value: no bound. A longer body ends the operation
	// with ErrResponseTooLarge.
	MaxResponseBytes int64
}

// DefaultMaxResponseBytes is the bound on a response body when Client.MaxResponseBytes is 0.
const DefaultMaxResponseBytes = 64 << 20

// ErrResponseTooLarge is returned when an answer's body is longer than Client.MaxResponseBytes:
// the operation ends with the answer's status and headers, its body unread.
var ErrResponseTooLarge = errors.New("idemclient: the response body is longer than MaxResponseBytes")

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

// Code is the problem code of an error answer: its body's member named exactly "code" ("" for
// a success, or a body that is not a JSON object with a string member so named). A body sent
// with Content-Encoding gzip or deflate (net/http leaves it so when the caller set
// Accept-Encoding itself) is read decompressed, up to DefaultMaxResponseBytes.
func (r Result) Code() string {
	code, _ := r.problemCode()
	return code
}

// problemCode is Code, and whether the body could be read: false for a Content-Encoding other
// than gzip, deflate or identity (several codings included), a compressed body that does not
// decompress, or one that decompresses to more than DefaultMaxResponseBytes.
func (r Result) problemCode() (string, bool) {
	if r.Status >= 200 && r.Status < 300 {
		return "", true // a success: a "code" member there is the API's own
	}
	enc := strings.ToLower(strings.TrimSpace(r.Header.Get("Content-Encoding")))
	switch enc {
	case "", "identity":
		return codeMember(bytes.NewReader(r.Body)), true
	case "gzip", "x-gzip":
		zr, err := gzip.NewReader(bytes.NewReader(r.Body))
		if err != nil {
			return "", false
		}
		return inflatedCode(zr)
	case "deflate":
		// RFC 9110's deflate is zlib's format; some servers send raw DEFLATE under the name
		// (which may even start with bytes that read as a zlib header).
		if zr, err := zlib.NewReader(bytes.NewReader(r.Body)); err == nil {
			if code, ok := inflatedCode(zr); ok {
				return code, true
			}
		}
		return inflatedCode(flate.NewReader(bytes.NewReader(r.Body)))
	}
	return "", false
}

// inflatedCode is codeMember of what zr decompresses, up to DefaultMaxResponseBytes, and whether
// all of it decompressed within that bound; zr is closed.
func inflatedCode(zr io.ReadCloser) (string, bool) {
	defer zr.Close()
	lr := &io.LimitedReader{R: zr, N: DefaultMaxResponseBytes + 1}
	code := codeMember(lr)
	if lr.N == 0 {
		return "", false // more than the bound: not read
	}
	// What codeMember left unread must decompress too (a damaged stream is not a body).
	if _, err := io.Copy(io.Discard, lr); err != nil || lr.N == 0 {
		return "", false
	}
	return code, true
}

// codeMember is the string member named exactly "code" of the JSON object that is all of r (the
// last one, if the name is there twice), or "": decoded as a stream, so that a large member
// beside it costs no more than itself.
func codeMember(r io.Reader) string {
	br := bufio.NewReader(r)
	if bom, err := br.Peek(3); err == nil && string(bom) == "\xef\xbb\xbf" {
		_, _ = br.Discard(3) // a byte order mark, which RFC 8259 lets a parser ignore
	}
	dec := json.NewDecoder(br)
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return ""
	}
	code := ""
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return ""
		}
		if name, _ := t.(string); name == "code" {
			v, err := dec.Token()
			if err != nil {
				return ""
			}
			switch v := v.(type) {
			case string:
				code = v
			case json.Delim: // an object or array: not a code
				code = ""
				if err := skipRest(dec); err != nil {
					return ""
				}
			default:
				code = ""
			}
			continue
		}
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			return ""
		}
	}
	if t, err := dec.Token(); err != nil || t != json.Delim('}') {
		return ""
	}
	if _, err := dec.Token(); err != io.EOF {
		return "" // something after the object: not a JSON text
	}
	return code
}

// skipRest reads the rest of the object or array whose opening delimiter dec has just read.
func skipRest(dec *json.Decoder) error {
	for depth := 1; depth > 0; {
		t, err := dec.Token()
		if err != nil {
			return err
		}
		if d, ok := t.(json.Delim); ok {
			if d == '{' || d == '[' {
				depth++
			} else {
				depth--
			}
		}
	}
	return nil
}

// ErrGaveUp is returned when an operation ran out of attempts (MaxAttempts) with an outcome
// still unknown; the last attempt's error or answer is wrapped.
var ErrGaveUp = errors.New("idemclient: gave up")

// DefaultMaxAttempts is the attempts of one operation when Client.MaxAttempts is 0: with the
// default backoff (50ms doubling to 2s, each wait between half of it and all of it) about 7
// seconds of waiting, at most 9.15, longer when the server asks for it with Retry-After.
const DefaultMaxAttempts = 10

// The state of NewKey: the millisecond of the last key and its counter, so that keys made by
// this process are strictly increasing.
var (
	keyMu    sync.Mutex
	keyMS    int64
	keyCount uint16
)

// NewKey returns a new idempotency key: a UUID of version 7 (RFC 9562): a 48-bit Unix
// timestamp in milliseconds, the version, a 12-bit counter (method 1 of RFC 9562, section
// 6.2: it starts at a random value below 2048 each millisecond and counts up within it; past
// 4095 the key borrows the next millisecond), the variant and 62 random bits. The keys of
// one process are strictly increasing, as bytes and as strings; keys made close together
// sort close together, so a principal's new keys land in one index leaf of the key table's
// primary key (principal_id, key) instead of random ones.
func NewKey() string {
	var b [16]byte
	_, _ = crand.Read(b[:])
	keyMu.Lock()
	ms := time.Now().UnixMilli()
	if ms > keyMS {
		keyMS, keyCount = ms, binary.BigEndian.Uint16(b[6:8])&0x07ff
	} else { // the same millisecond, or the clock went back: count on
		keyCount++
		if keyCount > 0x0fff {
			keyMS, keyCount = keyMS+1, 0
		}
	}
	ms, count := keyMS, keyCount
	keyMu.Unlock()
	b[0], b[1], b[2], b[3], b[4], b[5] = byte(ms>>40), byte(ms>>32), byte(ms>>24), byte(ms>>16), byte(ms>>8), byte(ms)
	b[6], b[7] = 0x70|byte(count>>8), byte(count)
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// Do sends req as one logical operation under key, and retries it until its answer is final,
// the context ends or MaxAttempts runs out. Every attempt carries the same key and the same
// body: req's body is read once (or taken from req.GetBody) and sent again as it was. An empty
// key means the key req already carries in the key header, or else a new one (NewKey) for
// this operation; Result.Key tells which. ctx, not req's context, bounds the operation. The
// response body is read whole into Result.Body, up to MaxResponseBytes.
func (c *Client) Do(ctx context.Context, req *http.Request, key string) (Result, error) {
	if key == "" {
		if v := c.keyValues(req.Header); len(v) > 1 {
			closeBody(req)
			// No key is the operation's: which value came first depends on the header map's
			// order (two spellings of the name are two entries), so Result.Key names none.
			return Result{}, fmt.Errorf("idemclient: the request carries %d %s headers; an operation has one key", len(v), c.keyHeader())
		} else if len(v) == 1 {
			key = v[0]
		}
	}
	if key == "" {
		key = NewKey()
	}
	if err := c.checkRequest(req, key); err != nil {
		closeBody(req)
		return Result{Key: key}, err
	}
	if err := ctx.Err(); err != nil {
		closeBody(req)
		return Result{Key: key}, err // nothing was sent, nothing was read
	}
	var payload []byte
	if req.Body != nil && req.Body != http.NoBody {
		body := req.Body
		if req.GetBody != nil {
			req.Body.Close() // what is sent comes from GetBody; net/http closes the body too
			var err error
			if body, err = getBody(ctx, req.GetBody); err != nil {
				return Result{Key: key}, err
			}
		}
		var err error
		if payload, err = readBody(ctx, body); err != nil {
			if req.GetBody == nil {
				// Part of the body may be read, and an abandoned read may go on: a later Do
				// would send what is left of it under this key, another request. Nothing was
				// sent; the request must be built again.
				req.Body = spentBody{}
				req.GetBody = func() (io.ReadCloser, error) { return spentBody{}, nil }
			}
			return Result{Key: key}, err
		}
		if req.GetBody == nil {
			// The body is read: req can be sent again (a later Do under Result.Key, when this
			// one gave up) with the same bytes.
			req.Body = io.NopCloser(bytes.NewReader(payload))
			req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(payload)), nil }
			req.ContentLength = int64(len(payload))
		}
	}
	if err := ctx.Err(); err != nil {
		return Result{Key: key}, err // nothing was sent
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
	attempt := 0
	unreadable := 0 // 409s in a row whose body Code could not read
	for try := 1; ; try++ {
		r, sent, wrote, err := c.once(ctx, req, key, payload)
		attempt += sent
		wait := jitter(doubled(backoff, try-1, maxBackoff))
		switch {
		case err == nil && !retryable(r, c.replayedHeader()):
			r.Attempts, r.Key = attempt, key
			return r, nil
		case err == nil:
			if ra := retryAfter(r.Header, time.Now()); ra > 0 {
				wait = ra
			}
			res = r
			res.Attempts, res.Key = attempt, key
			if _, read := r.problemCode(); r.Status == http.StatusConflict && !read {
				// Retried in case it is request_in_progress; a server that answers it every
				// time is not this middleware (its stored 409 comes back replayed, final):
				// DefaultMaxAttempts of them in a row end the operation whatever MaxAttempts.
				if unreadable++; unreadable >= DefaultMaxAttempts {
					return res, fmt.Errorf("%w after %d answers 409 in an encoding Do cannot read (%q): last answer 409",
						ErrGaveUp, unreadable, r.Header.Get("Content-Encoding"))
				}
			} else {
				unreadable = 0
			}
		default:
			// No answer this time: the result holds none (not an earlier attempt's), but the
			// status and headers of a redirect that CheckRedirect refused.
			res = r
			res.Attempts, res.Key = attempt, key
			if ctx.Err() != nil {
				return res, ctx.Err()
			}
			if errors.Is(err, ErrResponseTooLarge) {
				return res, err // the server answered: a retry would get the same answer
			}
			if permanent(err, wrote) {
				return res, fmt.Errorf("idemclient: %w", err) // no retry can mend it
			}
		}
		if max := c.maxAttempts(); max > 0 && attempt >= max {
			n := fmt.Sprintf("%d attempts", attempt)
			if attempt == 1 {
				n = "1 attempt"
			}
			if err != nil {
				return res, fmt.Errorf("%w after %s: %w", ErrGaveUp, n, err)
			}
			return res, fmt.Errorf("%w after %s: last answer %d", ErrGaveUp, n, res.Status)
		}
		select {
		case <-ctx.Done():
			return res, ctx.Err()
		case <-time.After(wait):
		}
	}
}

// doubled is backoff doubled n times, at most maxBackoff (no overflow, whatever the two are).
func doubled(backoff time.Duration, n int, maxBackoff time.Duration) time.Duration {
	d := backoff
	for ; n > 0 && d < maxBackoff; n-- {
		if d > maxBackoff/2 {
			return maxBackoff
		}
		d *= 2
	}
	return min(d, maxBackoff)
}

// closeBody closes req's body, as net/http does with a request it will not send.
func closeBody(req *http.Request) {
	if req.Body != nil {
		req.Body.Close()
	}
}

// getBody calls getBody (a request's GetBody) within ctx: one that blocks is abandoned when ctx
// ends, and the body it returns later is closed.
func getBody(ctx context.Context, getBody func() (io.ReadCloser, error)) (io.ReadCloser, error) {
	type got struct {
		body io.ReadCloser
		err  error
	}
	done := make(chan got, 1)
	panicked := make(chan any, 1)
	go func() {
		returned := false
		defer func() { handOn(panicked, recover(), returned) }()
		b, err := getBody()
		returned = true
		done <- got{b, err}
	}()
	select {
	case g := <-done:
		if g.err != nil {
			return nil, fmt.Errorf("idemclient: read body: %w", g.err)
		}
		if g.body == nil {
			// Called only for a req.Body that is not empty: net/http refuses such a request
			// too ("with nil Body"). Nothing was sent.
			return nil, errNilGetBody
		}
		return g.body, nil
	case p := <-panicked:
		panic(p)
	case <-ctx.Done():
		go func() {
			defer func() { _ = recover() }() // a Close that panics: the caller has left, nobody to hand it to
			select {
			case g := <-done:
				if g.body != nil {
					g.body.Close()
				}
			case <-panicked: // the caller has left: nobody to hand it to
			}
		}()
		return nil, ctx.Err() // nothing was sent
	}
}

// errNilGetBody is Do's error when req.GetBody returns neither a body nor an error for a
// request whose Body is not empty.
var errNilGetBody = errors.New("idemclient: read body: req.GetBody returned a nil body and no error for a request with a body")

// readBody reads body whole and closes it. The read stops when ctx ends: the body is closed
// (which ends a read blocked on a pipe or on a server request's body) and ctx's error is
// returned; the read's goroutine ends when the read does.
func readBody(ctx context.Context, body io.ReadCloser) ([]byte, error) {
	type read struct {
		b   []byte
		err error
	}
	done := make(chan read, 1)
	panicked := make(chan any, 1)
	go func() {
		returned := false
		defer func() { handOn(panicked, recover(), returned) }()
		b, err := io.ReadAll(body)
		returned = true
		done <- read{b, err}
	}()
	select {
	case r := <-done:
		body.Close()
		if r.err != nil {
			return nil, fmt.Errorf("idemclient: read body: %w", r.err)
		}
		return r.b, nil
	case p := <-panicked:
		body.Close()
		panic(p)
	case <-ctx.Done():
		body.Close()
		return nil, ctx.Err() // nothing was sent
	}
}

// handOn, deferred in a goroutine that runs the caller's code (GetBody, the body's Read), hands
// p, a panic of that code, to the caller, which raises it again on its own goroutine: a panic
// on the goroutine itself would end the process, out of the caller's reach. A goroutine that
// neither returned nor panicked called runtime.Goexit, which is handed on as a panic too
// (nothing else would ever answer the caller).
func handOn(panicked chan<- any, p any, returned bool) {
	switch {
	case p != nil:
		panicked <- p
	case !returned:
		panicked <- errors.New("idemclient: the request's body (GetBody or Read) called runtime.Goexit")
	}
}

// connectionHas tells whether h's Connection header lists token (in any case).
func connectionHas(h http.Header, token string) bool {
	for _, v := range h.Values("Connection") {
		for _, t := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(t), token) {
				return true
			}
		}
	}
	return false
}

// spentBody is the body Do leaves on a request whose body it could not read whole: every read
// fails, so no later Do sends what is left of it.
type spentBody struct{}

func (spentBody) Read([]byte) (int, error) { return 0, errBodySpent }
func (spentBody) Close() error             { return nil }

var errBodySpent = errors.New("idemclient: the request's body was partly read by a Do that ended before it had all of it " +
	"(nothing was sent); build the request again, with its whole body, to retry under the same key")

func (c *Client) maxAttempts() int {
	if c.MaxAttempts == 0 {
		return DefaultMaxAttempts
	}
	return c.MaxAttempts
}

// checkRequest refuses, before anything is sent, a request that net/http would refuse at every
// attempt: a protocol upgrade, a ContentLength above 0 without a body, a URL that is not http or https or has no
// host or a port out of range, a method
// or header or trailer name that is not a token, a header or trailer value with a control
// character (a tab aside), a RequestURI (a server's request, handed on as it came); and a key
// that no header may carry. The outcome of such an operation is known: nothing was sent. A
// nil Header is taken as an empty one.
func (c *Client) checkRequest(req *http.Request, key string) error {
	if !httpsyntax.IsToken(c.keyHeader()) {
		return fmt.Errorf("idemclient: Client.KeyHeader %q is not a header name", c.keyHeader())
	}
	for _, name := range keylessHeaders {
		if strings.EqualFold(name, c.keyHeader()) {
			// net/http writes these itself (Host, Content-Length, Transfer-Encoding, Trailer:
			// the request's own fields, not req.Header's), or they belong to one connection,
			// which a proxy drops and HTTP/2 refuses, or net/http drops them on a redirect to
			// another host: an attempt would not carry the key.
			return fmt.Errorf("idemclient: Client.KeyHeader %q is a header that net/http writes itself, that belongs to one connection, "+
				"or that it drops on a redirect to another host: an attempt would not carry the key; name another, such as Idempotency-Key", c.keyHeader())
		}
	}
	if req.Header.Get("Upgrade") != "" || connectionHas(req.Header, "upgrade") {
		// A 101 would hand the connection over, an answer Do cannot read or retry.
		return errors.New("idemclient: the request asks for a protocol upgrade (Upgrade, Connection: upgrade), which is not an operation Do sends")
	}
	if (req.Body == nil || req.Body == http.NoBody) && req.ContentLength > 0 {
		return fmt.Errorf("idemclient: the request's ContentLength is %d and it has no body, which net/http refuses to send", req.ContentLength)
	}
	if req.RequestURI != "" {
		return errors.New("idemclient: the request's RequestURI is set (a server's request): clear it, as net/http sends no request that has one")
	}
	for name, values := range req.Trailer {
		if !httpsyntax.IsToken(name) {
			return fmt.Errorf("idemclient: the trailer name %q is not an HTTP token", name)
		}
		for _, v := range values {
			if !httpsyntax.ValidFieldValue(v) {
				return fmt.Errorf("idemclient: the value of trailer %s has a control character", name)
			}
		}
	}
	if req.URL == nil {
		return errors.New("idemclient: the request has no URL")
	}
	if problem := urlProblem(req.URL); problem != "" {
		return fmt.Errorf("idemclient: the URL %q %s", req.URL.Redacted(), problem)
	}
	if strings.ContainsFunc(req.URL.RequestURI(), isCTL) {
		return fmt.Errorf("idemclient: the URL %q has a control character, which net/http refuses to send", req.URL.RequestURI())
	}
	if req.Method != "" && !httpsyntax.IsToken(req.Method) {
		return fmt.Errorf("idemclient: the method %q is not an HTTP token", req.Method)
	}
	for name, values := range req.Header {
		if !httpsyntax.IsToken(name) {
			return fmt.Errorf("idemclient: the header name %q is not an HTTP token", name)
		}
		for _, v := range values {
			if !httpsyntax.ValidFieldValue(v) {
				return fmt.Errorf("idemclient: the value of header %s has a control character", name)
			}
		}
	}
	if !httpsyntax.ValidFieldValue(key) {
		return fmt.Errorf("idemclient: the key %q has a control character, which no header may carry", key)
	}
	if strings.Trim(key, " \t") != key {
		// HTTP drops the whitespace around a field's value: the server would get another key
		// than Result.Key ("abc" for " abc "), or an empty one for a blank key.
		return fmt.Errorf("idemclient: the key %q begins or ends with a space or tab, which HTTP drops from a header's value: "+
			"the server would get another key", key)
	}
	return nil
}

// keylessHeaders are the header names no key can travel in (Client.KeyHeader): those net/http
// writes itself, those of one connection, and those it drops on a redirect to another host
// (a 307 or 308 that carries the operation on) or changes (a Jar rewrites Cookie, HTTP/2 splits
// it at each ';').
var keylessHeaders = []string{"Host", "Content-Length", "Transfer-Encoding", "Trailer", "Connection", "Keep-Alive",
	"Proxy-Connection", "TE", "Upgrade", "Proxy-Authorization", "Proxy-Authenticate",
	"Authorization", "Www-Authenticate", "Cookie", "Cookie2"}

// firstTrip counts the times the transport wrote an attempt's request (not the requests of
// the redirects it follows): net/http writes a request again on its own when a kept-alive
// connection closes before any answer, if the request carries an Idempotency-Key. A write
// counts when the request is written to the connection's buffer: one whose flush then fails
// (the connection found closed with nothing sent) counts too, so the count may be one more
// than the requests the server saw, never fewer.
//
// It also keeps the last answer when it was a redirect, until the transport is asked for the
// next request: an error of net/http with no request sent after that answer is net/http's
// own, about the redirect (a Location it cannot parse), and the server has answered. A
// redirect to a URL that is not http or https is refused here, as an answer no retry mends,
// before the transport reports it as a failed request.
type firstTrip struct {
	rt       http.RoundTripper
	started  atomic.Bool
	wrote    atomic.Int32
	redirect atomic.Pointer[http.Response]
	// replayedHeader is the header that marks a replay; replayed: an answer of this attempt
	// (the request's, or a redirect's on the way) carried it as "true".
	replayedHeader string
	replayed       atomic.Bool
}

func (f *firstTrip) RoundTrip(req *http.Request) (*http.Response, error) {
	if f.started.CompareAndSwap(false, true) {
		req = req.WithContext(httptrace.WithClientTrace(req.Context(),
			&httptrace.ClientTrace{WroteRequest: func(httptrace.WroteRequestInfo) { f.wrote.Add(1) }}))
	} else if err := followable(req.URL); err != nil {
		return nil, err
	}
	f.redirect.Store(nil)
	resp, err := f.rt.RoundTrip(req)
	if err == nil && resp.StatusCode >= 300 && resp.StatusCode < 400 && resp.Header.Get("Location") != "" {
		f.redirect.Store(resp)
	}
	if err == nil && marked(resp.Header, f.replayedHeader) {
		f.replayed.Store(true)
	}
	return resp, err
}

// marked tells whether an answer's header carries the replay mark: replayedHeader "true", in
// any case.
func marked(h http.Header, replayedHeader string) bool {
	return strings.EqualFold(strings.TrimSpace(h.Get(replayedHeader)), "true")
}

// followable refuses a redirect's URL that no attempt could follow (urlProblem): net/http
// would report it as a failed request, a network error.
func followable(u *url.URL) error {
	if problem := urlProblem(u); problem != "" {
		return fmt.Errorf("a redirect to %q, which %s, cannot be followed", u.Redacted(), problem)
	}
	return nil
}

// urlProblem says why no request can be sent to u ("is not http or https", "has no host", "has
// a port that is not 1 to 65535"), or "" when one can: the same rule for an operation's URL
// (checkRequest) and for a redirect's (followable).
func urlProblem(u *url.URL) string {
	if u.Scheme != "http" && u.Scheme != "https" {
		return "is not http or https"
	}
	if u.Host == "" {
		return "has no host"
	}
	if p := u.Port(); p != "" {
		if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
			return "has a port that is not 1 to 65535"
		}
	}
	return ""
}

// isCTL tells whether r is an ASCII control character (net/http refuses them in a request's URL).
func isCTL(r rune) bool { return r < 0x20 || r == 0x7f }

// keyValues is every value of the key header in h, under any spelling of its name (a caller
// may have set the map entry directly, not in Go's canonical form).
func (c *Client) keyValues(h http.Header) []string {
	var v []string
	for name, values := range h {
		if strings.EqualFold(name, c.keyHeader()) {
			v = append(v, values...)
		}
	}
	return v
}

func (c *Client) keyHeader() string {
	if c.KeyHeader == "" {
		return "Idempotency-Key"
	}
	return c.KeyHeader
}

// redirectRefused is an error of the HTTP client's CheckRedirect (too many redirects, or a
// redirect its policy refuses), or of a redirect net/http cannot follow (a Location it cannot
// parse, a URL that is not http or https): the server answered, with a redirect not followed.
type redirectRefused struct{ err error }

func (e *redirectRefused) Error() string { return e.err.Error() }
func (e *redirectRefused) Unwrap() error { return e.err }

// permanent tells whether a transport error is one that every retry would meet again: a
// certificate the client does not trust, TLS spoken to a server that does not speak it
// (which net/http reports as ErrSchemeMismatch, or crypto/tls as a bad record header) before
// the request was written, or a redirect not followed (the server answered it). Network
// errors, timeouts and lost answers are not: their outcome is unknown. Nor are bytes that are
// not TLS on a connection that carried the request (wrote): the handshake succeeded, so the
// server speaks TLS, and what came back was damaged on the way (a middlebox, a front end that
// crashed writing plain text); the request may have taken effect and a retry mends it.
func permanent(err error, wrote bool) bool {
	var redirect *redirectRefused
	if errors.As(err, &redirect) {
		return true
	}
	var verify *tls.CertificateVerificationError
	var unknownAuthority x509.UnknownAuthorityError
	var hostname x509.HostnameError
	var invalid x509.CertificateInvalidError
	if errors.As(err, &verify) || errors.As(err, &unknownAuthority) || errors.As(err, &hostname) || errors.As(err, &invalid) {
		return true
	}
	var record tls.RecordHeaderError
	return !wrote && (errors.Is(err, http.ErrSchemeMismatch) || errors.As(err, &record) || http2Refused(err))
}

// http2Refused tells whether err is net/http's HTTP/2 transport refusing, before it wrote
// anything, a request it refuses on every try: a Connection header other than close or
// keep-alive, a Transfer-Encoding other than chunked (fields HTTP/1 sends or drops), or
// headers larger than the server said it takes. Its errors have no type of their own: they
// are told by their text.
func http2Refused(err error) bool {
	msg := err.Error()
	return strings.Contains(msg, "http2: invalid ") || strings.Contains(msg, "http2: request header list larger than")
}

// tooLarge is ErrResponseTooLarge for resp, whose body is longer than limit.
func tooLarge(resp *http.Response, limit int64) error {
	return fmt.Errorf("%w (%d bytes); the answer's status is %d, and Do does not retry an answer", ErrResponseTooLarge, limit, resp.StatusCode)
}

// errSwitchedProtocols is an attempt's error when the server answered 101 Switching Protocols
// (net/http hands the connection over as the body, and no longer ends it with the request's
// context): no answer, its outcome unknown.
var errSwitchedProtocols = errors.New("the server answered 101 Switching Protocols to a request that is not an upgrade: no answer, its outcome is unknown")

// once sends one attempt. sent is how many requests it took: 1, or more when net/http wrote
// the request again on its own (it does so for a request that carries an Idempotency-Key when
// a kept-alive connection closes before any answer). wrote tells whether the request was
// written at all.
func (c *Client) once(ctx context.Context, orig *http.Request, key string, payload []byte) (r Result, sent int, wrote bool, err error) {
	if c.AttemptTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.AttemptTimeout)
		defer cancel()
	}
	counted := &firstTrip{}
	defer func() {
		sent = max(1, int(counted.wrote.Load()))
		wrote = counted.wrote.Load() > 0
	}()
	req := orig.Clone(ctx)
	if req.Header == nil {
		req.Header = make(http.Header, 1)
	}
	req.Body, req.GetBody, req.ContentLength = http.NoBody, nil, 0
	if payload != nil {
		req.Body = io.NopCloser(bytes.NewReader(payload))
		req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(payload)), nil }
		req.ContentLength = int64(len(payload))
		if len(req.Trailer) > 0 {
			req.ContentLength = -1 // chunked: trailers go after the last chunk, never with a Content-Length
		}
	}
	for name := range req.Header { // one key header on the wire, whatever spellings req had
		if strings.EqualFold(name, c.keyHeader()) {
			delete(req.Header, name)
		}
	}
	req.Header.Set(c.keyHeader(), key)
	hc := http.Client{}
	if c.HTTP != nil {
		hc = *c.HTTP
	}
	counted.rt = hc.Transport
	if counted.rt == nil {
		counted.rt = http.DefaultTransport
	}
	counted.replayedHeader = c.replayedHeader()
	hc.Transport = counted
	hc.CheckRedirect = c.checkRedirect(hc.CheckRedirect)
	resp, err := hc.Do(req)
	if err != nil {
		if resp != nil { // net/http: only when CheckRedirect refused a redirect (its body is closed)
			return Result{Status: resp.StatusCode, Header: resp.Header, Replayed: counted.replayed.Load()}, 0, false, &redirectRefused{err}
		}
		if last := counted.redirect.Load(); last != nil && ctx.Err() == nil {
			return Result{Status: last.StatusCode, Header: last.Header, Replayed: counted.replayed.Load()}, 0, false, &redirectRefused{err}
		}
		return Result{}, 0, false, err
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusSwitchingProtocols {
		return Result{}, 0, false, errSwitchedProtocols // the deferred Close closes the connection
	}
	limit := c.MaxResponseBytes
	if limit == 0 {
		limit = DefaultMaxResponseBytes
	}
	head := resp.Request != nil && resp.Request.Method == http.MethodHead // a HEAD's Content-Length is the GET's
	if limit > 0 && resp.ContentLength > limit && !head {
		return Result{Status: resp.StatusCode, Header: resp.Header, Replayed: counted.replayed.Load()}, 0, false, tooLarge(resp, limit)
	}
	body := io.Reader(resp.Body)
	if limit > 0 && limit < math.MaxInt64 {
		body = io.LimitReader(resp.Body, limit+1)
	}
	b, err := io.ReadAll(body)
	if err != nil {
		return Result{}, 0, false, err // the answer was lost on the way: its outcome is unknown
	}
	if limit > 0 && int64(len(b)) > limit {
		return Result{Status: resp.StatusCode, Header: resp.Header, Replayed: counted.replayed.Load()}, 0, false, tooLarge(resp, limit)
	}
	return Result{Status: resp.StatusCode, Header: resp.Header, Body: b, Replayed: counted.replayed.Load()}, 0, false, nil
}

// replayedHeader is ReplayedHeader or its default.
func (c *Client) replayedHeader() string {
	if c.ReplayedHeader == "" {
		return "Idempotent-Replayed"
	}
	return c.ReplayedHeader
}

// checkRedirect wraps next, the HTTP client's CheckRedirect (nil: net/http's default, ten
// redirects): a redirect that turns the request into another one (a POST that 301, 302 or
// 303 makes a GET without its body) is followed without the key, which names the operation,
// not the GET; one that sends the same request again (307, 308) keeps it, with the body.
func (c *Client) checkRedirect(next func(*http.Request, []*http.Request) error) func(*http.Request, []*http.Request) error {
	return func(req *http.Request, via []*http.Request) error {
		first := via[0].Method
		if first == "" {
			first = http.MethodGet // net/http's reading of an empty method
		}
		if req.Method != first {
			for name := range req.Header {
				if strings.EqualFold(name, c.keyHeader()) {
					delete(req.Header, name)
				}
			}
		} else if len(via[0].Trailer) > 0 && req.Trailer == nil && req.Body != nil && req.Body != http.NoBody {
			// The same request again (307, 308): net/http builds it without the trailers.
			req.Trailer = via[0].Trailer.Clone()
			req.ContentLength = -1
		}
		if next != nil {
			return next(req, via)
		}
		if len(via) >= 10 {
			return errors.New("stopped after 10 redirects") // net/http's default, as it words it
		}
		return nil
	}
}

// Ledger is a client for the reference ledger API (cmd/server): one server, one bearer token,
// JSON bodies, on top of Client.
type Ledger struct {
	// BaseURL is the server, for example http://127.0.0.1:8080.
	BaseURL string
	// Token is the bearer token.
	Token string
	// Client retries the operations; its fields set timeouts, attempts and backoff.
	Client
}

// NewLedger returns a Ledger for baseURL with the default settings.
func NewLedger(baseURL, token string) *Ledger {
	return &Ledger{BaseURL: strings.TrimRight(baseURL, "/"), Token: token}
}

// Post sends one logical operation: a POST of body (JSON-encoded) to path, under a new key.
func (l *Ledger) Post(ctx context.Context, path string, body any) (Result, error) {
	return l.Send(ctx, http.MethodPost, path, NewKey(), body)
}

// Send sends one logical operation under key (every attempt carries it) and retries it until
// its answer is final (Client.Do). body is JSON-encoded; nil sends none. An empty key sends a
// new one.
func (l *Ledger) Send(ctx context.Context, method, path, key string, body any) (Result, error) {
	var payload io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return Result{}, fmt.Errorf("idemclient: encode body: %w", err)
		}
		payload = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, l.BaseURL+path, payload)
	if err != nil {
		return Result{}, err
	}
	req.Header.Set("Authorization", "Bearer "+l.Token)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	return l.Client.Do(ctx, req, key)
}

// retryable tells whether an answer leaves the operation's outcome open: 5xx (but 501 Not
// Implemented, 505 HTTP Version Not Supported and 500 idempotency_misconfigured, which no
// retry changes: the server's configuration refuses the request), 408, 425, 429, or 409
// request_in_progress, or a 409 whose body Code cannot read (a Content-Encoding it does not
// decode, which a caller's own Accept-Encoding may bring): it may be request_in_progress, and
// if it is the handler's own 409, the retry gets it replayed, final. Every other answer is
// final, and so is every replay: a stored answer comes back the same to every retry, whatever
// its status (a handler's own 409 request_in_progress, stored as its answer, was retried until
// ErrGaveUp). A replay is the answer itself marked so (replayedHeader), not a redirect on the
// way to it: a replayed 303 or 307 leads to a request of its own, whose 503 leaves the outcome
// open as any other does (Result.Replayed, which counts the redirect, took that 503 for final).
func retryable(r Result, replayedHeader string) bool {
	switch {
	case marked(r.Header, replayedHeader):
		return false
	case r.Status == http.StatusNotImplemented, r.Status == http.StatusHTTPVersionNotSupported:
		return false
	case r.Status == http.StatusInternalServerError && r.Code() == "idempotency_misconfigured":
		return false
	case r.Status >= 500 && r.Status <= 599, r.Status == http.StatusRequestTimeout, r.Status == http.StatusTooManyRequests,
		r.Status == http.StatusTooEarly: // RFC 8470: the request may be sent again
		return true
	case r.Status == http.StatusConflict:
		code, read := r.problemCode()
		return code == "request_in_progress" || !read
	}
	return false
}

// maxRetryAfter bounds the wait a server's Retry-After can ask for.
const maxRetryAfter = time.Minute

// retryAfter reads Retry-After, in seconds or as an HTTP date (RFC 9110), as a wait from now,
// at most maxRetryAfter (0 when absent, unreadable or past).
func retryAfter(h http.Header, now time.Time) time.Duration {
	v := strings.TrimSpace(h.Get("Retry-After"))
	if v == "" {
		return 0
	}
	if s, err := strconv.ParseInt(v, 10, 64); err == nil {
		if s <= 0 {
			return 0
		}
		return time.Duration(min(s, int64(maxRetryAfter/time.Second))) * time.Second
	} else if errors.Is(err, strconv.ErrRange) && v[0] != '-' {
		return maxRetryAfter // more seconds than an int64 holds: the longest wait
	}
	if t, err := http.ParseTime(v); err == nil && t.After(now) {
		return min(t.Sub(now), maxRetryAfter)
	}
	return 0
}

// jitter waits between half of d and d.
func jitter(d time.Duration) time.Duration {
	if d <= 1 {
		return d
	}
	return d/2 + time.Duration(rand.Int64N(int64(d/2)+1))
}
