// Package idemclient is the other half of idempotency: an HTTP client that retries requests
// safely against any API that takes an Idempotency-Key.
//
// Every logical operation gets one key, made before the first attempt (NewKey, a time-ordered
// UUIDv7, unless the caller gives one), and every retry of it carries that key and the same
// body. It retries, with jittered exponential backoff, when the outcome is unknown or
// temporary: a network error or timeout (a 101 Switching Protocols to a request that asked
// for no upgrade included: no answer), a 5xx (except 501, 505 and 500
// idempotency_misconfigured), 408, 425 (RFC 8470), 429, or 409 request_in_progress (or a 409
// whose body is in a Content-Encoding Code cannot read: the retry of a stored 409 gets it
// replayed, final; DefaultMaxAttempts of them in a row, not counting attempts that got no
// answer, end the operation with ErrGaveUp, whatever MaxAttempts), honouring Retry-After
// (seconds or a date, up to a minute), at most MaxAttempts times (10 by default). A final
// answer (every answer not retried above: a 2xx, a 3xx the HTTP client does not follow, any
// other 4xx, 501, 505, 500 idempotency_misconfigured, a status above 599, and any replay: an
// answer marked Idempotent-Replayed: true is stored, whatever its status; a replayed redirect
// is not the answer, the request it leads to answers for itself) ends the operation:
// retrying it would get the same answer; so does an error no retry mends (an untrusted
// certificate, TLS to a plain server before the request was written, a redirect that the HTTP
// client's CheckRedirect refuses, ten of them in a row by default, or one net/http cannot
// follow: a Location it cannot parse, a URL that is not http or https, has no host or a port
// out of range; the server answered),
// a request for a protocol upgrade (an Upgrade header, Connection: upgrade), and a request
// that net/http would refuse to send (a ContentLength above 0 without a body, a
// URL that is not http or https or has no host, a port out of range, a method
// or header or trailer name that is not a token, a control character in a header or trailer
// value, the URL or the key (a tab but in the URL, which HTTP allows in a header's value), a RequestURI: a server's request handed on as it came; two key
// headers; a key that begins or ends with a space or tab, which HTTP drops from a header's
// value, so that the server would get another key), which Do refuses before sending
// anything; a request that net/http's HTTP/2 transport refuses to send (a Connection header
// other than close or keep-alive, a Transfer-Encoding other than chunked, headers larger than
// the server takes) ends the operation at the try it refuses, of which nothing was sent. An answer whose body is longer than
// MaxResponseBytes (64 MiB by default) ends it too, with ErrResponseTooLarge: its body is not
// read whole. The HTTP client follows redirects: one that sends the request again (307, 308)
// carries the key and the body to the new URL (the same operation); one that turns it into a
// GET without the body (301, 302 and 303 after a POST) is followed without the key, which names
// the operation, not the GET. A 307 or 308 sends the request's trailers again too. A nil Header is sent as an empty one. The context
// bounds the whole operation, the reading of the request's body included: give it a deadline.
//
//	c := &idemclient.Client{AttemptTimeout: 5 * time.Second}
//	req, _ := http.NewRequest("POST", "https://api.example.com/v1/orders", strings.NewReader(`{"sku":"a1"}`))
//	req.Header.Set("Content-Type", "application/json")
//	res, err := c.Do(ctx, req, "") // "": a new key for this operation, in res.Key
//	if err != nil {
//		return err // the outcome is unknown (the context ended, or ErrGaveUp): retry later under res.Key
//	}
//	fmt.Println(res.Status, res.Replayed) // 201 false; or 201 true when a lost answer was retried
//
// To retry later an operation that gave up, call Do again with the same request and res.Key:
// Do leaves a request's body readable again once it has read it whole. One that ended while
// reading a body without GetBody (the context ended, or the body's Read failed) sent nothing
// (Attempts 0) and leaves a body that refuses every read: build the request again, with its
// whole body, rather than send what is left of it under the key.
//
// It has no dependency on the server side of this module (no pgx, no database driver).
package idemclient

import (
	"context"
	"encoding/json"
	"net/http"
	"time"

	"github.com/pgidem/pgidem/internal/client"
)

// Client sends logical operations and retries them safely. The zero value is ready to use;
// every field says its default; set them before the first use. A Client is safe for
// concurrent use.
type Client struct {
	// HTTP sends the requests. Default nil: http.DefaultClient.
	HTTP *http.Client
	// KeyHeader is the request header that carries the key. Default "Idempotency-Key"; a
	// header name (an RFC 9110 token) that a request's header can carry, or Do refuses every
	// request: not one net/http writes itself (Host, Content-Length, Transfer-Encoding,
	// Trailer), one of a single connection (Connection, Keep-Alive, TE, Upgrade and the like),
	// which proxies drop and HTTP/2 refuses, nor one it drops on a redirect to another host
	// (Authorization, Cookie and the like).
	KeyHeader string
	// AttemptTimeout bounds one attempt. Default 0: no bound beyond the operation's context.
	// A client that gives up on an attempt does not know its outcome, and retries with the
	// same key.
	AttemptTimeout time.Duration
	// MaxAttempts bounds the attempts of one operation; past them Do returns ErrGaveUp with
	// the last answer. Default 0: DefaultMaxAttempts (10). A negative value: no bound, until
	// the context ends. net/http itself writes a request that carries an Idempotency-Key once
	// more when a kept-alive connection closes before any answer; that counts as an attempt,
	// so one try of Do can take two of them (and the last try can go one past the bound).
	MaxAttempts int
	// Backoff is the first retry's wait; each retry doubles it, up to MaxBackoff, and waits a
	// random duration between half of it and all of it. Default 0: 50ms.
	Backoff time.Duration
	// MaxBackoff caps the client's own backoff. Default 0: 2s. A server's Retry-After is
	// honoured as sent (seconds or an HTTP date), up to a minute, even when it is longer; one
	// of more seconds than an int64 holds means the minute.
	MaxBackoff time.Duration
	// ReplayedHeader is the response header whose value "true" (in any case) marks a replay
	// (Result.Replayed). Default "": "Idempotent-Replayed", the default of this module's
	// middleware (idem.Options.ReplayHeader); set it for a server that names it otherwise.
	ReplayedHeader string
	// MaxResponseBytes bounds the response body Do reads into Result.Body (after net/http's
	// own decompression, when it asked for gzip). Default 0: DefaultMaxResponseBytes (64 MiB);
	// a negative value (or math.MaxInt64): no bound. An answer with a longer body (by its
	// Content-Length, except a HEAD's, or once one more byte has been read) ends the
	// operation with ErrResponseTooLarge, whatever its
	// status: Result holds the status and headers, no body, and Do does not retry (the server
	// answered; a 2xx took effect). Raise it for an API whose answers are larger.
	MaxResponseBytes int64
}

// DefaultMaxResponseBytes is the bound on a response body when Client.MaxResponseBytes is 0:
// 64 MiB, so that a server's answer (a misbehaving one's endless body) cannot take the
// process's memory.
const DefaultMaxResponseBytes = client.DefaultMaxResponseBytes

// ErrResponseTooLarge is returned when an answer's body is longer than Client.MaxResponseBytes.
// The operation ends at that answer, not retried: Result holds its status and headers.
var ErrResponseTooLarge = client.ErrResponseTooLarge

// DefaultMaxAttempts is the attempts of one operation when Client.MaxAttempts is 0: with the
// default backoff (50ms doubling to 2s, each wait between half of it and all of it) about 7
// seconds of waiting, at most 9.15, longer when the server asks for it with Retry-After.
const DefaultMaxAttempts = client.DefaultMaxAttempts

// Do sends req as one logical operation under key, and retries it until its answer is final,
// the context ends or MaxAttempts runs out (ErrGaveUp, with the last answer in the Result).
// Every attempt carries the same key and the same body: req's body is read once (from
// req.GetBody when it is set and req.Body is not nil, which then wins over req.Body, as on
// net/http's retries; req.Body is then closed unread; a nil req.Body is no body, whatever
// GetBody says, as net/http sends it), whole, into memory (bound a large one yourself), and sent again as it
// was, with its own length as Content-Length; a body without GetBody is left readable again
// (Do sets req.Body and req.GetBody to the bytes it read), so req can be given to a later Do
// under Result.Key. When Do ends before it has read such a body whole, nothing was sent and the
// body is left refusing every read (part of it is gone): build the request again. An empty key means the key req already carries in the key header (under
// any spelling of its name; one value, two are refused), or else a new one (NewKey) for this
// operation; a key given here replaces every key header req carries. Result.Key tells which.
// ctx, not req's context, bounds the operation, the body's reading included; a ctx that has
// ended already sends nothing (Attempts 0). A request refused before sending has its body
// closed, as net/http does. A panic of req.GetBody or of the body's Read is raised again on the
// caller's goroutine, where net/http raises GetBody's. A request with trailers (req.Trailer) is
// sent chunked, its trailers after the body, as net/http sends one of unknown length; their
// values are read when the body has been read, before the first attempt. The response body is read whole into
// Result.Body, up to MaxResponseBytes (ErrResponseTooLarge past it).
func (c *Client) Do(ctx context.Context, req *http.Request, key string) (Result, error) {
	r, err := (*client.Client)(c).Do(ctx, req, key)
	return Result(r), err
}

// Result is the answer to an operation.
type Result struct {
	// Status, Header and Body are the final answer's (the last attempt's, when the operation
	// gave up; zero when that attempt got no answer: a network error, a timeout). A redirect
	// that the HTTP client's CheckRedirect refused leaves its Status and Header (its Location),
	// and no Body (net/http closes it); so does an answer whose body is longer than
	// Client.MaxResponseBytes (ErrResponseTooLarge).
	Status int
	Header http.Header
	Body   []byte
	// Replayed is true when the answer was a replay of the first execution's (the server sent
	// Client.ReplayedHeader: true, on the answer or on a redirect that led to it, such as a
	// replayed 303 to the created resource): an earlier attempt had taken effect and its
	// answer was lost.
	Replayed bool
	// Attempts is how many requests the operation took: net/http's own second write of a
	// request counts (Client.MaxAttempts); the redirects it follows do not. A write that
	// net/http found had not gone out (a kept-alive connection closed under it, then a new
	// one) counts too: Attempts may be one more than the requests the server saw, never fewer.
	Attempts int
	// Key is the idempotency key the operation used: retry a failed operation later under it.
	// Empty only when Do refused a request that carried two keys (it chose neither).
	Key string
}

// JSON decodes the body into v.
func (r Result) JSON(v any) error { return json.Unmarshal(r.Body, v) }

// Code is the problem code of an error answer: the string member of its body's JSON object
// named exactly "code" (the last, if the name is there twice; "" for a success, a body that is
// not a JSON object, or one without such a member: "Code" is another name). A body compressed
// with gzip or deflate (zlib's format, or raw DEFLATE as some servers send it; net/http leaves
// it so when the caller set Accept-Encoding itself) is read decompressed, up to
// DefaultMaxResponseBytes; Do reads a larger one as it reads an encoding it does not know (a
// 409 it cannot read is retried, DefaultMaxAttempts in a row at most).
func (r Result) Code() string { return client.Result(r).Code() }

// ErrGaveUp is returned when an operation ran out of attempts (Client.MaxAttempts) with its
// outcome still unknown; the last attempt's error or answer is wrapped. When that attempt ran
// out of Client.AttemptTimeout, errors.Is(err, context.DeadlineExceeded) is true too, though
// the caller's context is still live: test ErrGaveUp first.
var ErrGaveUp = client.ErrGaveUp

// NewKey returns a new idempotency key: a UUID of version 7 (RFC 9562), a 48-bit Unix
// millisecond timestamp, a counter and random bits. The keys of a process are strictly
// increasing, so keys made close together sort close together: an API that stores them in a
// B-tree (this project's key table has the primary key (principal_id, key)) writes a client's
// new keys into one index leaf instead of a random one each (docs/http.md, "The key").
func NewKey() string { return client.NewKey() }
