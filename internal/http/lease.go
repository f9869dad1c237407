package idemhttp

import (
	"context"
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
)

// lease runs the handler of a committed lease claim and stores (a 2xx or a final error) or
// releases (anything else) its response, fenced by the attempt.
func (q *request) lease(claim dbidem.Claim, attempt int64) State {
	rec, st, v := q.run(nil, true)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(q.r.Context()), 5*time.Second)
	defer cancel()
	if v == rollBack {
		if _, err := dbidem.Release(ctx, q.m.o.DB, claim.Principal, claim.Key, attempt); err != nil {
			q.m.o.Logger.Error("idem: lease not released; the key stays busy until the lease runs out", "error", err,
				"key_hash", keyHash(claim.Principal, claim.Key))
		}
		q.answer(rec)
		return StateAcquired
	}
	resp, big := q.stored(rec, st)
	if big {
		q.m.o.Metrics.Count(q.action, StateOversize)
	}
	if err := dbidem.Complete(ctx, q.m.o.DB, claim.Principal, claim.Key, attempt, resp); err != nil {
		q.m.o.Logger.Error("idem: lease response not recorded; a retry will run the work again once the lease runs out",
			"error", err, "key_hash", keyHash(claim.Principal, claim.Key))
	}
	rec.sendTo(q.w)
	return StateAcquired
}
