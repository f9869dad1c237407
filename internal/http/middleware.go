package idemhttp

import (
	"cmp"
	"fmt"
	"io"
	"math"
	"net/http"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel/trace"

	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/dbidem"
)

// Middleware makes declared routes idempotent. Build one with New and wrap routes with
// Route, or declare them with Declare and install Handler on the router.
type Middleware struct {
	o        Options
	gate     *dbidem.Gate
	declared map[string]Route // "METHOD template"
	// wildcards: a declared template holds a variable ({id}); unmatched: Handler has warned
	// that such a template cannot match without Options.RouteTemplate (D272)
	wildcards bool
	unmatched atomic.Bool
	tracer    trace.Tracer // nil: tracing off
	work      *workTracker // the keyed requests in flight, for Shutdown
	watches   *watches     // the duplicates of lease requests waiting for answers
	typical   typicals     // how long lease work takes here, per action (Retry-After)
	// leaseSlots bound the statements of lease work outside its claim (extensions, the
	// recording of answers, yields, the duplicates' looks) running at once: as many as
	// MaxWaitingClaims or half the pool, whichever is more (D229).
	leaseSlots leaseSlots
}

// defaultMiddleware writes problems outside a declared route.
var defaultMiddleware = func() *Middleware {
	var o Options
	o.defaults()
	return &Middleware{o: o}
}()

// New checks the options against their bounds (the SQL API's own for durations) and fills in
// their defaults.
func New(o Options) (*Middleware, error) {
	if err := o.check(); err != nil {
		return nil, err
	}
	o.defaults()
	waiting := o.MaxWaitingClaims
	if waiting == 0 {
		waiting = max(1, int(o.DB.Config().MaxConns)/4)
	}
	gate := dbidem.NewGate(dbidem.GateOptions{MaxWaitingClaims: waiting, MaxWaitingBytes: o.MaxWaitingBytes})
	m := &Middleware{o: o, gate: gate, declared: map[string]Route{}, work: newWorkTracker(), watches: newWatches(),
		leaseSlots: newLeaseSlots(waiting, o.DB.Config().MaxConns)}
	if o.TracerProvider != nil {
		m.tracer = safeTracer{Tracer: o.TracerProvider.Tracer(tracerName), log: o.Logger, once: new(sync.Once)}
	}
	return m, nil
}

// Options returns the options in effect, defaults filled in (a zero TTL or LockTimeout
// stays zero: the SQL API's default applies).
func (m *Middleware) Options() Options { return m.o }

// Route returns a middleware for one route with this declaration, a plain
// func(http.Handler) http.Handler for net/http's ServeMux, gorilla/mux or any router:
//
//	mux.Handle("POST /v1/transfers", m.Route(idemhttp.Route{Required: true})(transfers))
//	r.Handle("/v1/transfers", m.Route(idemhttp.Route{Required: true})(transfers)).Methods("POST")
//
// It panics on a declaration that cannot work (a lease under a second).
func (m *Middleware) Route(rt Route) func(http.Handler) http.Handler {
	rt.check()
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { m.serve(w, r, rt, next) })
	}
}

// Declare declares the route with this method and path template for Handler. Not safe to
// call once requests are being served.
func (m *Middleware) Declare(method, pathTemplate string, rt Route) {
	checkDeclared(method, pathTemplate)
	rt.check()
	m.declared[declaredKey(method, pathTemplate)] = rt
	m.wildcards = m.wildcards || strings.Contains(pathTemplate, "{")
}

// declaredKey is the key of a declared route: the method in upper case (net/http passes a
// request's method as sent, "post" too) and the template with each variable's pattern left out
// ("/accounts/{id:[0-9]+}" is "/accounts/{id}"), so that a declaration matches the route
// whichever of the two spellings the router's template and the declaration use.
func declaredKey(method, template string) string {
	if strings.Contains(template, ":") {
		var b strings.Builder
		depth, skip := 0, false
		for i := 0; i < len(template); i++ {
			switch c := template[i]; {
			case c == '{':
				depth++
			case c == '}' && depth > 0:
				depth--
				if depth == 0 {
					skip = false
				}
			case c == ':' && depth == 1:
				skip = true
				continue
			}
			if !skip {
				b.WriteByte(template[i])
			}
		}
		template = b.String()
	}
	return strings.ToUpper(method) + " " + template
}

// Declared returns the routes declared with Declare, by "METHOD template".
func (m *Middleware) Declared() map[string]Route {
	out := make(map[string]Route, len(m.declared))
	for k, v := range m.declared {
		out[k] = v
	}
	return out
}

// Handler is a router-wide middleware (gorilla/mux's r.Use(m.Handler)): requests to routes
// declared with Declare take part; all others pass through untouched, header or not. It
// needs a router that matches the route before it runs its middlewares, as gorilla/mux does;
// with net/http's ServeMux, which matches as it dispatches, wrap each route with Route.
func (m *Middleware) Handler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		template, routed := m.routeTemplate(r)
		if rt, ok := m.declared[declaredKey(r.Method, template)]; ok {
			m.serve(w, r, rt, next)
			return
		}
		if m.wildcards && !routed && !m.unmatched.Load() && m.declaredMatch(r.Method, r.URL.Path) && !m.unmatched.Swap(true) {
			// The template is the URL path, which a declared {variable} never matches: every
			// such route would pass through without a key's protection, silently.
			// The path has the shape of a declared template (declaredMatch), so this is most
			// likely a declared route's request. An Options.RouteTemplate that returns "" for
			// it: Handler wraps the router instead of being one of its middlewares
			// (gorilla/mux's r.Use), so no route was matched yet.
			msg := "idem: Handler sees a request without a route template: Options.RouteTemplate is not set, " +
				"so the template is the URL path, and a declared template with a {variable} never matches it " +
				"(those routes pass through without idempotency); with gorilla/mux set Options.RouteTemplate " +
				"to idemmux.RouteTemplate; with net/http's ServeMux wrap each route with Route"
			if m.o.RouteTemplate != nil {
				msg = `idem: Handler sees a request without a route template: Options.RouteTemplate returned "" ` +
					"for a path that a declared template with a {variable} would match, so the template is the URL path, " +
					"which never matches it, and the request passes through without idempotency: install Handler as one " +
					"of the router's middlewares (gorilla/mux's r.Use), which runs after the router matched the route"
			}
			m.o.Logger.Warn(msg, "method", r.Method)
		}
		next.ServeHTTP(w, r)
	})
}

// declaredMatch tells whether path is one a declared template of method with a {variable}
// would match, segment by segment (a variable matches any one segment, a {name...} the rest):
// a request that Handler let pass only because no router gave it a template. A request to a
// route that is not declared (an OPTIONS route, a path of its own) is not one, and is no
// reason to warn.
func (m *Middleware) declaredMatch(method, path string) bool {
	prefix := strings.ToUpper(method) + " "
	for k := range m.declared {
		if t, ok := strings.CutPrefix(k, prefix); ok && strings.Contains(t, "{") && templateMatches(t, path) {
			return true
		}
	}
	return false
}

// templateMatches tells whether path has the shape of template (see declaredMatch).
func templateMatches(template, path string) bool {
	ts, ps := strings.Split(template, "/"), strings.Split(path, "/")
	for i, t := range ts {
		if strings.HasPrefix(t, "{") && strings.HasSuffix(t, "...}") {
			return i < len(ps)
		}
		if i >= len(ps) {
			return false
		}
		if !strings.Contains(t, "{") && t != ps[i] {
			return false
		}
	}
	return len(ts) == len(ps)
}

// template is the route template of r: Options.RouteTemplate's answer, else the pattern
// net/http's ServeMux matched (Go 1.22 patterns, without their method and host), else the URL
// path.
func (m *Middleware) template(r *http.Request) string {
	t, _ := m.routeTemplate(r)
	return t
}

// routeTemplate is template's answer, and whether a router gave it (Options.RouteTemplate, or
// the pattern ServeMux matched) rather than the URL path standing in for one.
func (m *Middleware) routeTemplate(r *http.Request) (string, bool) {
	if m.o.RouteTemplate != nil {
		if t := m.o.RouteTemplate(r); t != "" {
			return t, true
		}
	}
	return DefaultRouteTemplate(r), r.Pattern != ""
}

// DefaultRouteTemplate is the route template of a request when Options.RouteTemplate gives
// none: the path of the pattern that net/http's ServeMux matched (Request.Pattern, Go 1.22+,
// its method and host left out: "POST /v1/accounts/{id}/deposits" gives
// "/v1/accounts/{id}/deposits"), else the request's URL path. Another router's template
// (gorilla/mux's current route) comes through Options.RouteTemplate.
func DefaultRouteTemplate(r *http.Request) string {
	if p := r.Pattern; p != "" {
		if i := strings.IndexByte(p, '/'); i >= 0 {
			return p[i:]
		}
	}
	return r.URL.Path
}

// defaultAction is the action of a route that names none: the method and the route template.
// Where the route leaves them to the client (a route that takes any method, a template that
// is the URL path), the action is still one the SQL API stores and a metric label of bounded
// variety: a method outside RFC 9110's nine is "OTHER", bytes that are not UTF-8 and U+0000
// (which PostgreSQL's text holds neither of) are U+FFFD,
// and the whole is cut to MaxActionLength characters. The request's fingerprint still covers
// its exact method and path, so two such requests under one key remain a mismatch.
func defaultAction(method, template string) string {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete,
		http.MethodConnect, http.MethodOptions, http.MethodTrace:
	default:
		method = "OTHER"
	}
	a := method + " " + storableText(template)
	if utf8.RuneCountInString(a) > MaxActionLength {
		a = string([]rune(a)[:MaxActionLength])
	}
	return a
}

// request is one request to a declared route on its way through the middleware.
type request struct {
	m         *Middleware
	w         http.ResponseWriter
	r         *http.Request
	rt        Route
	next      http.Handler
	body      []byte
	canonical []byte // the canonical body (strictly valid JSON), when the fingerprint computed it
	// claimed: a run of the request's unit of work claimed the key (serve's count of an
	// aborted handler).
	claimed atomic.Bool
	// rawHashed: the body, declared as another type than JSON, was hashed as its bytes; the
	// releases before D178 hashed its canonical form when it was strictly valid JSON.
	rawHashed bool
	// earlierTakeover: this request took a lease over under the fingerprint of a release
	// before D178 (earlierReleaseDecision); only a 2xx of its handler is stored (lease).
	earlierTakeover bool
	action          string
	keyHash         string     // the key's hash, for traces (keyed requests with tracing on)
	noKey           bool       // a request without a key (unkeyed): its answers do not speak of one
	claim           *ClaimInfo // the claim the handler works under (keyed requests)
	// changed: a lease route's duplicate that its wait saw the key change (the holder's
	// answer stored, or the key free again): its next claim reads that answer or claims a free
	// key, in moments, and Shutdown's start does not end it (D270).
	changed bool
	// providerKey is the provider key of a request without a key on a lease route.
	providerKey string
	// shutDown: Shutdown's deadline ended the request's claim under way, and it was refused
	// as one that came after it (counted in no state).
	shutDown bool
}

func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, rt Route, next http.Handler) {
	if r.Context().Value(stateKey{}) != nil {
		// The request comes from a middleware's handler context already (Handler on a router
		// and on its subrouter, or Handler and Route on one route): the outer one claimed the
		// key, and an inner claim would only wait for it and store its 409 as the answer.
		next.ServeHTTP(w, r)
		return
	}
	// The body is what the client sent, whatever the principal function does with it: it may
	// read it (a form's access_token, RFC 6750 section 2.2, through r.FormValue), put it back
	// (a webhook's signature check), wrap it (http.MaxBytesReader) or peek at it. Every byte
	// read from the connection's body passes through tee and is kept there, with the first
	// read error, which a form parse swallows (D178). tee goes into a copy of the request:
	// net/http's own keeps its body, whose type tells the server what to do with a body the
	// answer leaves unread (an Expect: 100-continue request refused before its body is never
	// sent 100 Continue, and its answer goes out at once; with any other body the server read
	// it, or waited for it forever, before it sent the answer).
	tee := &bodyTee{src: r.Body, max: m.o.MaxBodyBytes}
	if r.Body != nil && r.Body != http.NoBody {
		own, shallow := r, *r
		shallow.Body = tee
		r = &shallow
		defer func() {
			// A multipart form the principal function parsed is net/http's to remove, with
			// its temporary files, once the request is done: it does so through its own request.
			if shallow.MultipartForm != nil && own.MultipartForm == nil {
				own.MultipartForm = shallow.MultipartForm
			}
		}()
	}
	q := &request{m: m, w: w, r: r, rt: rt, next: next, action: rt.Action}
	if q.action == "" {
		q.action = defaultAction(r.Method, m.template(r))
	}
	key, present, valid := parseKey(r.Header.Values(m.o.KeyHeader))
	var leave func()
	if present || rt.Lease > 0 {
		// Shutdown waits for a request that carries a key, and for every request to a lease
		// route (its work outlives its client), from here on: its principal function (which
		// may read a slow body, or look a token up), its body, its fingerprint and its claim
		// or its work; one received and not yet counted could claim and run after Shutdown
		// returned nil (D160, D179).
		leave = m.work.enter()
		defer leave()
	}
	var principal string
	var authenticated bool
	if !m.guarded(w, r, "the principal function", func() { principal, authenticated = m.o.Principal(r) }) {
		return
	}
	keyed := authenticated && present
	if leave != nil && !keyed && rt.Lease == 0 {
		// Not authenticated: its key is ignored, and it runs on the request's context as a
		// request without a key does, which Shutdown neither ends nor waits for.
		leave()
	}
	switch {
	case keyed && !valid && len(r.Header.Values(m.o.KeyHeader)) > 1:
		m.problem(w, r, CodeKeyInvalid, fmt.Sprintf("the request carries %d %s headers; send one", len(r.Header.Values(m.o.KeyHeader)), m.o.KeyHeader),
			func(p *Problem) { p.Header = m.o.KeyHeader })
		return
	case keyed && !valid:
		m.problem(w, r, CodeKeyInvalid, m.o.KeyHeader+" must be 1 to 255 visible ASCII characters, as a bare value or a quoted string",
			func(p *Problem) { p.Header = m.o.KeyHeader })
		return
	case authenticated && !present && rt.Required:
		m.problem(w, r, CodeKeyMissing, "this request needs an "+m.o.KeyHeader+" header",
			func(p *Problem) { p.Header = m.o.KeyHeader })
		return
	case r.ContentLength > m.o.MaxBodyBytes:
		m.tooLarge(w, r)
		return
	}
	var err error
	if tee.src != nil && tee.src != http.NoBody {
		if r.Body != tee {
			// A body the principal function put back: read to its end, for what it still
			// reads through tee (a wrapper, a reader that ends with the rest).
			_, err = io.Copy(io.Discard, io.LimitReader(r.Body, tee.room()+1))
		}
		if err == nil {
			_, err = io.Copy(io.Discard, io.LimitReader(tee, tee.room()+1))
		}
		err = cmp.Or(tee.err, err)
	}
	if err != nil {
		code, detail := bodyProblem(err)
		if !keyed {
			detail = withoutKey(detail)
		}
		m.problem(w, r, code, detail, nil)
		return
	}
	body := tee.got
	if int64(len(body)) > m.o.MaxBodyBytes {
		m.tooLarge(w, r)
		return
	}
	if keyed && len(body) == 0 && (len(r.PostForm) > 0 || r.MultipartForm != nil) {
		// A handler before the middleware parsed the request's form, which read its body: the
		// handler would act on a form that no fingerprint covers (D178).
		m.problem(w, r, CodeMisconfigured, "the request's body was read before the idempotency middleware (its form was parsed): "+
			"it cannot be fingerprinted; a server configuration problem, nothing was changed", nil)
		return
	}
	q.body = body
	if !keyed {
		q.unkeyed()
		return
	}
	// The request's time in the histogram runs from here, its body read: how long the client
	// took to upload it is the client's, not the store's or the handler's.
	start := time.Now()
	var fp canon.Fingerprint
	var bodyJSON bool
	var ambiguous string
	asJSON := SentAsJSON(r)
	if rt.Fingerprint != nil {
		if !m.guarded(w, r, "the route's fingerprint function", func() { fp = rt.Fingerprint(r, body) }) {
			return
		}
		// What the route hashed (often a part of the body, or not JSON at all) says nothing
		// of whether the body is strictly valid JSON: the body is judged on its own, as the
		// default fingerprint judges it.
		ambiguous = fp.Ambiguous
		if len(body) > 0 && asJSON { // a body of another type is its handler's (D178)
			if c, a, err := canon.CanonicalizeAmbiguous(body); err == nil {
				bodyJSON, q.canonical = true, c
				if ambiguous == "" {
					ambiguous = a
				}
			}
		}
	} else if len(body) > 0 && !asJSON {
		// Declared as another type than JSON: its handler reads the bytes, so the bytes are
		// hashed, whatever they hold, and left to the handler (D178). DecodeJSON answers 415.
		fp = canon.ComputeRaw(r.Method, r.URL.EscapedPath(), body)
		q.rawHashed = true
	} else {
		// The canonical text from the same parse: DecodeJSON decodes it (what was hashed).
		fp, q.canonical = canon.ComputeCanonical(r.Method, r.URL.EscapedPath(), body)
		bodyJSON, ambiguous = fp.JSON, fp.Ambiguous
	}
	switch {
	case ambiguous != "":
		// Refused before any claim: a handler could not be sure to act on what was hashed.
		m.problem(w, r, CodeMalformedBody, "the body is ambiguous: "+ambiguous, nil)
		return
	case !bodyJSON && len(body) > 0 && asJSON:
		// Sent as JSON (or without a Content-Type, which DecodeJSON takes as JSON) but not
		// strictly valid JSON (duplicate members, data after the value, invalid UTF-8...): no
		// handler may act on it, so nothing is claimed or stored.
		m.problem(w, r, CodeMalformedBody, notStrictJSON, nil)
		return
	}
	claim := dbidem.Claim{Principal: principal, Key: key, Action: q.action, Fingerprint: fp.Sum, Fields: fp.Fields,
		TTL: m.o.TTL, Lease: rt.Lease, LockTimeout: m.o.LockTimeout}
	if m.tracer != nil {
		q.keyHash = KeyHash(principal, key)
	}
	working, ok := m.work.begin()
	if !ok {
		// Shutdown's deadline has passed: work that starts now would be ended at once. Nothing
		// is claimed; the client's retry goes to another process. Not a failure of the store:
		// counted in no state.
		w.Header().Set("Retry-After", "1")
		m.problem(w, r, CodeShuttingDown, "this server is shutting down; nothing was changed; retry with the same key", nil)
		m.o.Logger.Info("idem: keyed request refused, shutting down", "action", q.action,
			"request_id", r.Header.Get(m.o.CorrelationHeader))
		return
	}
	defer working()
	ctx, span := q.startSpan(r.Context(), "idem.request")
	timed := false // Done was called, or the request is counted in no state
	defer func() {
		if p := recover(); p != nil {
			if !timed && q.claimed.Load() {
				// The handler aborted the response (http.ErrAbortHandler, which net/http
				// handles quietly) after the claim: its unit of work rolled back, as for any
				// panic, and the request is timed as such.
				endSpan(span, string(StateAcquired), nil)
				m.o.Metrics.Done(StateAcquired, time.Since(start))
			}
			panic(p)
		}
	}()
	st := q.keyed(ctx, claim)
	timed = true
	if q.shutDown {
		// Shutdown's deadline ended its claim under way: refused as above.
		endSpan(span, "shutdown", nil)
		m.o.Logger.Info("idem: keyed request refused, shutting down", "action", q.action,
			"request_id", r.Header.Get(m.o.CorrelationHeader))
		return
	}
	if st == "" {
		endSpan(span, CodePrincipalUnknown, nil)
		m.o.Logger.Info("idem", "state", CodePrincipalUnknown, "action", q.action, "key_hash", KeyHash(principal, key),
			"request_id", r.Header.Get(m.o.CorrelationHeader))
		return
	}
	endSpan(span, string(st), nil)
	m.o.Metrics.Done(st, time.Since(start))
	if st != StateAcquired && st != StateReplayed {
		m.o.Logger.Info("idem", "state", string(st), "action", q.action, "key_hash", KeyHash(principal, key),
			"request_id", r.Header.Get(m.o.CorrelationHeader))
	}
}

func (m *Middleware) tooLarge(w http.ResponseWriter, r *http.Request) {
	m.problem(w, r, CodeRequestTooLarge, fmt.Sprintf("the request body is larger than %d bytes", m.o.MaxBodyBytes), nil)
}

// bodyTee is a request's body as the middleware reads it: it keeps every byte read through it,
// up to one byte past max (enough to tell a body over max), and the first read error other
// than io.EOF (a body cut off before its Content-Length: net/http reports it once, and a plain
// io.EOF after it).
type bodyTee struct {
	src io.ReadCloser
	max int64
	got []byte
	err error
}

func (b *bodyTee) Read(p []byte) (int, error) {
	n, err := b.src.Read(p)
	if keep := b.room() + 1; keep > 0 {
		b.got = append(b.got, p[:min(int64(n), keep)]...)
	}
	if err != nil && err != io.EOF && b.err == nil {
		b.err = err
	}
	return n, err
}

// room is how many bytes more the body may have: max less what was kept (one more tells a
// body over max; math.MaxInt64 has no byte more).
func (b *bodyTee) room() int64 { return min(b.max, math.MaxInt64-1) - int64(len(b.got)) }

func (b *bodyTee) Close() error { return b.src.Close() }

// SentAsJSON tells whether r's body is sent as JSON: a JSON Content-Type, or none, which
// DecodeJSON takes as JSON. Any other body is its handler's to read as it is (D178), and the
// default fingerprint hashes its bytes (canon.ComputeRaw).
func SentAsJSON(r *http.Request) bool {
	return jsonContent(r) || r.Header.Get("Content-Type") == ""
}

// guarded runs f, the application's code that the middleware calls before any claim (the
// principal function, a route's fingerprint), and answers a panic in it as a handler's panic is
// answered: 500 internal_error, the panic and its stack logged. It reports whether f returned.
// Nothing was claimed, so nothing is held; http.ErrAbortHandler goes on up, as from a handler.
func (m *Middleware) guarded(w http.ResponseWriter, r *http.Request, what string, f func()) (returned bool) {
	defer func() {
		if returned {
			return
		}
		p := recover()
		switch p {
		case nil:
			return // runtime.Goexit: it goes on
		case http.ErrAbortHandler:
			panic(p)
		}
		m.o.Logger.Error("idem: "+what+" panicked; nothing was claimed", "panic", fmt.Sprint(p), "stack", string(debug.Stack()),
			"request_id", r.Header.Get(m.o.CorrelationHeader))
		m.problem(w, r, CodeInternalError, "the request failed; nothing was changed; retrying with the same key is safe", nil)
	}()
	f()
	return true
}
