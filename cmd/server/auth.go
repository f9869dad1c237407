package main

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// newToken returns a bearer token and the SHA-256 that is stored instead of it.
func newToken() (string, []byte) {
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	token := "idem_" + base64.RawURLEncoding.EncodeToString(b)
	sum := sha256.Sum256([]byte(token))
	return token, sum[:]
}

// createPrincipal creates a principal with one token, and returns the id and the token;
// only the token's hash is stored.
func createPrincipal(ctx context.Context, pool *pgxpool.Pool, name string) (id, token string, err error) {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	id = "p_" + hex.EncodeToString(b)
	token, sum := newToken()
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO principals (id, name) VALUES ($1, $2)`, id, name); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO api_tokens (principal_id, name, token_sha256) VALUES ($1, 'initial', $2)`, id, sum)
		return err
	})
	return id, token, err
}

type ctxKey int

const (
	principalKey ctxKey = iota
	requestIDKey
)

func principalOf(ctx context.Context) (string, bool) {
	p, ok := ctx.Value(principalKey).(string)
	return p, ok
}

func requestIDOf(ctx context.Context) string {
	id, _ := ctx.Value(requestIDKey).(string)
	return id
}

// authenticate resolves "Authorization: Bearer <token>" to a principal, or answers 401.
func (s *ledger) authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || token == "" || len(token) > 200 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="idem"`)
			s.problem(w, r, http.StatusUnauthorized, "unauthorized", "Authentication required", "send Authorization: Bearer <token>")
			return
		}
		sum := sha256.Sum256([]byte(token))
		var principal string
		err := s.pool.QueryRow(r.Context(), `SELECT principal_id FROM api_tokens WHERE token_sha256 = $1`, sum[:]).Scan(&principal)
		if errors.Is(err, pgx.ErrNoRows) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="idem", error="invalid_token"`)
			s.problem(w, r, http.StatusUnauthorized, "unauthorized", "Authentication required", "the token is not valid")
			return
		}
		if err != nil {
			s.serverError(w, r, err)
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), principalKey, principal)))
	})
}

// correlate gives every request a correlation id (the client's X-Request-Id when it is a
// short visible-ASCII value, else a new one), puts it on the response and in the request's
// logger, and logs the request.
func correlate(log *slog.Logger, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		id := r.Header.Get("X-Request-Id")
		if !validRequestID(id) {
			b := make([]byte, 12)
			_, _ = rand.Read(b)
			id = hex.EncodeToString(b)
		}
		r.Header.Set("X-Request-Id", id)
		w.Header().Set("X-Request-Id", id)
		sw := &statusWriter{ResponseWriter: w, status: http.StatusOK}
		next.ServeHTTP(sw, r.WithContext(context.WithValue(r.Context(), requestIDKey, id)))
		log.Info("request", "request_id", id, "method", r.Method, "path", r.URL.Path, "status", sw.status,
			"replayed", sw.Header().Get("Idempotent-Replayed") == "true", "duration_ms", time.Since(start).Milliseconds())
	})
}

func validRequestID(id string) bool {
	if len(id) < 1 || len(id) > 64 {
		return false
	}
	for i := 0; i < len(id); i++ {
		if id[i] < 0x21 || id[i] > 0x7e {
			return false
		}
	}
	return true
}

type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	w.status = code
	w.ResponseWriter.WriteHeader(code)
}
