// Package safelog wraps the application's slog.Logger so that a handler that panics loses its
// record, not the library's work: the middleware logs from inside its own recoveries (a
// handler's panic, a lease given up), where a Logger that panicked took the 500 and the lease's
// release with it (D220), and the cleaner logs from its scheduler's goroutine, where a panic
// ends the process (D222).
package safelog

import (
	"context"
	"log/slog"
)

// handler is the application's slog handler with its panics recovered. A record whose handler
// panics is dropped.
type handler struct{ h slog.Handler }

// Wrap returns l with its handler's panics recovered (l itself when it is wrapped already).
func Wrap(l *slog.Logger) *slog.Logger {
	if _, ok := l.Handler().(handler); ok {
		return l
	}
	return slog.New(handler{l.Handler()})
}

func (s handler) Enabled(ctx context.Context, level slog.Level) (enabled bool) {
	defer func() {
		if recover() != nil {
			enabled = false
		}
	}()
	return s.h.Enabled(ctx, level)
}

func (s handler) Handle(ctx context.Context, r slog.Record) (err error) {
	defer func() {
		if recover() != nil {
			err = nil // dropped: nothing may stop the request's answer or its key's release
		}
	}()
	return s.h.Handle(ctx, r)
}

func (s handler) WithAttrs(attrs []slog.Attr) (h slog.Handler) {
	defer func() {
		if recover() != nil {
			h = s // the attributes are lost, the handler kept
		}
	}()
	return handler{s.h.WithAttrs(attrs)}
}

func (s handler) WithGroup(name string) (h slog.Handler) {
	defer func() {
		if recover() != nil {
			h = s
		}
	}()
	return handler{s.h.WithGroup(name)}
}
