package main

import (
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/gorilla/mux"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	idemhttp "github.com/pgidem/pgidem/internal/http"
)

//go:embed openapi.json
var openAPI []byte

// problemBase prefixes the ledger's own problem types; idempotency problems use idemhttp's.
const problemBase = "https://github.com/pgidem/pgidem/blob/main/docs/ledger.md#"

// ledger is the reference API: a deliberately small money API whose handlers write through
// the transaction of idemhttp's unit of work.
type ledger struct {
	pool *pgxpool.Pool
	log  *slog.Logger
}

// routes is the server's handler: the router behind the correlation-id middleware.
func (m *Main) routes() (http.Handler, error) {
	r, err := m.router()
	if err != nil {
		return nil, err
	}
	return correlate(m.log, r), nil
}

// router builds the routes: the ledger under /v1 (bearer authentication, idempotency),
// health, version, metrics and the OpenAPI document outside it.
func (m *Main) router() (*mux.Router, error) {
	s := &ledger{pool: m.pool, log: m.log}
	idem, err := idemhttp.New(idemhttp.Options{
		DB:                 m.pool,
		Principal:          principalFromRequest,
		TTL:                m.Config.TTL,
		LockTimeout:        m.Config.LockTimeout,
		MaxBodyBytes:       m.Config.MaxBodyBytes,
		MaxStoredBodyBytes: max(m.Config.MaxStoredBytes, 1),
		Logger:             m.log,
		Metrics:            idemhttp.NewPrometheusObserver(m.registry),
	})
	if err != nil {
		return nil, err
	}
	r := mux.NewRouter()
	r.HandleFunc("/healthz", s.healthz).Methods(http.MethodGet)
	r.HandleFunc("/version", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"version": Version})
	}).Methods(http.MethodGet)
	r.Handle("/metrics", promhttp.HandlerFor(m.registry, promhttp.HandlerOpts{})).Methods(http.MethodGet)
	r.HandleFunc("/openapi.json", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(openAPI)
	}).Methods(http.MethodGet)

	v1 := r.PathPrefix("/v1").Subrouter()
	v1.Use(s.authenticate)
	v1.Use(idem.Handler)
	v1.HandleFunc("/accounts", s.createAccount).Methods(http.MethodPost)
	v1.HandleFunc("/accounts/{id}", s.getAccount).Methods(http.MethodGet)
	v1.HandleFunc("/accounts/{id}/deposits", s.createDeposit).Methods(http.MethodPost)
	v1.HandleFunc("/transfers", s.createTransfer).Methods(http.MethodPost)
	v1.HandleFunc("/api-tokens", s.createToken).Methods(http.MethodPost)
	idem.Declare("POST", "/v1/accounts", idemhttp.Route{Action: "POST /v1/accounts"})
	idem.Declare("POST", "/v1/accounts/{id}/deposits", idemhttp.Route{Action: "POST /v1/accounts/{id}/deposits"})
	idem.Declare("POST", "/v1/transfers", idemhttp.Route{Action: "POST /v1/transfers", Required: m.Config.TransfersRequireKey})
	idem.Declare("POST", "/v1/api-tokens", idemhttp.Route{Action: "POST /v1/api-tokens"})

	r.NotFoundHandler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.problem(w, r, http.StatusNotFound, "not_found", "Not found", "no such route")
	})
	r.MethodNotAllowedHandler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.problem(w, r, http.StatusMethodNotAllowed, "method_not_allowed", "Method not allowed", "")
	})
	return r, nil
}

func principalFromRequest(r *http.Request) (string, bool) { return principalOf(r.Context()) }

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// problem writes an RFC 9457 problem of the ledger.
func (s *ledger) problem(w http.ResponseWriter, r *http.Request, status int, code, title, detail string) {
	writeProblem(w, status, map[string]any{"type": problemBase + code, "title": title, "status": status,
		"detail": detail, "code": code, "correlation_id": requestIDOf(r.Context())})
}

func writeProblem(w http.ResponseWriter, status int, p map[string]any) {
	if p["detail"] == "" {
		delete(p, "detail")
	}
	b, _ := json.Marshal(p)
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

func (s *ledger) serverError(w http.ResponseWriter, r *http.Request, err error) {
	if r.Context().Err() == nil {
		s.log.Error("request failed", "request_id", requestIDOf(r.Context()), "error", err)
	}
	s.problem(w, r, http.StatusInternalServerError, "internal_error", "Internal error", "nothing was changed; retry with the same Idempotency-Key")
}

func (s *ledger) healthz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	if err := s.pool.Ping(ctx); err != nil {
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": "unavailable"})
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

// decode reads a JSON object body into dst strictly (no unknown fields, one value); a
// malformed body is 400, and the caller checks the values (422).
func (s *ledger) decode(w http.ResponseWriter, r *http.Request, dst any) bool {
	dec := json.NewDecoder(r.Body)
	dec.DisallowUnknownFields()
	dec.UseNumber()
	if err := dec.Decode(dst); err != nil || dec.More() {
		s.problem(w, r, http.StatusBadRequest, "malformed_body", "Malformed body", "the body must be one JSON object with the documented members")
		return false
	}
	return true
}

// amount reads a positive integer amount in minor units.
func amount(n json.Number) (int64, bool) {
	v, err := strconv.ParseInt(string(n), 10, 64)
	return v, err == nil && v > 0 && v < math.MaxInt64/2
}

func (s *ledger) invalid(w http.ResponseWriter, r *http.Request, detail string) {
	s.problem(w, r, http.StatusUnprocessableEntity, "validation_failed", "Validation failed", detail)
}

type account struct {
	ID        int64     `json:"id"`
	Name      string    `json:"name"`
	Currency  string    `json:"currency"`
	Balance   int64     `json:"balance"`
	Version   int       `json:"version"`
	CreatedAt time.Time `json:"created_at"`
}

func (a account) send(w http.ResponseWriter, status int) {
	w.Header().Set("ETag", fmt.Sprintf(`"%d"`, a.Version))
	if status == http.StatusCreated {
		w.Header().Set("Location", fmt.Sprintf("/v1/accounts/%d", a.ID))
	}
	writeJSON(w, status, a)
}

func validName(n string) bool { return len(n) >= 1 && len(n) <= 100 && utf8.ValidString(n) }

func (s *ledger) createAccount(w http.ResponseWriter, r *http.Request) {
	var in struct{ Name, Currency string }
	if !s.decode(w, r, &in) {
		return
	}
	if !validName(in.Name) {
		s.invalid(w, r, "name must be 1 to 100 characters")
		return
	}
	if len(in.Currency) != 3 || in.Currency[0] < 'A' || in.Currency[0] > 'Z' || in.Currency[1] < 'A' || in.Currency[1] > 'Z' || in.Currency[2] < 'A' || in.Currency[2] > 'Z' {
		s.invalid(w, r, "currency must be an ISO 4217 code such as EUR")
		return
	}
	principal, _ := principalOf(r.Context())
	var a account
	err := idemhttp.Tx(r.Context()).QueryRow(r.Context(), `INSERT INTO accounts (principal_id, name, currency)
		VALUES ($1, $2, $3) RETURNING id, name, currency, balance, version, created_at`, principal, in.Name, in.Currency).
		Scan(&a.ID, &a.Name, &a.Currency, &a.Balance, &a.Version, &a.CreatedAt)
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	a.send(w, http.StatusCreated)
}

func accountID(r *http.Request) (int64, bool) {
	id, err := strconv.ParseInt(mux.Vars(r)["id"], 10, 64)
	return id, err == nil && id > 0
}

func (s *ledger) getAccount(w http.ResponseWriter, r *http.Request) {
	principal, _ := principalOf(r.Context())
	id, ok := accountID(r)
	var a account
	err := pgx.ErrNoRows
	if ok {
		err = s.pool.QueryRow(r.Context(), `SELECT id, name, currency, balance, version, created_at
			FROM accounts WHERE id = $1 AND principal_id = $2`, id, principal).
			Scan(&a.ID, &a.Name, &a.Currency, &a.Balance, &a.Version, &a.CreatedAt)
	}
	if errors.Is(err, pgx.ErrNoRows) {
		s.problem(w, r, http.StatusNotFound, "account_not_found", "Account not found", "no such account")
		return
	}
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	if r.Header.Get("If-None-Match") == fmt.Sprintf(`"%d"`, a.Version) {
		w.Header().Set("ETag", fmt.Sprintf(`"%d"`, a.Version))
		w.WriteHeader(http.StatusNotModified)
		return
	}
	a.send(w, http.StatusOK)
}

func (s *ledger) createDeposit(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	var in struct{ Amount json.Number }
	if !s.decode(w, r, &in) {
		return
	}
	amt, ok := amount(in.Amount)
	if !ok {
		s.invalid(w, r, "amount must be a positive integer in minor units")
		return
	}
	id, ok := accountID(r)
	principal, _ := principalOf(ctx)
	tx := idemhttp.Tx(ctx)
	var balance int64
	err := pgx.ErrNoRows
	if ok {
		err = tx.QueryRow(ctx, `UPDATE accounts SET balance = balance + $1, version = version + 1
			WHERE id = $2 AND principal_id = $3 RETURNING balance`, amt, id, principal).Scan(&balance)
	}
	if errors.Is(err, pgx.ErrNoRows) {
		s.problem(w, r, http.StatusNotFound, "account_not_found", "Account not found", "no such account")
		return
	}
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	var out struct {
		ID        int64     `json:"id"`
		AccountID int64     `json:"account_id"`
		Amount    int64     `json:"amount"`
		Balance   int64     `json:"balance"`
		CreatedAt time.Time `json:"created_at"`
	}
	err = tx.QueryRow(ctx, `INSERT INTO deposits (account_id, amount, idempotency_key) VALUES ($1, $2, $3)
		RETURNING id, account_id, amount, created_at`, id, amt, nullKey(r)).Scan(&out.ID, &out.AccountID, &out.Amount, &out.CreatedAt)
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	out.Balance = balance
	w.Header().Set("Location", fmt.Sprintf("/v1/accounts/%d/deposits/%d", id, out.ID))
	writeJSON(w, http.StatusCreated, out)
}

// nullKey records which key a request carried, for audits (and the money-invariant test).
func nullKey(r *http.Request) *string {
	if k := r.Header.Get("Idempotency-Key"); k != "" {
		return &k
	}
	return nil
}

func (s *ledger) createTransfer(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	var in struct {
		From, To int64
		Amount   json.Number
	}
	if !s.decode(w, r, &in) {
		return
	}
	amt, ok := amount(in.Amount)
	switch {
	case !ok:
		s.invalid(w, r, "amount must be a positive integer in minor units")
		return
	case in.From <= 0 || in.To <= 0:
		s.invalid(w, r, "from and to must be account ids")
		return
	case in.From == in.To:
		s.invalid(w, r, "from and to must be different accounts")
		return
	}
	principal, _ := principalOf(ctx)
	tx := idemhttp.Tx(ctx)
	// Lock both accounts in id order, so two opposite transfers cannot deadlock.
	rows, err := tx.Query(ctx, `SELECT id, currency, balance FROM accounts
		WHERE id IN ($1, $2) AND principal_id = $3 ORDER BY id FOR UPDATE`, in.From, in.To, principal)
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	type acc struct {
		currency string
		balance  int64
	}
	found := map[int64]acc{}
	for rows.Next() {
		var id int64
		var a acc
		if err := rows.Scan(&id, &a.currency, &a.balance); err != nil {
			rows.Close()
			s.serverError(w, r, err)
			return
		}
		found[id] = a
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		s.serverError(w, r, err)
		return
	}
	from, okFrom := found[in.From]
	to, okTo := found[in.To]
	switch {
	case !okFrom || !okTo:
		s.problem(w, r, http.StatusNotFound, "account_not_found", "Account not found", "no such account")
		return
	case from.currency != to.currency:
		s.problem(w, r, http.StatusUnprocessableEntity, "currency_mismatch", "Currency mismatch", "both accounts must hold the same currency")
		return
	case from.balance < amt:
		s.problem(w, r, http.StatusUnprocessableEntity, "insufficient_funds", "Insufficient funds",
			"the source account's balance is lower than the amount")
		return
	}
	batch := &pgx.Batch{}
	batch.Queue(`UPDATE accounts SET balance = balance - $1, version = version + 1 WHERE id = $2`, amt, in.From)
	batch.Queue(`UPDATE accounts SET balance = balance + $1, version = version + 1 WHERE id = $2`, amt, in.To)
	var out struct {
		ID        int64     `json:"id"`
		From      int64     `json:"from"`
		To        int64     `json:"to"`
		Amount    int64     `json:"amount"`
		CreatedAt time.Time `json:"created_at"`
	}
	batch.Queue(`INSERT INTO transfers (principal_id, from_id, to_id, amount, idempotency_key) VALUES ($1, $2, $3, $4, $5)
		RETURNING id, from_id, to_id, amount, created_at`, principal, in.From, in.To, amt, nullKey(r)).
		QueryRow(func(row pgx.Row) error {
			return row.Scan(&out.ID, &out.From, &out.To, &out.Amount, &out.CreatedAt)
		})
	if err := tx.SendBatch(ctx, batch).Close(); err != nil {
		s.serverError(w, r, err)
		return
	}
	w.Header().Set("Location", fmt.Sprintf("/v1/transfers/%d", out.ID))
	writeJSON(w, http.StatusCreated, out)
}

func (s *ledger) createToken(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	var in struct{ Name string }
	if !s.decode(w, r, &in) {
		return
	}
	if !validName(in.Name) {
		s.invalid(w, r, "name must be 1 to 100 characters")
		return
	}
	principal, _ := principalOf(ctx)
	token, sum := newToken()
	var id int64
	if err := idemhttp.Tx(ctx).QueryRow(ctx, `INSERT INTO api_tokens (principal_id, name, token_sha256)
		VALUES ($1, $2, $3) RETURNING id`, principal, in.Name, sum).Scan(&id); err != nil {
		s.serverError(w, r, err)
		return
	}
	idemhttp.MarkOneTimeSecret(ctx) // the token is shown once; a repeat gets 409 one_time_secret
	idemhttp.SetResourceID(ctx, strconv.FormatInt(id, 10))
	writeJSON(w, http.StatusCreated, map[string]any{"id": id, "token": token})
}
