package idemhttp_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	idemhttp "github.com/pgidem/pgidem/internal/http"
)

// TestTraces: with a tracer provider, a keyed request that runs makes the spans idem.claim,
// idem.handler and idem.complete under idem.request, in one trace, each with the action, the
// key's hash (never the key) and its outcome; its replay makes idem.claim alone (outcome
// replay) under its idem.request.
func TestTraces(t *testing.T) {
	t.Parallel()
	recorder := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(recorder))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	a := newApp(t, func(o *idemhttp.Options) { o.TracerProvider = tp })

	if r := a.do("POST", "/transfers", "alice", "traced-key", `{"amount":3}`); r.status != 201 {
		t.Fatalf("%+v", r)
	}
	if r := a.do("POST", "/transfers", "alice", "traced-key", `{"amount":3}`); r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("%+v", r)
	}
	type span struct{ name, outcome, status string }
	var got []span
	traces := map[string]bool{}
	for _, s := range recorder.Ended() {
		attrs := map[attribute.Key]attribute.Value{}
		for _, kv := range s.Attributes() {
			attrs[kv.Key] = kv.Value
		}
		if attrs["idem.action"].AsString() != "POST /transfers" || len(attrs["idem.key_hash"].AsString()) == 0 ||
			strings.Contains(fmt.Sprint(s.Attributes()), "traced-key") {
			t.Errorf("span %s: attributes %v, want the action and the key's hash, never the key", s.Name(), s.Attributes())
		}
		got = append(got, span{s.Name(), attrs["idem.outcome"].AsString(), attrs["http.response.status_code"].String()})
		if len(got) <= 4 { // the first request's
			traces[s.SpanContext().TraceID().String()] = true
		}
	}
	want := []span{{"idem.claim", "claimed", ""}, {"idem.handler", "commit", "201"}, {"idem.complete", "completed", ""},
		{"idem.request", "acquired", ""}, {"idem.claim", "replay", ""}, {"idem.request", "replayed", ""}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("spans %v, want %v", got, want)
	}
	if len(traces) != 1 {
		t.Fatalf("the first request's spans are in %d traces, want one", len(traces))
	}
}

// BenchmarkKeyedRequestTracing times a keyed request through the middleware (a fresh key, the
// handler's insert, the completion) with tracing off and on; -benchmem shows what tracing
// allocates: with it off, nothing (TestTracingOffAllocatesNothing checks the calls alone).
func BenchmarkKeyedRequestTracing(b *testing.B) {
	for _, on := range []bool{false, true} {
		b.Run(fmt.Sprintf("tracing=%v", on), func(b *testing.B) {
			tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(tracetest.NewSpanRecorder()))
			a := newApp(b, func(o *idemhttp.Options) {
				if on {
					o.TracerProvider = tp
				}
			})
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				req, _ := http.NewRequest("POST", a.srv.URL+"/transfers", strings.NewReader(`{"amount":1}`))
				req.Header.Set("X-Principal", "alice")
				req.Header.Set("Idempotency-Key", fmt.Sprintf("bench-%d", i))
				res, err := http.DefaultClient.Do(req)
				if err != nil || res.StatusCode != 201 {
					b.Fatalf("%v %v", res, err)
				}
				res.Body.Close()
			}
		})
	}
}
