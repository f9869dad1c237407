package idemhttp

import (
	"context"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// safeTracer is the application's tracer with its panics recovered, for the same reason as its
// Logger's (safelog.Wrap): the middleware ends its spans inside its recoveries (a handler's
// panic, a lease given up), where a tracer's panic dropped the client's 500. A span whose start panics is not
// made (the work runs untraced); a panic in a span's method loses that call. The first panic
// is logged at error, as the public Observer's adapter logs its first.
type safeTracer struct {
	trace.Tracer
	log  *slog.Logger
	once *sync.Once
}

func (t safeTracer) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (sctx context.Context, s trace.Span) {
	defer func() {
		if v := recover(); v != nil {
			t.report("Start", v)
			sctx, s = ctx, nil
		}
	}()
	sctx, s = t.Tracer.Start(ctx, name, opts...)
	return sctx, safeSpan{Span: s, t: t}
}

func (t safeTracer) report(method string, v any) {
	t.once.Do(func() {
		t.log.Error("idem: the TracerProvider's tracer panicked; its panics are recovered, and only this first one is logged",
			"method", method, "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
	})
}

// safeSpan is a span of safeTracer: the methods the middleware calls recover.
type safeSpan struct {
	trace.Span
	t safeTracer
}

func (s safeSpan) recovered(method string) {
	if v := recover(); v != nil {
		s.t.report(method, v)
	}
}

func (s safeSpan) End(opts ...trace.SpanEndOption) {
	defer s.recovered("End")
	s.Span.End(opts...)
}

func (s safeSpan) SetAttributes(kv ...attribute.KeyValue) {
	defer s.recovered("SetAttributes")
	s.Span.SetAttributes(kv...)
}

func (s safeSpan) RecordError(err error, opts ...trace.EventOption) {
	defer s.recovered("RecordError")
	s.Span.RecordError(err, opts...)
}

func (s safeSpan) SetStatus(code codes.Code, description string) {
	defer s.recovered("SetStatus")
	s.Span.SetStatus(code, description)
}
