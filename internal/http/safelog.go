package idemhttp

import (
	"context"
	"log/slog"
)

// safeHandler is the application's slog handler with its panics recovered: the middleware
// logs from inside its own recovery (a handler's panic, a lease given up), and a Logger that
// panicked there took the 500 and the lease's release with it (the key held until its lease
// ran out). A record whose handler panics is dropped.
type safeHandler struct{ h slog.Handler }

// safeLogger returns l with its handler's panics recovered.
func safeLogger(l *slog.Logger) *slog.Logger {
	if _, ok := l.Handler().(safeHandler); ok {
		return l
	}
	return slog.New(safeHandler{l.Handler()})
}

func (s safeHandler) Enabled(ctx context.Context, level slog.Level) (enabled bool) {
	defer func() {
		if recover() != nil {
			enabled = false
		}
	}()
	return s.h.Enabled(ctx, level)
}

func (s safeHandler) Handle(ctx context.Context, r slog.Record) (err error) {
	defer func() {
		if recover() != nil {
			err = nil // dropped: nothing may stop the request's answer or its key's release
		}
	}()
	return s.h.Handle(ctx, r)
}

func (s safeHandler) WithAttrs(attrs []slog.Attr) (h slog.Handler) {
	defer func() {
		if recover() != nil {
			h = s // the attributes are lost, the handler kept
		}
	}()
	return safeHandler{s.h.WithAttrs(attrs)}
}

func (s safeHandler) WithGroup(name string) (h slog.Handler) {
	defer func() {
		if recover() != nil {
			h = s
		}
	}()
	return safeHandler{s.h.WithGroup(name)}
}
