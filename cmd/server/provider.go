package main

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// provider is a simulated payment provider, running inside the server, for the payouts route:
// work outside the database that cannot be rolled back. Like a real provider it deduplicates by
// its own idempotency key: the first call with a key accepts a payout (it exists from then on,
// whether the caller waits for the answer or not) and answers after the configured delay; a
// later call with the key answers that payout, once the first call's delay has passed. It
// counts every call per key, for clients that check from outside how often it was called
// (GET /v1/provider/calls/{key}). Its memory is the process's: a restart forgets it.
type provider struct {
	delay time.Duration

	mu      sync.Mutex
	calls   map[string]int
	payouts map[string]*providerPayout
}

type providerPayout struct {
	ref   string
	ready time.Time
}

func newProvider(delay time.Duration) *provider {
	return &provider{delay: delay, calls: map[string]int{}, payouts: map[string]*providerPayout{}}
}

// pay pays amount under the provider's idempotency key and returns the payout's reference.
func (p *provider) pay(ctx context.Context, key string, amount int64) (string, error) {
	p.mu.Lock()
	p.calls[key]++
	po, ok := p.payouts[key]
	if !ok {
		po = &providerPayout{ref: fmt.Sprintf("po_%d_%d", len(p.payouts)+1, amount), ready: time.Now().Add(p.delay)}
		p.payouts[key] = po
	}
	p.mu.Unlock()
	select {
	case <-time.After(time.Until(po.ready)):
		return po.ref, nil
	case <-ctx.Done():
		return "", context.Cause(ctx)
	}
}

// stats is what the provider knows of a key: how many calls it received, and its payout.
func (p *provider) stats(key string) (calls int, ref string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if po, ok := p.payouts[key]; ok {
		ref = po.ref
	}
	return p.calls[key], ref
}
