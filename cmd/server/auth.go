package main

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"net/http"
	"strings"

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
		if _, err := tx.Exec(ctx, `INSERT INTO ledger.principals (id, name) VALUES ($1, $2)`, id, name); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO ledger.api_tokens (principal_id, name, token_sha256) VALUES ($1, 'initial', $2)`, id, sum)
		return err
	})
	return id, token, err
}

type principalKey struct{}

func principalOf(ctx context.Context) (string, bool) {
	p, ok := ctx.Value(principalKey{}).(string)
	return p, ok
}

// bearer reads "Authorization: Bearer <token>"; the scheme is case-insensitive (RFC 9110,
// section 11.1). A request with more than one Authorization field has none that counts: which
// one a proxy or a server reads differs (RFC 6750, section 3.1: an invalid_request).
func bearer(r *http.Request) (string, bool) {
	if len(r.Header.Values("Authorization")) != 1 {
		return "", false
	}
	scheme, token, ok := strings.Cut(strings.TrimSpace(r.Header.Get("Authorization")), " ")
	token = strings.TrimSpace(token)
	return token, ok && strings.EqualFold(scheme, "Bearer") && token != "" && len(token) <= 200
}

// authenticate resolves the bearer token to a principal, or answers 401.
func (s *ledger) authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token, ok := bearer(r)
		if !ok {
			w.Header().Set("WWW-Authenticate", `Bearer realm="idem"`)
			problem(w, r, http.StatusUnauthorized, "unauthorized", "send Authorization: Bearer <token>")
			return
		}
		sum := sha256.Sum256([]byte(token))
		var principal string
		err := s.pool.QueryRow(r.Context(), `SELECT principal_id FROM ledger.api_tokens WHERE token_sha256 = $1`, sum[:]).Scan(&principal)
		if errors.Is(err, pgx.ErrNoRows) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="idem", error="invalid_token"`)
			problem(w, r, http.StatusUnauthorized, "unauthorized", "the token is not valid")
			return
		}
		if err != nil {
			s.serverError(w, r, err)
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), principalKey{}, principal)))
	})
}
