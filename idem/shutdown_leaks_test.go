package idem_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestShutdownLeavesNoCountBehind: requests counted by Shutdown from their arrival that end in every early
// way (a panic in the principal function, in Route.Fingerprint, http.ErrAbortHandler in the
// handler, nested middleware, 400/413/415/422/428 refusals, two key headers) must all be
// uncounted afterwards: Shutdown then returns nil at once.
func TestShutdownLeavesNoCountBehind(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	type tc struct {
		name      string
		principal func(*http.Request) (string, bool)
		route     idem.Route
		handler   http.HandlerFunc
		nested    bool
		body      string
		keys      []string
	}
	ok201 := func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) }
	cases := []tc{
		{name: "principal_panics", principal: func(*http.Request) (string, bool) { panic("boom") }, keys: []string{"k1"}},
		{name: "principal_panics_lease", principal: func(*http.Request) (string, bool) { panic("boom") }, route: idem.Route{Lease: 2 * time.Second}},
		{name: "principal_abort", principal: func(*http.Request) (string, bool) { panic(http.ErrAbortHandler) }, keys: []string{"k1"}},
		{name: "fingerprint_panics", route: idem.Route{Fingerprint: func(*http.Request, []byte) idem.Fingerprint { panic("fp") }}, keys: []string{"k2"}},
		{name: "handler_abort_tx", handler: func(http.ResponseWriter, *http.Request) { panic(http.ErrAbortHandler) }, keys: []string{"k3"}},
		{name: "handler_abort_lease", route: idem.Route{Lease: 2 * time.Second}, handler: func(http.ResponseWriter, *http.Request) { panic(http.ErrAbortHandler) }, keys: []string{"k4"}},
		{name: "handler_abort_lease_nokey", route: idem.Route{Lease: 2 * time.Second}, handler: func(http.ResponseWriter, *http.Request) { panic(http.ErrAbortHandler) }},
		{name: "handler_panics_lease", route: idem.Route{Lease: 2 * time.Second}, handler: func(http.ResponseWriter, *http.Request) { panic("x") }, keys: []string{"k5"}},
		{name: "nested", nested: true, keys: []string{"k6"}},
		{name: "two_keys", keys: []string{"a", "b"}},
		{name: "invalid_key", keys: []string{"\x01"}},
		{name: "required_missing", route: idem.Route{Required: true}},
		{name: "too_large", body: strings.Repeat("x", 2<<20), keys: []string{"k7"}},
		{name: "malformed", body: `{"a":1,"a":2}`, keys: []string{"k8"}},
		{name: "not_json", body: `{`, keys: []string{"k9"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := c.principal
			if p == nil {
				p = bearerOK
			}
			m, err := idem.New(ctx, idem.Options{DB: pool, Principal: p})
			if err != nil {
				t.Fatal(err)
			}
			hf := c.handler
			if hf == nil {
				hf = ok201
			}
			c.route.Action = "POST /lk"
			var h http.Handler = m.Route(c.route)(hf)
			if c.nested {
				m.Declare("POST", "/lk", c.route)
				h = m.Handler(h)
			}
			body := c.body
			if body == "" {
				body = `{"a":1}`
			}
			req := httptest.NewRequest("POST", "/lk", strings.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Authorization", "Bearer ok")
			for _, k := range c.keys {
				req.Header.Add("Idempotency-Key", k)
			}
			w := httptest.NewRecorder()
			var rec any
			func() {
				defer func() { rec = recover() }()
				h.ServeHTTP(w, req)
			}()
			sctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
			defer cancel()
			start := time.Now()
			serr := m.Shutdown(sctx)
			t.Logf("answer %d, panic %v; Shutdown %v after %v", w.Code, rec, serr, time.Since(start).Round(time.Millisecond))
			if serr != nil {
				t.Errorf("Shutdown returned %v: the request's count leaked", serr)
			}
		})
	}
}

// TestManyShutdownsAtOnce: many Shutdowns at once (some with ended contexts, some long) while
// keyed requests run, under -race; none deadlocks, and once one deadline passed a new keyed
// request is refused.
func TestManyShutdownsAtOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: bearerOK})
	if err != nil {
		t.Fatal(err)
	}
	h := m.Route(idem.Route{Action: "POST /ms"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-time.After(20 * time.Millisecond):
		}
		w.WriteHeader(201)
	}))
	post := func(key string) int {
		req := httptest.NewRequest("POST", "/ms", strings.NewReader(`{}`))
		req.Header.Set("Authorization", "Bearer ok")
		req.Header.Set("Idempotency-Key", key)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		return w.Code
	}
	var wg sync.WaitGroup
	for i := 0; i < 100; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); post(fmt.Sprintf("ms-%d", i)) }()
	}
	errs := make(chan error, 40)
	for i := 0; i < 40; i++ {
		go func() {
			d := time.Duration(i%4) * 15 * time.Millisecond
			if i%10 == 9 {
				d = time.Hour
			}
			c, cancel := context.WithTimeout(ctx, d)
			defer cancel()
			errs <- m.Shutdown(c)
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("requests did not end")
	}
	for i := 0; i < 40; i++ {
		select {
		case <-errs:
		case <-time.After(20 * time.Second):
			t.Fatal("a Shutdown did not return")
		}
	}
	if c := post("ms-after"); c != 503 {
		t.Errorf("a keyed request after Shutdown's deadline got %d, want 503", c)
	}
}
