package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/go-json-experiment/json/jsontext"
	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
)

// Stepped payouts: a lease route whose work writes to the ledger in steps (idem.Step), each
// step's writes committed with its recovery point, fenced by the claim's token:
//
//  1. reserve: the account's balance goes down by the amount and a reservation row records it;
//  2. pay: the provider is called with the request's provider key, and its reference is saved;
//  3. settle: the reservation becomes a payout (ledger.payouts);
//
// and then the answer, which the middleware stores. A server killed between two steps (or its
// lease lost) leaves the steps done recorded with the key: the client's retry takes the lease
// over and goes on after them, so the reservation, the provider's payout and the settlement
// each happen once, whatever the kill point. A kill in the middle of the provider call repeats
// the call under the same provider key, which the provider answers from its record.

var (
	errInsufficient = errors.New("insufficient funds")
	errNoAccount    = errors.New("no such account")
)

func (s *ledger) createSteppedPayout(w http.ResponseWriter, r *http.Request) {
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
	claim, _ := idem.ClaimOf(ctx)

	reservation, err := idem.Step(ctx, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
		tag, err := tx.Exec(ctx, `UPDATE ledger.accounts SET balance = balance - $1, `+nextRevision+`
			WHERE id = $2 AND principal_id = $3 AND balance >= $1`, amt, account, principal)
		if err != nil {
			return 0, err
		}
		if tag.RowsAffected() == 0 {
			var exists bool
			if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM ledger.accounts WHERE id = $1 AND principal_id = $2)`,
				account, principal).Scan(&exists); err != nil {
				return 0, err
			}
			if !exists {
				return 0, errNoAccount
			}
			return 0, errInsufficient
		}
		var id int64
		err = tx.QueryRow(ctx, `INSERT INTO ledger.payout_reservations (principal_id, account_id, amount, idempotency_key)
			VALUES ($1, $2, $3, $4) RETURNING id`, principal, account, amt, claim.Key).Scan(&id)
		return id, err
	})
	switch {
	case errors.Is(err, errNoAccount):
		accountNotFound(w, r)
		return
	case errors.Is(err, errInsufficient):
		problem(w, r, http.StatusUnprocessableEntity, "insufficient_funds", "the account's balance is lower than the amount")
		return
	case err != nil:
		s.serverError(w, r, err)
		return
	}
	s.pause(ctx)

	// The provider's call, its reference saved as the step's value: a retry after this step
	// does not call again. The call writes nothing to the ledger; a kill during it repeats it
	// under the same provider key, which the provider deduplicates.
	ref, err := idem.Step(ctx, "pay", func(ctx context.Context, _ pgx.Tx) (string, error) {
		return s.provider.pay(ctx, principal, claim.ProviderKey, amt)
	})
	if err != nil {
		s.stepError(w, r, err)
		return
	}
	s.pause(ctx)

	out, err := idem.Step(ctx, "settle", func(ctx context.Context, tx pgx.Tx) (payout, error) {
		p := payout{AccountID: account, Amount: amt, ProviderRef: ref, ProviderKey: claim.ProviderKey}
		if err := tx.QueryRow(ctx, `INSERT INTO ledger.payouts (principal_id, account_id, amount, provider_ref, idempotency_key)
			VALUES ($1, $2, $3, $4, $5) RETURNING id, created_at`, principal, account, amt, ref, claim.Key).
			Scan(&p.ID, &p.CreatedAt); err != nil {
			return p, err
		}
		_, err := tx.Exec(ctx, `UPDATE ledger.payout_reservations SET payout_id = $1, settled_at = now() WHERE id = $2`,
			p.ID, reservation)
		return p, err
	})
	if err != nil {
		s.stepError(w, r, err)
		return
	}
	s.pause(ctx)
	w.Header().Set("Location", fmt.Sprintf("/v1/payouts/%d", out.ID))
	writeJSON(w, http.StatusCreated, out)
}

// pause waits PAYOUT_STEP_PAUSE after a step (fault tests kill the server then), or until ctx
// ends.
func (s *ledger) pause(ctx context.Context) {
	if s.stepPause <= 0 {
		return
	}
	t := time.NewTimer(s.stepPause)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}
