package idemhttp

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// Traces: with Options.TracerProvider set, a keyed request makes a span idem.request (a child
// of the request's own span, when it has one), and under it three: idem.claim (until the
// claim's decision), idem.handler (the handler's run) and idem.complete (from the handler's
// answer until it is recorded and committed), each with the action, the key's hash (never the
// key) and, when it ends, its outcome (idem.request's is the request's state). A replay, a
// mismatch or a request in progress makes only idem.request and idem.claim. Without a
// provider nothing of this runs: no span, no attribute, no allocation.

// tracerName is the instrumentation scope of the spans.
const tracerName = "github.com/pgidem/pgidem/idem"

// The attributes of the spans.
const (
	attrAction  = attribute.Key("idem.action")
	attrKeyHash = attribute.Key("idem.key_hash")
	attrOutcome = attribute.Key("idem.outcome")
	attrStatus  = attribute.Key("http.response.status_code")
)

// startSpan starts a span of q's unit of work under ctx, or returns ctx and nil when tracing
// is off.
func (q *request) startSpan(ctx context.Context, name string) (context.Context, trace.Span) {
	if q.m.tracer == nil {
		return ctx, nil
	}
	return q.m.tracer.Start(ctx, name, trace.WithAttributes(attrAction.String(q.action), attrKeyHash.String(q.keyHash)))
}

// endSpan ends s (nil: tracing is off) with its outcome, and err as its error.
func endSpan(s trace.Span, outcome string, err error) {
	if s == nil {
		return
	}
	s.SetAttributes(attrOutcome.String(outcome))
	if err != nil {
		s.RecordError(err)
		s.SetStatus(codes.Error, outcome)
	}
	s.End()
}

// endHandlerSpan ends the handler's span with the status it answered.
func endHandlerSpan(s trace.Span, rec *recorder, v verdict) {
	if s == nil {
		return
	}
	outcome := [...]string{commit: "commit", final: "final", rollBack: "roll_back"}[v]
	if rec != nil {
		s.SetAttributes(attrStatus.Int(rec.code()))
	}
	endSpan(s, outcome, nil)
}
