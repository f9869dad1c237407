package main

import (
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/go-json-experiment/json/jsontext"
	"github.com/gorilla/mux"
	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
)

// Payouts: a lease route (work outside the database). The handler checks the account, calls the
// provider with the claim's provider key (the same for every attempt of the request, so a
// takeover cannot pay twice), then records the payout in a transaction of its own, once per
// provider reference. Its answer is stored by the middleware, fenced by the claim's token.

type payout struct {
	ID          int64     `json:"id"`
	AccountID   int64     `json:"account_id"`
	Amount      int64     `json:"amount"`
	ProviderRef string    `json:"provider_ref"`
	ProviderKey string    `json:"provider_key,omitempty"`
	CreatedAt   time.Time `json:"created_at"`
}

func (s *ledger) createPayout(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	var in struct {
		Account *jsontext.Value `json:"account"`
		Amount  *jsontext.Value `json:"amount"`
	}
	if !idem.DecodeJSON(w, r, &in) {
		return
	}
	if !isNumber(in.Account) || !isNumber(in.Amount) {
		missing(w, r, "account and amount (numbers)")
		return
	}
	amt, kind := amount(*in.Amount)
	if kind != amountOK {
		invalidAmount(w, r)
		return
	}
	account, ok := bodyAccountID(*in.Account)
	if !ok {
		invalid(w, r, "account must be an account id")
		return
	}
	principal, _ := principalOf(ctx)
	var exists bool
	if err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM ledger.accounts WHERE id = $1 AND principal_id = $2)`,
		account, principal).Scan(&exists); err != nil {
		s.serverError(w, r, err)
		return
	}
	if !exists {
		accountNotFound(w, r)
		return
	}
	claim, _ := idem.ClaimOf(ctx)
	ref, err := s.provider.pay(ctx, principal, claim.ProviderKey, amt)
	if err != nil {
		// The lease was lost (the middleware answers for the attempt that holds the key), or
		// the call failed or ran out of time, maybe after the provider acted.
		s.providerFailed(w, r, err)
		return
	}
	out := payout{AccountID: account, Amount: amt, ProviderRef: ref, ProviderKey: claim.ProviderKey}
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, `INSERT INTO ledger.payouts (principal_id, account_id, amount, provider_ref, idempotency_key)
			VALUES ($1, $2, $3, $4, $5)
			ON CONFLICT (principal_id, provider_ref) DO UPDATE SET provider_ref = excluded.provider_ref
			RETURNING id, created_at`, principal, out.AccountID, amt, ref, claim.Key).Scan(&out.ID, &out.CreatedAt)
	})
	if err != nil {
		s.unrecordedPayout(w, r, err)
		return
	}
	w.Header().Set("Location", fmt.Sprintf("/v1/payouts/%d", out.ID))
	writeJSON(w, http.StatusCreated, out)
}

func (s *ledger) getPayout(w http.ResponseWriter, r *http.Request) {
	principal, _ := principalOf(r.Context())
	id, ok := pathID(r, "id")
	var p payout
	err := pgx.ErrNoRows
	if ok {
		err = s.pool.QueryRow(r.Context(), `SELECT id, account_id, amount, provider_ref, created_at
			FROM ledger.payouts WHERE id = $1 AND principal_id = $2`, id, principal).
			Scan(&p.ID, &p.AccountID, &p.Amount, &p.ProviderRef, &p.CreatedAt)
	}
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		problem(w, r, http.StatusNotFound, "payout_not_found", "no such payout")
	case err != nil:
		s.serverError(w, r, err)
	default:
		writeJSON(w, http.StatusOK, p)
	}
}

// providerCalls tells how many calls the simulated provider acted on under a provider key (a
// payout's provider_key: 0 or 1, the call that made the payout), how many later calls under it
// it answered from that payout's record (repeats), and the payout: a client checks from
// outside that a payout was paid once, whatever its retries did.
func (s *ledger) providerCalls(w http.ResponseWriter, r *http.Request) {
	key := mux.Vars(r)["key"]
	principal, _ := principalOf(r.Context())
	calls, repeats, ref, err := s.provider.stats(r.Context(), principal, key)
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"provider_key": key, "calls": calls, "repeats": repeats, "provider_ref": ref})
}
