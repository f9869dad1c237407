package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// provider is a simulated payment provider for the payouts route: work outside the ledger's
// transactions that cannot be rolled back. It keeps its records where an outside provider
// keeps its own, away from the server's memory: in the database's schema provider (ledger
// migration 005), written in statements of their own, outside any transaction of the ledger,
// so a restart or a second replica of the server sees every payout it accepted.
//
// Like a real provider it deduplicates by its own idempotency key (the claim's provider key):
// the first call with a key accepts a payout (it exists from then on, whether the caller waits
// for the answer or not) and answers after the configured delay; a later call with the key
// answers that payout once the first call's delay has passed, and one with another amount is
// refused (as Stripe refuses an idempotency key reused with other parameters). It counts
// every call per key, for clients that check from outside how often it was called (GET
// /v1/provider/calls/{key}). References come from a sequence: unique across restarts and
// replicas.
type provider struct {
	pool  *pgxpool.Pool
	delay time.Duration
}

// errProviderKeyReused: a call under a provider key that an earlier call used with another
// amount.
var errProviderKeyReused = errors.New("provider: idempotency key reused with another amount")

func newProvider(pool *pgxpool.Pool, delay time.Duration) *provider {
	return &provider{pool: pool, delay: delay}
}

// pay pays amount under the provider's idempotency key, for principal, and returns the
// payout's reference.
func (p *provider) pay(ctx context.Context, principal, key string, amount int64) (string, error) {
	var (
		ref    string
		stored int64
		wait   int64 // microseconds until the payout's answer is ready, by the database's clock (D231: no float read as text)
	)
	err := p.pool.QueryRow(ctx, `INSERT INTO provider.payouts (idempotency_key, ref, amount, ready_at, principal_id)
		VALUES ($1, 'po_' || nextval('provider.payout_ref_seq'), $2, clock_timestamp() + $3::interval, $4)
		ON CONFLICT (idempotency_key) DO UPDATE SET calls = provider.payouts.calls + 1
		RETURNING ref, amount, (greatest(extract(epoch FROM ready_at - clock_timestamp()), 0) * 1000000)::bigint`,
		key, amount, fmt.Sprintf("%d microseconds", p.delay.Microseconds()), principal).Scan(&ref, &stored, &wait)
	if err != nil {
		return "", fmt.Errorf("provider: %w", err)
	}
	if stored != amount {
		return "", fmt.Errorf("%w (%d, then %d)", errProviderKeyReused, stored, amount)
	}
	t := time.NewTimer(time.Duration(wait) * time.Microsecond)
	defer t.Stop()
	select {
	case <-t.C:
		return ref, nil
	case <-ctx.Done():
		return "", context.Cause(ctx)
	}
}

// stats is what the provider knows of a key: how many of its calls it acted on (made the
// payout: 0 or 1), how many later calls it answered from that payout's record instead
// (repeats: a retry or a takeover that called again under the same key), and the payout. It
// tells principal of its own calls only: another's key is a key it never saw. A call recorded
// before ledger migration 008 (no principal) is principal's when the ledger recorded a payout
// of principal under its reference.
func (p *provider) stats(ctx context.Context, principal, key string) (calls, repeats int, ref string, err error) {
	var received int
	err = p.pool.QueryRow(ctx, `SELECT calls, ref FROM provider.payouts AS p WHERE idempotency_key = $1
		AND (principal_id = $2 OR principal_id IS NULL
			AND EXISTS (SELECT FROM ledger.payouts AS l WHERE l.principal_id = $2 AND l.provider_ref = p.ref))`,
		key, principal).Scan(&received, &ref)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, 0, "", nil
	}
	if err != nil {
		return 0, 0, "", err
	}
	return 1, received - 1, ref, nil
}
